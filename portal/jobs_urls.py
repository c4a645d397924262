from django.urls import path

from . import jobs_views

app_name = "jobs_portal"

urlpatterns = [
    path("", jobs_views.jobs_page, name="index"),
    path("completion/", jobs_views.completion_job_create, name="completion-create"),
    path("harvest/", jobs_views.harvest_job_create, name="harvest-create"),
    path(
        "completion/<str:job_id>/result.json",
        jobs_views.completion_result,
        name="completion-result",
    ),
    path("harvest/<str:job_id>/cancel", jobs_views.harvest_cancel, name="harvest-cancel"),
]
