from django.urls import path

from . import views

# Included by playground/urls.py under "patchscopes/", in the playground's namespace.
urlpatterns = [
    path("", views.patchscopes_page, name="patchscopes"),
    path("cost/", views.patchscope_cost, name="patchscope_cost"),
    path("new/", views.patchscope_submit, name="patchscope_submit"),
    path("<uuid:patchscope_id>/", views.patchscope_detail, name="patchscope_detail"),
    path("<uuid:patchscope_id>/cancel/", views.patchscope_cancel, name="patchscope_cancel"),
    path(
        "<uuid:patchscope_id>/patchscope.json",
        views.patchscope_download,
        {"file_format": "json"},
        name="patchscope_json",
    ),
    path(
        "<uuid:patchscope_id>/patchscope.csv",
        views.patchscope_download,
        {"file_format": "csv"},
        name="patchscope_csv",
    ),
]
