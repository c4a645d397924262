from django.contrib import admin
from django.urls import include, path, re_path

from api.views import docs as api_docs_view
from api.views import not_found as api_not_found

urlpatterns = [
    path("v1/", include("api.urls")),
    path("v1/", include("api.jobs.urls")),
    re_path(r"^v1/(?P<path>.*)$", api_not_found),
    path("jobs/", include("portal.jobs_urls")),
    path("playground/", include("playground.urls")),
    path("usage/", include("portal.usage_urls")),
    path("admin/", admin.site.urls),
    path("docs/", api_docs_view, name="api_docs"),
    path("", include("accounts.urls")),
    path("", include("portal.urls")),
]
