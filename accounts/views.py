"""Portal pages: landing/dashboard, sign-up and login, API keys, and the staff pages.

Views are thin: load (another user's key is a 404), validate a form, call one service, then
redirect (plain POST) or render the page's partial (htmx), so every page works without JS.
"""

from django.contrib import messages
from django.contrib.auth import login
from django.core.exceptions import ValidationError
from django.core.paginator import Paginator
from django.db.models import Q
from django.shortcuts import get_object_or_404, redirect, render
from django.templatetags.static import static
from django.utils.cache import add_never_cache_headers
from django.views.decorators.http import require_http_methods, require_POST
from django_htmx.http import reswap, retarget

from . import selectors, services
from .access import approved_required, forbidden, staff_required
from .forms import (
    ApplicationForm,
    AuditFilterForm,
    DecisionForm,
    KeyBudgetForm,
    KeyCreateForm,
    KeyRenameForm,
    SignupForm,
    SpendCapForm,
    StaffKeyBudgetForm,
    UserBudgetForm,
    UserSearchForm,
)
from .htmx import with_messages
from .models import (
    AccessApplication,
    ApiKey,
    ApplicationStatus,
    AuditLog,
    KeyStatus,
    ServiceSettings,
    User,
    UserStatus,
)

# ---------------------------------------------------------------------------------------
# Landing page and dashboard


def favicon(request):
    """Browsers ask for /favicon.ico even of pages that link no icon (a JSON download, the
    admin); send them to the site's icon."""
    return redirect(static("img/favicon.svg"))


def home(request):
    user = request.user
    context = {}
    if user.is_authenticated:
        context["application"] = user.applications.first()
        if user.is_approved:
            context["key_panels"] = [
                {"key": key, "panel": selectors.budget_panel(key=key)}
                for key in selectors.user_keys(user=user)
                if key.status != KeyStatus.REVOKED
            ]
        if user.is_staff:
            context["pending_applications"] = AccessApplication.objects.filter(
                status=ApplicationStatus.PENDING
            ).count()
    return render(request, "accounts/home.html", context)


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
                services.application_submit(user=user, **form.cleaned_data)
            else:
                user = services.user_signup(**form.cleaned_data)
                login(request, user, backend="django.contrib.auth.backends.ModelBackend")
        except ValidationError as error:
            form.add_error(None, error)
        else:
            messages.success(request, "Thank you: your application is waiting for review.")
            return redirect("home")
    return render(request, "accounts/apply.html", {"form": form})


# ---------------------------------------------------------------------------------------
# API keys


def _key_rows(user, overrides=None):
    overrides = overrides or {}
    rows = []
    for key in selectors.user_keys(user=user):
        row = {
            "key": key,
            "panel": selectors.budget_panel(key=key),
            "rename_form": KeyRenameForm(initial={"name": key.name}, prefix=f"rename-{key.pk}"),
            "budget_form": KeyBudgetForm.for_key(key),
            "errors": [],
        }
        row.update(overrides.get(key.pk, {}))
        rows.append(row)
    return rows


def _render_keys(request, *, create_form=None, overrides=None):
    context = {
        "reveals": services.api_key_reveals_take(user=request.user),
        "rows": _key_rows(request.user, overrides),
        "create_form": create_form or KeyCreateForm(),
        "account_budget": request.user.monthly_token_budget,
    }
    template = "accounts/keys.html#key_list" if request.htmx else "accounts/keys.html"
    response = render(request, template, context)
    # The page may show a new key's secret: no browser or proxy cache may keep a copy.
    add_never_cache_headers(response)
    return response


def _keys_done(request):
    return _render_keys(request) if request.htmx else redirect("keys")


@approved_required
@require_http_methods(["GET", "POST"])
def keys(request):
    """The API keys page; POST creates a key, whose secret the next render shows once."""
    if request.method == "GET":
        return _render_keys(request)
    form = KeyCreateForm(request.POST)
    if not form.is_valid():
        return _render_keys(request, create_form=form)
    key, secret = services.api_key_create(
        user=request.user, name=form.cleaned_data["name"], acting_user=request.user
    )
    services.api_key_reveal_store(key=key, secret=secret)
    return _keys_done(request)


def _owned_key(request, key_id) -> ApiKey:
    return get_object_or_404(ApiKey.objects.select_related("user"), pk=key_id, user=request.user)


def _refuse_managed(request, key):
    return forbidden(
        request,
        "The playground key is managed by the portal: you can pause and resume it, "
        "but not rename or revoke it.",
        title="Managed key",
    )


@approved_required
@require_POST
def key_rename(request, key_id):
    key = _owned_key(request, key_id)
    if key.is_playground:
        return _refuse_managed(request, key)
    form = KeyRenameForm(request.POST, prefix=f"rename-{key.pk}")
    if form.is_valid():
        try:
            services.api_key_rename(
                key=key, acting_user=request.user, name=form.cleaned_data["name"]
            )
            return _keys_done(request)
        except ValidationError as error:
            form.add_error(None, error)
    return _render_keys(request, overrides={key.pk: {"rename_form": form}})


@approved_required
@require_POST
def key_budget(request, key_id):
    key = _owned_key(request, key_id)
    form = KeyBudgetForm.for_key(key, request.POST)
    if form.is_valid():
        try:
            services.api_key_budget_set(
                key=key, acting_user=request.user, budgets=form.cleaned_data
            )
            return _keys_done(request)
        except ValidationError as error:
            form.add_error(None, error)
    return _render_keys(request, overrides={key.pk: {"budget_form": form}})


