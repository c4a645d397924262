"""Only the usage pages, mounted where acs_portal/urls.py mounts them, so these tests do not
depend on every other app's URLs importing cleanly."""

from django.urls import include, path

urlpatterns = [path("usage/", include("accounts.usage_urls"))]
