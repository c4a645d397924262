"""Reads for accounts, keys, budgets and usage."""

from django.db.models import Q
from django.utils import timezone

from .models import ApiKey, Period, UsagePeriod
from .periods import day_start, month_start, next_day_reset, next_month_reset


def budget_windows(*, key: ApiKey, now=None) -> list[dict]:
    """Every budget window of a key and its account, as
    `{name, label, used, reserved, limit, remaining, resets_at}`; `limit` and `remaining` are
    None for a window with no limit. Used by the dashboard, the keys page and GET /v1/usage."""
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
