"""The comparison page's URLs, included by `playground.urls` (their names are the playground's:
`playground:<name>`)."""

from django.urls import path

from . import views

urlpatterns = [
    path("compare/", views.run_compare, name="compare"),
    path("compare/score/", views.run_compare_score, name="compare_score"),
]
