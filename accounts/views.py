"""Account pages: sign-up and login, staff's second factor, and the staff pages of
applications, users, the audit log and the spend cap (pages that show budgets are `portal`'s).

Views are thin: load (another user's key is a 404), validate a form, call one service, then
redirect (plain POST) or render the page's partial (htmx), so every page works without JS.
"""

import django_otp
from django.contrib import messages
from django.contrib.auth import login
from django.contrib.auth import views as auth_views
from django.contrib.auth.decorators import login_required
from django.core.exceptions import ValidationError
from django.core.paginator import Paginator
from django.shortcuts import get_object_or_404, redirect, render
from django.templatetags.static import static
from django.urls import reverse
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_http_methods, require_POST
from django_htmx.http import reswap, retarget
from django_otp.plugins.otp_static.models import StaticDevice

from . import selectors
from .access import (
    forbidden,
    second_factor_pending,
    second_factor_required,
    second_factor_url,
    second_factor_verified,
    staff_required,
)
from .forms import (
    ApplicationForm,
    AuditFilterForm,
    DecisionForm,
    LoginForm,
    SecondFactorForm,
    SignupForm,
    SpendCapForm,
    UserSearchForm,
)
from .models import (
    AccessApplication,
    ServiceSettings,
    UserStatus,
)
from .services import applications, second_factor, service

# ---------------------------------------------------------------------------------------
# Landing page and dashboard


def favicon(request):
    """Browsers ask for /favicon.ico even of pages that link no icon (a JSON download, the
    admin); send them to the site's icon."""
    return redirect(static("img/favicon.svg"))


@require_http_methods(["GET", "POST"])
def apply(request):
    """Sign-up for visitors; a new application for a rejected account."""
    user = request.user
    if user.is_authenticated and user.status != UserStatus.REJECTED:
        return redirect("home")
    form_class = ApplicationForm if user.is_authenticated else SignupForm
    form = form_class(request.POST or None)
    if request.method == "POST" and form.is_valid():
        try:
            if user.is_authenticated:
                applications.application_submit(user=user, **form.cleaned_data)
            else:
                user = applications.user_signup(**form.cleaned_data)
                login(request, user, backend="django.contrib.auth.backends.ModelBackend")
        except ValidationError as error:
            form.add_error(None, error)
        else:
            messages.success(request, "Thank you: your application is waiting for review.")
            return redirect("home")
    return render(request, "accounts/apply.html", {"form": form})


# ---------------------------------------------------------------------------------------
# Login and staff's second factor


class LoginView(auth_views.LoginView):
    """Django's login page with the throttled form. Staff go on to their second factor (to
    enrol one, the first time), then where they were going."""

    authentication_form = LoginForm
    redirect_authenticated_user = True

    def get_success_url(self):
        url = super().get_success_url()
        if second_factor_pending(self.request):
            return second_factor_url(self.request.user, url)
        return url


def _next_url(request) -> str:
    """Where to go once the second factor is passed: the page asked for, if it is this site's."""
    url = request.POST.get("next") or request.GET.get("next") or ""
    if url_has_allowed_host_and_scheme(
        url, allowed_hosts={request.get_host()}, require_https=request.is_secure()
    ):
        return url
    return reverse("home")


def _second_factor_passed(request, device):
    """This session has passed its user's second factor with `device` (from now on
    `request.user.is_verified()`), under a new session key, as after a password sign-in."""
    django_otp.login(request, device)
    request.session.cycle_key()


@never_cache
@login_required
@require_http_methods(["GET", "POST"])
def second_factor_verify(request):
    """A staff member types a code of their authenticator app, or a recovery code, after their
    password and before the admin and the staff pages (wrong ones throttled as passwords)."""
    user = request.user
    if not second_factor_required(user):
        return forbidden(request, "This page is for ACS staff.", title="Staff only")
    next_url = _next_url(request)
    if second_factor_verified(request):
        return redirect(next_url)
    if not django_otp.user_has_device(user):
        return redirect(second_factor_url(user, next_url))
    form = SecondFactorForm(request.POST or None, request=request)
    if request.method == "POST" and form.is_valid():
        _second_factor_passed(request, form.device)
        if isinstance(form.device, StaticDevice):
            left = second_factor.recovery_codes_left(user=user)
            messages.warning(
                request,
                f"You signed in with a recovery code; {left} left. If you lost your "
                "authenticator, ask another staff member to reset your second factor (the "
                "admin's user list, “Reset the second factor”), and enrol a new one.",
            )
        return redirect(next_url)
    return render(request, "accounts/second_factor_verify.html", {"form": form, "next": next_url})


