"""Account pages: sign-up and login, and the staff pages of applications, users, the audit
log and the spend cap (pages that show budgets are `portal`'s).

Views are thin: load (another user's key is a 404), validate a form, call one service, then
redirect (plain POST) or render the page's partial (htmx), so every page works without JS.
"""

from django.contrib import messages
from django.contrib.auth import login
from django.core.exceptions import ValidationError
from django.core.paginator import Paginator
from django.shortcuts import get_object_or_404, redirect, render
from django.templatetags.static import static
from django.views.decorators.http import require_http_methods, require_POST
from django_htmx.http import reswap, retarget

from . import selectors
from .access import staff_required
from .forms import (
    ApplicationForm,
    AuditFilterForm,
    DecisionForm,
    SignupForm,
    SpendCapForm,
    UserSearchForm,
)
from .models import (
    AccessApplication,
    ServiceSettings,
    UserStatus,
)
from .services import applications, service

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
