from django.urls import path

from . import views

urlpatterns = [
    path("", views.probes_page, name="probes"),
    path("new/", views.probe_submit, name="probe_submit"),
    path("<uuid:probe_id>/", views.probe_detail, name="probe_detail"),
    path("<uuid:probe_id>/cancel/", views.probe_cancel, name="probe_cancel"),
    path("<uuid:probe_id>/save-vector/", views.probe_vector_save, name="probe_vector_save"),
    path(
        "<uuid:probe_id>/probe.json",
        views.probe_download,
        {"file_format": "json"},
        name="probe_json",
    ),
    path(
        "<uuid:probe_id>/probe.csv", views.probe_download, {"file_format": "csv"}, name="probe_csv"
    ),
    path("strip/<uuid:run_id>/", views.probe_score_strip, name="probe_score_strip"),
]