@never_cache
@login_required
@require_http_methods(["GET", "POST"])
def second_factor_enrol(request):
    """A staff member with no authenticator yet adds one: the page shows its secret (as an
    otpauth:// URI and as text to type), they confirm with one of its codes, and get recovery
    codes, shown this once."""
    user = request.user
    if not second_factor_required(user):
        return forbidden(request, "This page is for ACS staff.", title="Staff only")
    next_url = _next_url(request)
    if django_otp.user_has_device(user):
        return redirect(second_factor_url(user, next_url))
    device = second_factor.second_factor_enrolment(user=user)
    form = SecondFactorForm(request.POST or None, request=request, enrolling=True)
    if request.method == "POST" and form.is_valid():
        codes = second_factor.second_factor_enrol(device=form.device)
        _second_factor_passed(request, form.device)
        return render(
            request, "accounts/second_factor_codes.html", {"codes": codes, "next": next_url}
        )
    context = {
        "form": form,
        "next": next_url,
        "config_url": device.config_url,
        "secret": second_factor.totp_secret(device),
    }
    return render(request, "accounts/second_factor_enrol.html", context)


# ---------------------------------------------------------------------------------------
# Staff: applications queue


def _render_queue(request, *, errors=None):
    context = {"applications": selectors.application_queue(), "errors": errors or {}}
    template = (
        "staff/applications.html#application_queue" if request.htmx else "staff/applications.html"
    )
    return render(request, template, context)


@staff_required
def staff_applications(request):
    return _render_queue(request)


@staff_required
@require_POST
def staff_application_decide(request, application_id):
    """Approve or reject. With htmx the answer is the application's own card, with the
    decision (or the errors) in it: the card stays where the person clicked, where a message
    at the top of the page would be out of view. Without JS, back to the queue, which shows
    the message at its top."""
    application = get_object_or_404(AccessApplication, pk=application_id)
    form = DecisionForm(request.POST)
    if not form.is_valid():
        return _decision_refused(request, application, ["Choose approve or reject."])
    rejecting = form.cleaned_data["decision"] == "reject"
    if rejecting and not form.cleaned_data["confirmed"]:
        return _reject_confirmation(request, application, note=form.cleaned_data["note"])
    decide = applications.application_reject if rejecting else applications.application_approve
    try:
        decide(application=application, acting_user=request.user, note=form.cleaned_data["note"])
    except ValidationError as error:
        return _decision_refused(request, application, error.messages)
    email = application.user.email
    if rejecting:
        notice = f"Rejected the application of {email}; they are e-mailed."
    else:
        notice = (
            f"Approved {email}: they are e-mailed, and their first key waits on their API "
            "keys page."
        )
    if request.htmx:
        return _application_card(request, application, notice=notice)
    messages.success(request, notice)
    return redirect("staff_applications")


def _application_card(request, application, *, notice="", errors=()):
    application.refresh_from_db()
    context = {"application": application, "notice": notice, "errors": {application.pk: errors}}
    return render(request, "staff/applications.html#application_card", context)


def _decision_refused(request, application, errors):
    if request.htmx:
        return _application_card(request, application, errors=errors)
    return _render_queue(request, errors={application.pk: errors})


def _reject_confirmation(request, application, *, note: str):
    """The step that asks before rejecting (the no-JS path: with JS, the Reject button asks
    with hx-confirm and posts `confirmed`). For htmx, it takes the application's place."""
    context = {"application": application, "note": note}
    if request.htmx:
        response = render(request, "staff/application_reject.html#reject_confirmation", context)
        return reswap(retarget(response, f"#application-{application.pk}"), "outerHTML")
    return render(request, "staff/application_reject.html", context)


# ---------------------------------------------------------------------------------------
# Staff: users


@staff_required
def staff_users(request):
    form = UserSearchForm(request.GET or None)
    filters = form.cleaned_data if form.is_valid() else {}
    users = selectors.user_search(query=filters.get("q", ""), status=filters.get("status", ""))
    page = Paginator(users, 50).get_page(request.GET.get("page"))
    return render(request, "staff/users.html", {"form": form, "page": page})


# ---------------------------------------------------------------------------------------
# Staff: audit log and spend cap


@staff_required
def staff_audit(request):
    form = AuditFilterForm(request.GET or None)
    filters = form.cleaned_data if form.is_valid() else {}
    rows = selectors.audit_search(
        actor=filters.get("actor", ""),
        action=filters.get("action", ""),
        target=filters.get("target", ""),
    )
    page = Paginator(rows, 100).get_page(request.GET.get("page"))
    return render(request, "staff/audit.html", {"form": form, "page": page})


@staff_required
@require_http_methods(["GET", "POST"])
def staff_spend_cap(request):
    current = ServiceSettings.current()
    if request.method == "POST":
        form = SpendCapForm(request.POST)
        if form.is_valid():
            service.service_spend_cap_set(
                paused=form.cleaned_data["paused"],
                reason=form.cleaned_data["reason"],
                acting_user=request.user,
            )
            state = "paused" if form.cleaned_data["paused"] else "running"
            messages.success(request, f"API traffic is now {state}.")
            return redirect("staff_spend_cap")
    else:
        form = SpendCapForm(
            initial={"paused": current.spend_cap_paused, "reason": current.spend_cap_reason}
        )
    return render(request, "staff/spend_cap.html", {"form": form, "current": current})
