"""Who may see a page: decorators for portal views. Refusals are a 403 page saying why.

Staff pages (and the admin, `accounts.admin_site`) also need the staff member's second factor
in this session: one without an authenticator is sent to enrol one, one with it to type a code
(`accounts.views.second_factor_enrol`, `second_factor_verify`), and back after."""

from functools import wraps
from urllib.parse import urlencode

from django.contrib.auth.decorators import login_required
from django.shortcuts import redirect, render
from django.urls import reverse
from django_htmx.http import HttpResponseClientRedirect
from django_otp import user_has_device

from .models import UserStatus


def forbidden(request, message, *, title="Not available"):
    return render(
        request, "accounts/forbidden.html", {"title": title, "message": message}, status=403
    )


def approved_required(view):
    """Logged in and approved; anyone else gets a 403 page saying why."""

    @login_required
    @wraps(view)
    def wrapper(request, *args, **kwargs):
        if not request.user.is_approved:
            reasons = {
                UserStatus.PENDING: "Your application is still being reviewed.",
                UserStatus.REJECTED: "Your application was not approved; you may apply again.",
                UserStatus.SUSPENDED: "Your account is suspended.",
            }
            return forbidden(
                request,
                f"API keys are for approved accounts. {reasons.get(request.user.status, '')}",
            )
        return view(request, *args, **kwargs)

    return wrapper


def staff_required(view):
    """Logged in as staff, with the second factor passed in this session."""

    @login_required
    @wraps(view)
    def wrapper(request, *args, **kwargs):
        if not request.user.is_staff:
            return forbidden(request, "This page is for ACS staff.", title="Staff only")
        if second_factor_pending(request):
            return second_factor_redirect(request)
        return view(request, *args, **kwargs)

    return wrapper


def second_factor_required(user) -> bool:
    """Whether `user` signs in with a second factor after their password: staff do."""
    return user.is_staff


def second_factor_verified(request) -> bool:
    """Whether this session passed its user's second factor: django-otp's OTPMiddleware says
    (a user it did not wrap, as the one the login form has just signed in, has not)."""
    is_verified = getattr(request.user, "is_verified", None)
    return is_verified is not None and is_verified()


def second_factor_pending(request) -> bool:
    """Whether the signed-in user still owes this session their second factor."""
    user = request.user
    return (
        user.is_authenticated
        and second_factor_required(user)
        and not second_factor_verified(request)
    )


def second_factor_url(user, next_url: str) -> str:
    """The page asking `user` for their second factor (enrolling one first when they have
    none), then going on to `next_url`."""
    name = "second_factor_verify" if user_has_device(user) else "second_factor_enrol"
    return f"{reverse(name)}?{urlencode({'next': next_url})}"


def second_factor_redirect(request):
    """To `second_factor_url`, then back to this page. An htmx request navigates the whole
    page there, and back to the page it was sent from (a form swapped into a fragment would
    not do)."""
    if request.htmx:
        back = request.htmx.current_url_abs_path or reverse("home")
        return HttpResponseClientRedirect(second_factor_url(request.user, back))
    return redirect(second_factor_url(request.user, request.get_full_path()))
