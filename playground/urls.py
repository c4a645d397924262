from django.urls import include, path

from . import patching_views, vector_views, views

app_name = "playground"

urlpatterns = [
    path("", views.playground_page, name="page"),
    path("runs/", views.run_history, name="run_history"),
    path("runs/new/", views.run_submit, name="run_submit"),
    path("tokens/", views.prompt_tokens, name="prompt_tokens"),
    path("runs/<uuid:run_id>/", views.run_detail, name="run_detail"),
    path("runs/<uuid:run_id>/events/", views.run_events, name="run_events"),
    path("runs/<uuid:run_id>/rerun/", views.run_rerun, name="run_rerun"),
    path("runs/<uuid:run_id>/edit/", views.run_edit, name="run_edit"),
    path("runs/<uuid:run_id>/figures/<slug:name>/", views.run_figure, name="run_figure"),
    path("runs/<uuid:run_id>/request.json", views.run_request_download, name="run_request"),
    path(
        "runs/<uuid:run_id>/activations.safetensors",
        views.run_activations_download,
        name="run_activations",
    ),
    path("vectors/contrast/", views.vector_contrast_create, name="vector_contrast"),
    path("vectors/upload/", views.vector_upload, name="vector_upload"),
    path("vectors/<int:vector_id>.npy", views.vector_download, name="vector_download"),
    path("vectors/<int:vector_id>/rename/", vector_views.vector_rename, name="vector_rename"),
    path("vectors/<int:vector_id>/delete/", vector_views.vector_delete, name="vector_delete"),
    path(
        "runs/<uuid:run_id>/save-vector/",
        vector_views.vector_save_from_run,
        name="vector_from_run",
    ),
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
    path("compare/", views.run_compare, name="compare"),
    path("compare/score/", views.run_compare_score, name="compare_score"),
    path("patchscopes/", include("playground.patchscopes.urls")),
    path("probes/", include("playground.probes.urls")),
    path("patching/", patching_views.patching_page, name="patching"),
    path("patching/new/", patching_views.patching_submit, name="patching_submit"),
    path("patching/<uuid:group>/", patching_views.patching_detail, name="patching_detail"),
    path("patching/<uuid:group>/cancel/", patching_views.patching_cancel, name="patching_cancel"),
    path(
        "patching/<uuid:group>/grid.json",
        patching_views.patching_download,
        {"file_format": "json"},
        name="patching_json",
    ),
    path(
        "patching/<uuid:group>/grid.csv",
        patching_views.patching_download,
        {"file_format": "csv"},
        name="patching_csv",
    ),
    path("steering-eval/", include("playground.steering_eval.urls")),
]
