"""The steering pages' URLs, included by `playground.urls` (their names are the playground's:
`playground:<name>`)."""

from django.urls import path

from . import views

urlpatterns = [
    path("steer/", views.steering_submit, name="steer"),
    path("groups/<uuid:group>/", views.group_detail, name="group_detail"),
    path(
        "groups/<uuid:group>/numbers.json",
        views.group_download,
        {"file_format": "json"},
        name="group_json",
    ),
    path(
        "groups/<uuid:group>/numbers.csv",
        views.group_download,
        {"file_format": "csv"},
        name="group_csv",
    ),
]
