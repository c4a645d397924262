"""The patching pages' URLs, included by `playground.urls` (their names are the playground's:
`playground:<name>`)."""

from django.urls import path

from . import views

urlpatterns = [
    path("patching/", views.patching_page, name="patching"),
    path("patching/new/", views.patching_submit, name="patching_submit"),
    path("patching/<uuid:group>/", views.patching_detail, name="patching_detail"),
    path("patching/<uuid:group>/cancel/", views.patching_cancel, name="patching_cancel"),
    path(
        "patching/<uuid:group>/grid.json",
        views.patching_download,
        {"file_format": "json"},
        name="patching_json",
    ),
    path(
        "patching/<uuid:group>/grid.csv",
        views.patching_download,
        {"file_format": "csv"},
        name="patching_csv",
    ),
]
