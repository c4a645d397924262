"""Reads for accounts, keys, budgets and usage."""

from django.db.models import Q
from django.utils import timezone

from .models import (
    AccessApplication,
    ApiKey,
    ApplicationStatus,
    AuditLog,
    KeyStatus,
    Period,
    UsagePeriod,
    User,
)
from .periods import day_start, month_start, next_day_reset, next_month_reset


def budget_windows(*, key: ApiKey, now=None) -> list[dict]:
    """Every budget window of a key and its account, as
    `{name, label, used, reserved, limit, remaining, resets_at}`; `limit` and `remaining` are
    None for a window with no limit. `reserved` counts the worst cases of running requests and
    the unspent tokens of the gateway's budget leases (given back 2 s after a key's last
    request; see `api.ledger`). Used by the dashboard, the keys page and GET /v1/usage."""
    now = now or timezone.now()
    month, day = month_start(now), day_start(now)
    rows = UsagePeriod.objects.filter(
        Q(key=key, period=Period.MONTH, start=month)
        | Q(key=key, period=Period.DAY, start=day)
        | Q(key__isnull=True, user_id=key.user_id, period=Period.MONTH, start=month)
    )
    empty = UsagePeriod()
    by_role = {("key" if r.key_id else "account", r.period): r for r in rows}
    key_month = by_role.get(("key", Period.MONTH), empty)
    key_day = by_role.get(("key", Period.DAY), empty)
    account_month = by_role.get(("account", Period.MONTH), empty)
    month_reset, day_reset = next_month_reset(now), next_day_reset(now)

    def window(name, label, used, reserved, limit, resets_at):
        remaining = None if limit is None else max(limit - used - reserved, 0)
        return {
            "name": name,
            "label": label,
            "used": used,
            "reserved": reserved,
            "limit": limit,
            "remaining": remaining,
            "resets_at": resets_at,
        }

    return [
        window(
            "key_monthly",
            "Key, this month (tokens)",
            key_month.used_tokens,
            key_month.reserved_tokens,
            key.monthly_token_budget,
            month_reset,
        ),
        window(
            "key_daily",
            "Key, today (tokens)",
            key_day.used_tokens,
            key_day.reserved_tokens,
            key.daily_token_budget,
            day_reset,
        ),
        window(
            "account_monthly",
            "Account, this month (tokens)",
            account_month.used_tokens,
            account_month.reserved_tokens,
            key.user.monthly_token_budget,
            month_reset,
        ),
        window(
            "key_monthly_input",
            "Key input, this month (tokens)",
            key_month.used_input,
            key_month.reserved_input,
            key.monthly_input_budget,
            month_reset,
        ),
        window(
            "key_monthly_output",
            "Key output, this month (tokens)",
            key_month.used_output,
            key_month.reserved_output,
            key.monthly_output_budget,
            month_reset,
        ),
        window(
            "activation_requests",
            "Activation requests, this month",
            key_month.activation_requests,
            0,
            key.monthly_activation_quota,
            month_reset,
        ),
        window(
            "harvest_jobs",
            "Harvest jobs, this month",
            key_month.harvest_jobs,
            0,
            key.monthly_harvest_quota,
            month_reset,
        ),
    ]


# Share of a window's limit past which the dashboard and keys page warn.
BUDGET_WARNING_SHARE = 0.8


def budget_panel(*, key: ApiKey, now=None) -> list[dict]:
    """`budget_windows` of a key, each with `consumed` (used + reserved), `percent` (0–100,
    None without a limit) and `warning` (more than 80% of the limit consumed)."""
    panel = []
    for window in budget_windows(key=key, now=now):
        consumed = window["used"] + window["reserved"]
        limit = window["limit"]
        if limit is None:
            percent, warning = None, False
        elif limit == 0:
            percent, warning = 100, True
        else:
            percent = min(round(100 * consumed / limit), 100)
            warning = consumed > BUDGET_WARNING_SHARE * limit
        panel.append({**window, "consumed": consumed, "percent": percent, "warning": warning})
    return panel


def user_keys(*, user) -> list[ApiKey]:
    """A user's keys, newest first, revoked ones last."""
    keys = ApiKey.objects.filter(user=user).select_related("user")
    return sorted(keys, key=lambda k: k.status == KeyStatus.REVOKED)


def application_queue(*, decided_limit: int = 50) -> list[AccessApplication]:
    """Pending applications, oldest first, then the most recently decided ones."""
    base = AccessApplication.objects.select_related("user", "decided_by")
    pending = base.filter(status=ApplicationStatus.PENDING).order_by("created_at")
    decided = base.exclude(status=ApplicationStatus.PENDING).order_by("-decided_at", "-id")
    return [*pending, *decided[:decided_limit]]


def user_search(*, query: str = "", status: str = ""):
    """Users matching `query` (e-mail, name or organisation) and `status`, newest first."""
    users = User.objects.order_by("-date_joined")
    if query:
        users = users.filter(
            Q(email__icontains=query) | Q(name__icontains=query) | Q(organisation__icontains=query)
        )
    if status:
        users = users.filter(status=status)
    return users


def audit_search(*, actor: str = "", action: str = "", target: str = ""):
    """Audit rows, newest first, filtered by actor e-mail, action (prefix, e.g. `key.`) and
    target (type, id or description)."""
    rows = AuditLog.objects.select_related("actor")
    if actor:
        rows = rows.filter(actor__email__icontains=actor)
    if action:
        rows = rows.filter(action__startswith=action)
    if target:
        rows = rows.filter(
            Q(target_repr__icontains=target) | Q(target_type__iexact=target) | Q(target_id=target)
        )
    return rows
