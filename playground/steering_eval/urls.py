"""The steering evaluation's URLs, included under /playground/steering-eval/ in the
playground's namespace."""

from django.urls import path

from . import views

urlpatterns = [
    path("", views.steering_eval_page, name="steering_eval"),
    path("new/", views.steering_eval_submit, name="steering_eval_submit"),
    path("<uuid:evaluation_id>/", views.steering_eval_detail, name="steering_eval_detail"),
    path("<uuid:evaluation_id>/cancel/", views.steering_eval_cancel, name="steering_eval_cancel"),
    path(
        "<uuid:evaluation_id>/numbers.json",
        views.steering_eval_download,
        {"file_format": "json"},
        name="steering_eval_json",
    ),
    path(
        "<uuid:evaluation_id>/numbers.csv",
        views.steering_eval_download,
        {"file_format": "csv"},
        name="steering_eval_csv",
    ),
]
