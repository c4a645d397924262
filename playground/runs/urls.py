"""The run pages' URLs, included by `playground.urls` (their names are the playground's:
`playground:<name>`)."""

from django.urls import path

from . import views

urlpatterns = [
    path("", views.playground_page, name="page"),
    path("runs/", views.run_history, name="run_history"),
    path("runs/new/", views.run_submit, name="run_submit"),
    path("tokens/", views.prompt_tokens, name="prompt_tokens"),
    path("runs/<uuid:run_id>/", views.run_detail, name="run_detail"),
    path("requests/<str:request_id>/", views.run_for_request, name="run_for_request"),
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
]
