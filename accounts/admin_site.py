"""The Django admin's site (the default `admin.site`, named by `accounts.apps.AdminConfig`):
Django's, signing in through the throttled login form, asking staff for their second factor
before any of its pages, and checking the old password of its password change through the
throttle too."""

from functools import partial, update_wrapper

from django.contrib import admin
from django.contrib.auth.views import PasswordChangeView
from django.urls import reverse

from .access import second_factor_pending, second_factor_redirect, second_factor_verified
from .forms import AdminLoginForm, OwnPasswordChangeForm


class AdminSite(admin.AdminSite):
    login_form = AdminLoginForm

    def has_permission(self, request):
        return super().has_permission(request) and second_factor_verified(request)

    def admin_view(self, view, cacheable=False):
        """Every page of the admin but its login: a staff member who has not passed their
        second factor in this session is sent to it (to enrol one, if they have none), and
        back after. (Without it, `has_permission` would send them to the login page.)"""
        inner = super().admin_view(view, cacheable)

        def second_factor_first(request, *args, **kwargs):
            if second_factor_pending(request):
                return second_factor_redirect(request)
            return inner(request, *args, **kwargs)

        return update_wrapper(second_factor_first, inner)

    def password_change(self, request, extra_context=None):
        """Django's, with the form that checks the old password through the throttle (given the
        request, for the client's address)."""
        request.current_app = self.name
        return PasswordChangeView.as_view(
            form_class=partial(OwnPasswordChangeForm, request=request),
            success_url=reverse("admin:password_change_done", current_app=self.name),
            extra_context={**self.each_context(request), **(extra_context or {})},
        )(request)
