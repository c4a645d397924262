"""Pages that combine accounts with metering: the dashboard, the API keys page and the
staff page of one user, each showing budget panels.

Views are thin: load (another user's key is a 404), validate a form, call one service, then
redirect (plain POST) or render the page's partial (htmx), so every page works without JS.
"""

from django.contrib import messages
from django.core.exceptions import ValidationError
from django.db.models import Q
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils.cache import add_never_cache_headers
from django.views.decorators.http import require_http_methods, require_POST

from accounts import selectors
from accounts.access import approved_required, forbidden, staff_required
from accounts.forms import KeyCreateForm, KeyRenameForm
from accounts.models import ApiKey, AuditLog, KeyStatus, User
from accounts.services import keys as key_services
from accounts.services import users
from metering import limits, windows
from metering.forms import account_budget_form, key_budget_form
from metering.selectors import budget_panel

# ---------------------------------------------------------------------------------------
# Dashboard


def home(request):
    user = request.user
    context = {}
    if user.is_authenticated:
        context["application"] = user.applications.first()
        if user.is_approved:
            context["key_panels"] = [
                {"key": key, "panel": budget_panel(key=key)}
                for key in selectors.user_keys(user=user)
                if key.status != KeyStatus.REVOKED
            ]
            context["budget_resets"] = windows.period_resets()
        if user.is_staff:
            context["pending_applications"] = selectors.pending_applications_count()
    return render(request, "portal/home.html", context)


# ---------------------------------------------------------------------------------------
# API keys


def _key_row(key, **overrides) -> dict:
    return {
        "key": key,
        "panel": budget_panel(key=key),
        "rename_form": KeyRenameForm(initial={"name": key.name}, prefix=f"rename-{key.pk}"),
        "budget_form": key_budget_form(key),
        "errors": [],
        **overrides,
    }


def _key_rows(user, overrides=None):
    overrides = overrides or {}
    return [_key_row(key, **overrides.get(key.pk, {})) for key in selectors.user_keys(user=user)]


def _render_keys(request, *, create_form=None, overrides=None):
    context = {
        "reveals": key_services.api_key_reveals_take(user=request.user),
        "rows": _key_rows(request.user, overrides),
        "create_form": create_form or KeyCreateForm(),
        "account_budget": request.user.monthly_token_budget,
    }
    template = "portal/keys.html#key_list" if request.htmx else "portal/keys.html"
    response = render(request, template, context)
    # The page may show a new key's secret: no browser or proxy cache may keep a copy.
    add_never_cache_headers(response)
    return response


def _keys_done(request, *, notice=""):
    """After a change: for htmx, the key list; otherwise back to the page, which shows
    `notice` at its top."""
    if request.htmx:
        return _render_keys(request)
    if notice:
        messages.success(request, notice)
    return redirect("keys")


@approved_required
@require_http_methods(["GET", "POST"])
def keys(request):
    """The API keys page; POST creates a key, whose secret the next render shows once."""
    if request.method == "GET":
        return _render_keys(request)
    form = KeyCreateForm(request.POST)
    if not form.is_valid():
        return _render_keys(request, create_form=form)
    try:
        key, secret = key_services.api_key_create(
            user=request.user, name=form.cleaned_data["name"], acting_user=request.user
        )
    except ValidationError as error:  # the account holds as many keys as it may
        form.add_error(None, error)
        return _render_keys(request, create_form=form)
    key_services.api_key_reveal_store(key=key, secret=secret)
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
            key_services.api_key_rename(
                key=key, acting_user=request.user, name=form.cleaned_data["name"]
            )
            return _keys_done(request)
        except ValidationError as error:
            form.add_error(None, error)
    return _render_keys(request, overrides={key.pk: {"rename_form": form}})


@approved_required
@require_POST
def key_budget(request, key_id):
    """Set a key's budgets. For htmx the answer is the key's card (see `_key_card`), with the
    confirmation just above the button that saved them, or the form with its errors."""
    key = _owned_key(request, key_id)
    form = key_budget_form(key, request.POST)
    if form.is_valid():
        try:
            key = limits.api_key_budget_set(
                key=key, acting_user=request.user, budgets=form.cleaned_data
            )
            notice = f"Budgets of “{key.name}” saved."
            if request.htmx:
                return _key_card(request, key, budgets_notice=notice)
            return _keys_done(request, notice=notice)
        except ValidationError as error:
            form.add_error(None, error)
    if request.htmx:
        return _key_card(request, key, budget_form=form)
    return _render_keys(request, overrides={key.pk: {"budget_form": form}})


