"""The vector library's URLs, included by `playground.urls` (their names are the playground's:
`playground:<name>`)."""

from django.urls import path

from . import views

urlpatterns = [
    path("vectors/contrast/", views.vector_contrast_create, name="vector_contrast"),
    path("vectors/upload/", views.vector_upload, name="vector_upload"),
    path("vectors/<int:vector_id>.npy", views.vector_download, name="vector_download"),
    path("vectors/<int:vector_id>/rename/", views.vector_rename, name="vector_rename"),
    path("vectors/<int:vector_id>/delete/", views.vector_delete, name="vector_delete"),
    path(
        "runs/<uuid:run_id>/save-vector/",
        views.vector_save_from_run,
        name="vector_from_run",
    ),
]
