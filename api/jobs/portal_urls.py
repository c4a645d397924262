from django.urls import path

from . import portal_views

app_name = "jobs_portal"

urlpatterns = [
    path("", portal_views.jobs_page, name="index"),
    path("completion/", portal_views.completion_job_create, name="completion-create"),
    path("harvest/", portal_views.harvest_job_create, name="harvest-create"),
    path(
        "completion/<str:job_id>/result.json",
        portal_views.completion_result,
        name="completion-result",
    ),
    path("harvest/<str:job_id>/cancel", portal_views.harvest_cancel, name="harvest-cancel"),
]
