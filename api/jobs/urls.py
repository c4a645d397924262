from django.urls import path

from . import views

app_name = "jobs"

urlpatterns = [
    path("completion-jobs", views.completion_jobs, name="completion-jobs"),
    path("completion-jobs/<str:job_id>", views.completion_job_detail, name="completion-job"),
    path(
        "completion-jobs/<str:job_id>/result",
        views.completion_job_result,
        name="completion-job-result",
    ),
    path("harvest", views.harvest_jobs, name="harvest-jobs"),
    path("harvest/<str:job_id>", views.harvest_job_detail, name="harvest-job"),
    path("harvest/<str:job_id>/files/<str:name>", views.harvest_file, name="harvest-file"),
]
