"""The playground's URLs: each feature's own, under one namespace (`playground:<name>`)."""

from django.urls import include, path

app_name = "playground"

urlpatterns = [
    path("", include("playground.runs.urls")),
    path("", include("playground.vectors.urls")),
    path("", include("playground.steering.urls")),
    path("", include("playground.compare.urls")),
    path("", include("playground.patching.urls")),
    path("patchscopes/", include("playground.patchscopes.urls")),
    path("probes/", include("playground.probes.urls")),
    path("steering-eval/", include("playground.steering_eval.urls")),
]
