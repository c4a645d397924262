"""Who may see a page: decorators for portal views. Refusals are a 403 page saying why."""

from functools import wraps

from django.contrib.auth.decorators import login_required
from django.shortcuts import render

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
    @login_required
    @wraps(view)
    def wrapper(request, *args, **kwargs):
        if not request.user.is_staff:
            return forbidden(request, "This page is for ACS staff.", title="Staff only")
        return view(request, *args, **kwargs)

    return wrapper