def _key_status_view(service, *, managed_allowed):
    @approved_required
    @require_POST
    def view(request, key_id):
        key = _owned_key(request, key_id)
        if key.is_playground and not managed_allowed:
            return _refuse_managed(request, key)
        try:
            service(key=key, acting_user=request.user)
        except ValidationError as error:
            return _render_keys(request, overrides={key.pk: {"errors": error.messages}})
        return _keys_done(request)

    return view


key_disable = _key_status_view(services.api_key_disable, managed_allowed=True)
key_enable = _key_status_view(services.api_key_enable, managed_allowed=True)
_key_revoke_post = _key_status_view(services.api_key_revoke, managed_allowed=False)


@approved_required
@require_http_methods(["GET", "POST"])
def key_revoke(request, key_id):
    """GET: a confirmation page (the no-JS path); POST: revoke for good."""
    if request.method == "POST":
        return _key_revoke_post(request, key_id)
    key = _owned_key(request, key_id)
    if key.is_playground:
        return _refuse_managed(request, key)
    return render(request, "accounts/key_revoke.html", {"key": key})


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
    application = get_object_or_404(AccessApplication, pk=application_id)
    form = DecisionForm(request.POST)
    if not form.is_valid():
        return _render_queue(request, errors={application.pk: ["Choose approve or reject."]})
    rejecting = form.cleaned_data["decision"] == "reject"
    if rejecting and not form.cleaned_data["confirmed"]:
        return _reject_confirmation(request, application, note=form.cleaned_data["note"])
    decide = services.application_reject if rejecting else services.application_approve
    try:
        decide(application=application, acting_user=request.user, note=form.cleaned_data["note"])
    except ValidationError as error:
        return _render_queue(request, errors={application.pk: error.messages})
    email = application.user.email
    if rejecting:
        messages.success(request, f"Rejected the application of {email}; they are e-mailed.")
    else:
        messages.success(
            request,
            f"Approved {email}: they are e-mailed, and their first key waits on their API "
            "keys page.",
        )
    if request.htmx:
        return with_messages(request, _render_queue(request))
    return redirect("staff_applications")


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


def _render_staff_user(request, user, *, account_form=None, key_forms=None, errors=()):
    key_forms = key_forms or {}
    keys = list(ApiKey.objects.filter(user=user).select_related("user"))
    key_ids = [str(key.pk) for key in keys]
    audit = AuditLog.objects.filter(
        Q(target_type="user", target_id=str(user.pk))
        | Q(target_type="apikey", target_id__in=key_ids)
    ).select_related("actor")[:50]
    context = {
        "subject": user,
        "applications": user.applications.select_related("decided_by"),
        "rows": [
            {
                "key": key,
                "panel": selectors.budget_panel(key=key),
                "budget_form": key_forms.get(key.pk)
                or StaffKeyBudgetForm.for_key(key, prefix=f"staff-budget-{key.pk}"),
            }
            for key in keys
        ],
        "account_form": account_form
        or UserBudgetForm(initial={"monthly_token_budget": user.monthly_token_budget}),
        "audit": audit,
        "errors": errors,
    }
    return render(request, "staff/user_detail.html", context)


@staff_required
def staff_user_detail(request, user_id):
    return _render_staff_user(request, get_object_or_404(User, pk=user_id))


@staff_required
@require_POST
def staff_user_status(request, user_id):
    user = get_object_or_404(User, pk=user_id)
    actions = {"suspend": services.user_suspend, "reactivate": services.user_reactivate}
    action = actions.get(request.POST.get("action"))
    if action is None:
        return _render_staff_user(request, user, errors=["Choose suspend or reactivate."])
    try:
        action(user=user, acting_user=request.user, note=request.POST.get("note", ""))
    except ValidationError as error:
        return _render_staff_user(request, user, errors=error.messages)
    messages.success(request, f"{user.email} is now {user.status}.")
    return redirect("staff_user_detail", user_id=user.pk)


@staff_required
@require_POST
def staff_user_budget(request, user_id):
    user = get_object_or_404(User, pk=user_id)
    form = UserBudgetForm(request.POST)
    if form.is_valid():
        try:
            services.user_budget_set(
                user=user,
                acting_user=request.user,
                monthly_token_budget=form.cleaned_data["monthly_token_budget"],
            )
            messages.success(request, "Account budget saved.")
            return redirect("staff_user_detail", user_id=user.pk)
        except ValidationError as error:
            form.add_error(None, error)
    return _render_staff_user(request, user, account_form=form)


@staff_required
@require_POST
def staff_key_budget(request, key_id):
    key = get_object_or_404(ApiKey.objects.select_related("user"), pk=key_id)
    form = StaffKeyBudgetForm.for_key(key, request.POST, prefix=f"staff-budget-{key.pk}")
    if form.is_valid():
        try:
            services.api_key_budget_set(
                key=key, acting_user=request.user, budgets=form.cleaned_data
            )
            messages.success(request, f"Budgets of {key} saved.")
            return redirect("staff_user_detail", user_id=key.user_id)
        except ValidationError as error:
            form.add_error(None, error)
    return _render_staff_user(request, key.user, key_forms={key.pk: form})


@staff_required
@require_POST
def staff_key_status(request, key_id):
    key = get_object_or_404(ApiKey.objects.select_related("user"), pk=key_id)
    actions = {
        "disable": services.api_key_disable,
        "enable": services.api_key_enable,
        "revoke": services.api_key_revoke,
    }
    action = actions.get(request.POST.get("action"))
    if action is None:
        return _render_staff_user(request, key.user, errors=["Choose disable, enable or revoke."])
    try:
        action(key=key, acting_user=request.user)
    except ValidationError as error:
        return _render_staff_user(request, key.user, errors=error.messages)
    messages.success(request, f"{key} updated.")
    return redirect("staff_user_detail", user_id=key.user_id)


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
            services.service_spend_cap_set(
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
