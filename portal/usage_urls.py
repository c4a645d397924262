from django.urls import path

from . import usage_views

app_name = "usage"

urlpatterns = [
    path("", usage_views.usage_page, name="usage"),
    path("export.csv", usage_views.usage_export_csv, name="export_csv"),
    path("requests/", usage_views.request_log, name="requests"),
    path("requests/<int:record_id>/", usage_views.request_detail, name="request_detail"),
    path("staff/", usage_views.staff_overview, name="staff_overview"),
    path("staff/users/<int:user_id>/", usage_views.staff_user_usage, name="staff_user"),
    path(
        "staff/users/<int:user_id>/export.csv",
        usage_views.staff_user_export_csv,
        name="staff_user_export_csv",
    ),
]