def _key_status_view(service, *, managed_allowed, notice=""):
    """A view that changes a key's status with `service`; `notice` (formatted with `key`)
    confirms it, in the key's card for htmx (see `_key_card`)."""

    @approved_required
    @require_POST
    def view(request, key_id):
        key = _owned_key(request, key_id)
        if key.is_playground and not managed_allowed:
            return _refuse_managed(request, key)
        try:
            key = service(key=key, acting_user=request.user)
        except ValidationError as error:
            if request.htmx:
                return _key_card(request, key, errors=error.messages)
            return _render_keys(request, overrides={key.pk: {"errors": error.messages}})
        if request.htmx:
            return _key_card(request, key, status_notice=notice.format(key=key))
        return _keys_done(request, notice=notice.format(key=key))

    return view


def _key_card(request, key, **overrides):
    """The answer to htmx for a change of one key: its card alone, swapped in where it was,
    so that a confirmation shows where the person clicked. (The whole list would put a
    revoked key last, and drop a new key's secret shown above, moving the cards.)"""
    response = render(request, "portal/keys.html#key_card", {"row": _key_row(key, **overrides)})
    add_never_cache_headers(response)
    return response


key_disable = _key_status_view(key_services.api_key_disable, managed_allowed=True)
key_enable = _key_status_view(key_services.api_key_enable, managed_allowed=True)
_key_revoke_post = _key_status_view(
    key_services.api_key_revoke,
    managed_allowed=False,
    notice="Revoked “{key.name}” (acs-{key.prefix}-…): programs using it now get key_revoked.",
)


@approved_required
@require_http_methods(["GET", "POST"])
def key_revoke(request, key_id):
    """GET: a confirmation page (the no-JS path); POST: revoke for good."""
    if request.method == "POST":
        return _key_revoke_post(request, key_id)
    key = _owned_key(request, key_id)
    if key.is_playground:
        return _refuse_managed(request, key)
    context = {
        "key": key,
        "revoke_url": reverse("key_revoke", args=[key.pk]),
        "keep_url": reverse("keys"),
    }
    return render(request, "portal/key_revoke.html", context)


# ---------------------------------------------------------------------------------------
# Staff: one user


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
                "panel": budget_panel(key=key),
                "budget_form": key_forms.get(key.pk) or key_budget_form(key, staff=True),
            }
            for key in keys
        ],
        "account_form": account_form or account_budget_form(user),
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
    actions = {"suspend": users.user_suspend, "reactivate": users.user_reactivate}
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
    form = account_budget_form(user, request.POST)
    if form.is_valid():
        try:
            limits.user_budget_set(user=user, acting_user=request.user, budgets=form.cleaned_data)
            messages.success(request, "Account budget saved.")
            return redirect("staff_user_detail", user_id=user.pk)
        except ValidationError as error:
            form.add_error(None, error)
    return _render_staff_user(request, user, account_form=form)


@staff_required
@require_POST
def staff_key_budget(request, key_id):
    key = get_object_or_404(ApiKey.objects.select_related("user"), pk=key_id)
    form = key_budget_form(key, request.POST, staff=True)
    if form.is_valid():
        try:
            limits.api_key_budget_set(key=key, acting_user=request.user, budgets=form.cleaned_data)
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
        "disable": key_services.api_key_disable,
        "enable": key_services.api_key_enable,
        "revoke": key_services.api_key_revoke,
    }
    name = request.POST.get("action")
    action = actions.get(name)
    if action is None:
        return _render_staff_user(request, key.user, errors=["Choose disable, enable or revoke."])
    if name == "revoke" and request.POST.get("confirmed") != "true":
        # Revoking is for good: ask first, on a page of its own.
        context = {
            "key": key,
            "staff_view": True,
            "revoke_url": reverse("staff_key_status", args=[key.pk]),
            "keep_url": reverse("staff_user_detail", args=[key.user_id]),
        }
        return render(request, "portal/key_revoke.html", context)
    try:
        action(key=key, acting_user=request.user)
    except ValidationError as error:
        return _render_staff_user(request, key.user, errors=error.messages)
    done = {"disable": "Paused", "enable": "Resumed", "revoke": "Revoked"}[name]
    messages.success(request, f"{done} “{key.name}” (acs-{key.prefix}-…) of {key.user.email}.")
    return redirect("staff_user_detail", user_id=key.user_id)
