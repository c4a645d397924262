"""The Django admin's site (the default `admin.site`, named by `accounts.apps.AdminConfig`):
Django's, signing in through the throttled login form, and checking the old password of its
password change through the throttle too."""

from functools import partial

from django.contrib import admin
from django.contrib.auth.views import PasswordChangeView
from django.urls import reverse

from .forms import AdminLoginForm, OwnPasswordChangeForm


class AdminSite(admin.AdminSite):
    login_form = AdminLoginForm

    def password_change(self, request, extra_context=None):
        """Django's, with the form that checks the old password through the throttle (given the
        request, for the client's address)."""
        request.current_app = self.name
        return PasswordChangeView.as_view(
            form_class=partial(OwnPasswordChangeForm, request=request),
            success_url=reverse("admin:password_change_done", current_app=self.name),
            extra_context={**self.each_context(request), **(extra_context or {})},
        )(request)
