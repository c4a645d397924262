from django.urls import path

from . import views

app_name = "api"

urlpatterns = [
    path("chat/completions", views.chat_completions, name="chat_completions"),
    path("models", views.models, name="models"),
    path("models/<str:model_id>", views.model_detail, name="model_detail"),
    path("models/<str:model_id>/status", views.model_status, name="model_status"),
    path("usage", views.usage, name="usage"),
    path("openapi.json", views.openapi, name="openapi"),
    path("docs", views.docs, name="docs"),
]
