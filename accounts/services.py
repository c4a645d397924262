"""Writes for accounts, keys, budgets and usage.

Functions are named `<entity>_<action>` and take keyword-only arguments. Those that change
access or money take `acting_user` and write an `AuditLog` row in the same transaction.
"""

import hashlib
import hmac
import re
import secrets
import string
from dataclasses import dataclass

from django.conf import settings
from django.db import connection, transaction
from django.db.models import F, Q
from django.utils import timezone

from .models import (
    ApiKey,
    AuditLog,
    BudgetReservation,
    KeyStatus,
    Period,
    ReservationStatus,
    Scope,
    ServiceSettings,
    UsageDaily,
    UsagePeriod,
    UsageRecord,
    User,
    UserStatus,
)
from .periods import day_start, month_start

# ---------------------------------------------------------------------------------------
# Audit


def audit_log(*, actor, action, target, before=None, after=None, note=""):
    """Record one change of access or money. Call inside the transaction that makes it."""
    return AuditLog.objects.create(
        actor=actor,
        action=action,
        target_type=target._meta.model_name,
        target_id=str(target.pk),
        target_repr=str(target)[:200],
        before=before,
        after=after,
        note=note,
    )


# ---------------------------------------------------------------------------------------
# API keys: format, hashing, authentication

KEY_PATTERN = re.compile(r"^acs-([a-z0-9]{8})-([A-Za-z0-9_-]{40,})$")
_PREFIX_ALPHABET = string.ascii_lowercase + string.digits


def api_key_generate() -> tuple[str, str]:
    """A new `(prefix, secret)`; the secret is the whole `acs-<prefix>-<random>` string."""
    prefix = "".join(secrets.choice(_PREFIX_ALPHABET) for _ in range(8))
    return prefix, f"acs-{prefix}-{secrets.token_urlsafe(32)}"


def api_key_hash(secret: str) -> str:
    return hmac.new(
        settings.API_KEY_HMAC_SECRET.encode(), secret.encode(), hashlib.sha256
    ).hexdigest()


class AuthError(Exception):
    """A refused credential: `code` and `status` are the contract's."""

    def __init__(self, code: str, message: str, status: int = 401):
        super().__init__(message)
        self.code = code
        self.message = message
        self.status = status


# Written at most once a minute per key, so authentication stays read-only on the hot path.
_LAST_USED_RESOLUTION = 60


def api_key_authenticate(authorization: str | None, *, scope: str = Scope.COMPLETIONS) -> ApiKey:
    """Return the active key (with `.user` loaded) named by an `Authorization` header value,
    or raise `AuthError` with the contract's code: missing_authorization, invalid_api_key,
    key_revoked, key_disabled, account_not_approved, account_suspended (401), scope_denied
    (403)."""
    scheme, _, token = (authorization or "").strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise AuthError(
            "missing_authorization",
            "Send your API key as 'Authorization: Bearer acs-...'.",
        )
    token = token.strip()
    match = KEY_PATTERN.match(token)
    if match is None:
        raise AuthError("invalid_api_key", "The API key is malformed.")
    key = ApiKey.objects.select_related("user").filter(prefix=match.group(1)).first()
    if key is None or not hmac.compare_digest(key.secret_hash, api_key_hash(token)):
        raise AuthError("invalid_api_key", "The API key is not valid.")
    if key.status == KeyStatus.REVOKED:
        raise AuthError("key_revoked", "This API key has been revoked; create a new one.")
    if key.status == KeyStatus.DISABLED:
        raise AuthError("key_disabled", "This API key is paused; resume it on the API keys page.")
    user = key.user
    if user.status == UserStatus.SUSPENDED or not user.is_active:
        raise AuthError("account_suspended", "This account is suspended.")
    if user.status != UserStatus.APPROVED:
        raise AuthError("account_not_approved", "This account has not been approved.")
    if scope not in key.scopes:
        raise AuthError("scope_denied", f"This API key lacks the '{scope}' scope.", status=403)
    now = timezone.now()
    if key.last_used_at is None or (now - key.last_used_at).total_seconds() > (
        _LAST_USED_RESOLUTION
    ):
        ApiKey.objects.filter(pk=key.pk).update(last_used_at=now)
        key.last_used_at = now
    return key


# ---------------------------------------------------------------------------------------
# Budgets: reserve the worst case before a request, settle to the actual count after it


class BudgetExceeded(Exception):
    """A request the budgets refuse; `code` is budget_exceeded, activation_quota_exceeded,
    harvest_quota_exceeded or spend_cap."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class _Windows:
    key_month: UsagePeriod
    key_day: UsagePeriod
    account_month: UsagePeriod


def _period_filter(*, key_id, user_id, month, day):
    return (
        Q(key_id=key_id, period=Period.MONTH, start=month)
        | Q(key_id=key_id, period=Period.DAY, start=day)
        | Q(key__isnull=True, user_id=user_id, period=Period.MONTH, start=month)
    )


def _lock_windows(*, key: ApiKey, month, day) -> _Windows:
    """Lock the key's month and day rows and the account's month row, creating them if
    needed. Rows are always locked in id order so concurrent requests cannot deadlock."""
    where = _period_filter(key_id=key.pk, user_id=key.user_id, month=month, day=day)
    rows = list(UsagePeriod.objects.select_for_update().filter(where).order_by("id"))
    if len(rows) < 3:
        UsagePeriod.objects.bulk_create(
            [
                UsagePeriod(user_id=key.user_id, key=key, period=Period.MONTH, start=month),
                UsagePeriod(user_id=key.user_id, key=key, period=Period.DAY, start=day),
                UsagePeriod(user_id=key.user_id, key=None, period=Period.MONTH, start=month),
            ],
            ignore_conflicts=True,
        )
        rows = list(UsagePeriod.objects.select_for_update().filter(where).order_by("id"))
    by_role = {("key" if row.key_id else "account", row.period): row for row in rows}
    return _Windows(
        key_month=by_role[("key", Period.MONTH)],
        key_day=by_role[("key", Period.DAY)],
        account_month=by_role[("account", Period.MONTH)],
    )


def _remaining(limit, *counters):
    return None if limit is None else limit - sum(counters)


def budget_remaining(*, key: ApiKey, windows: _Windows) -> dict:
    """Tokens left in each window (None = no limit) given locked or freshly read rows."""
    km, kd, am = windows.key_month, windows.key_day, windows.account_month
    return {
        "key_monthly": _remaining(key.monthly_token_budget, km.used_tokens, km.reserved_tokens),
        "key_daily": _remaining(key.daily_token_budget, kd.used_tokens, kd.reserved_tokens),
        "account_monthly": _remaining(
            key.user.monthly_token_budget, am.used_tokens, am.reserved_tokens
        ),
        "key_monthly_input": _remaining(key.monthly_input_budget, km.used_input, km.reserved_input),
        "key_monthly_output": _remaining(
            key.monthly_output_budget, km.used_output, km.reserved_output
        ),
    }


def budget_reserve(
    *,
    key: ApiKey,
    prompt_tokens: int,
    max_tokens: int,
    completions: int = 1,
    activation: bool = False,
    now=None,
) -> BudgetReservation:
    """Hold `prompt_tokens + completions * max_tokens` against every budget window of the key
    and its account. If the windows cannot cover it, `max_tokens` is lowered
    (`reservation.max_tokens_applied`); if not even the prompt and one token per completion
    fit, raise `BudgetExceeded`. `completions` is prompt_count × n. Concurrent calls never
    reserve past any limit. Always pair with `budget_settle`."""
    if ServiceSettings.objects.filter(pk=1, spend_cap_paused=True).exists():
        raise BudgetExceeded("spend_cap", "The service is paused by its spend cap.")
    now = now or timezone.now()
    month, day = month_start(now), day_start(now)
    with transaction.atomic():
        windows = _lock_windows(key=key, month=month, day=day)
        if activation and windows.key_month.activation_requests >= key.monthly_activation_quota:
            raise BudgetExceeded(
                "activation_quota_exceeded",
                "This key's monthly activation-request quota is spent; it resets on the 1st.",
            )
        remaining = budget_remaining(key=key, windows=windows)
        total_left = min(
            v
            for name, v in remaining.items()
            if v is not None and not name.startswith("key_monthly_")
        )
        input_left = remaining["key_monthly_input"]
        output_left = remaining["key_monthly_output"]
        room = total_left - prompt_tokens
        if output_left is not None:
            room = min(room, output_left)
        applied = min(max_tokens, room // completions) if room > 0 else 0
        if applied < 1 or (input_left is not None and prompt_tokens > input_left):
            raise BudgetExceeded(
                "budget_exceeded",
                "This request does not fit in the remaining token budget of the key or account.",
            )
        output_tokens = applied * completions
        UsagePeriod.objects.filter(
            pk__in=[windows.key_month.pk, windows.key_day.pk, windows.account_month.pk]
        ).update(
            reserved_tokens=F("reserved_tokens") + prompt_tokens + output_tokens,
            reserved_input=F("reserved_input") + prompt_tokens,
            reserved_output=F("reserved_output") + output_tokens,
            requests=F("requests") + 1,
            activation_requests=F("activation_requests") + int(activation),
        )
        return BudgetReservation.objects.create(
            key=key,
            user_id=key.user_id,
            created_at=now,
            month_start=month,
            day_start=day,
            prompt_tokens=prompt_tokens,
            output_tokens=output_tokens,
            max_tokens_requested=max_tokens,
            max_tokens_applied=applied,
            activation=activation,
        )


def budget_settle(
    *, reservation_id: int, prompt_tokens: int, completion_tokens: int, release: bool = False
) -> bool:
    """Replace a reservation's hold by the actual usage. Idempotent: settling twice changes
    nothing and returns False. `release=True` marks a reservation freed by the sweep."""
    with transaction.atomic():
        reservation = (
            BudgetReservation.objects.select_for_update()
            .filter(pk=reservation_id, status=ReservationStatus.RESERVED)
            .first()
        )
        if reservation is None:
            return False
        where = _period_filter(
            key_id=reservation.key_id,
            user_id=reservation.user_id,
            month=reservation.month_start,
            day=reservation.day_start,
        )
        ids = list(
            UsagePeriod.objects.select_for_update()
            .filter(where)
            .order_by("id")
            .values_list("id", flat=True)
        )
        UsagePeriod.objects.filter(pk__in=ids).update(
            reserved_tokens=F("reserved_tokens")
            - reservation.prompt_tokens
            - reservation.output_tokens,
            reserved_input=F("reserved_input") - reservation.prompt_tokens,
            reserved_output=F("reserved_output") - reservation.output_tokens,
            used_tokens=F("used_tokens") + prompt_tokens + completion_tokens,
            used_input=F("used_input") + prompt_tokens,
            used_output=F("used_output") + completion_tokens,
        )
        reservation.status = ReservationStatus.RELEASED if release else ReservationStatus.SETTLED
        reservation.settled_prompt_tokens = prompt_tokens
        reservation.settled_completion_tokens = completion_tokens
        reservation.settled_at = timezone.now()
        reservation.save(
            update_fields=[
                "status",
                "settled_prompt_tokens",
                "settled_completion_tokens",
                "settled_at",
            ]
        )
        return True


def budget_release_stale(*, older_than) -> int:
    """Free the holds of reservations whose request never settled (its process died)."""
    cutoff = timezone.now() - older_than
    stale = BudgetReservation.objects.filter(
        status=ReservationStatus.RESERVED, created_at__lt=cutoff
    ).values_list("id", flat=True)
    return sum(
        budget_settle(reservation_id=rid, prompt_tokens=0, completion_tokens=0, release=True)
        for rid in list(stale)
    )


def harvest_quota_consume(*, key: ApiKey, now=None) -> None:
    """Count one harvest job against the key's monthly quota, or raise `BudgetExceeded`
    (harvest_quota_exceeded)."""
    now = now or timezone.now()
    with transaction.atomic():
        windows = _lock_windows(key=key, month=month_start(now), day=day_start(now))
        if windows.key_month.harvest_jobs >= key.monthly_harvest_quota:
            raise BudgetExceeded(
                "harvest_quota_exceeded",
                "This key's monthly harvest-job quota is spent; it resets on the 1st.",
            )
        UsagePeriod.objects.filter(pk=windows.key_month.pk).update(
            harvest_jobs=F("harvest_jobs") + 1
        )


# ---------------------------------------------------------------------------------------
# Usage ledger


def usage_record_create(
    *,
    key: ApiKey,
    request_id: str,
    endpoint: str,
    status_code: int,
    latency_ms: float,
    model: str = "",
    error_code: str = "",
    prompt_tokens: int = 0,
    completion_tokens: int = 0,
    upstream_latency_ms: float | None = None,
    ttft_ms: float | None = None,
    stream: bool = False,
    activation_layers: list[int] | None = None,
    workload: str = "",
    now=None,
) -> UsageRecord:
    """Write one request's metadata and add it to the daily roll-up, atomically."""
    now = now or timezone.now()
    with transaction.atomic():
        record = UsageRecord.objects.create(
            created_at=now,
            request_id=request_id,
            user_id=key.user_id,
            key=key,
            model=model,
            endpoint=endpoint,
            status_code=status_code,
            error_code=error_code,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            latency_ms=latency_ms,
            upstream_latency_ms=upstream_latency_ms,
            ttft_ms=ttft_ms,
            stream=stream,
            activation_layers=activation_layers,
            workload=workload,
        )
        usage_daily_add(
            day=day_start(now),
            user_id=key.user_id,
            key_id=key.pk,
            model=model,
            status_code=status_code,
            error_code=error_code,
            requests=1,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            latency_ms_sum=latency_ms,
        )
    return record


def usage_daily_add(
    *,
    day,
    user_id,
    key_id,
    model,
    status_code,
    error_code,
    requests,
    prompt_tokens,
    completion_tokens,
    latency_ms_sum,
) -> None:
    """Add counts to one `UsageDaily` row with a single upsert (PostgreSQL and SQLite)."""
    table = UsageDaily._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(
            f"""
            INSERT INTO {table} (day, user_id, key_id, model, status_code, error_code,
                                 requests, prompt_tokens, completion_tokens, latency_ms_sum)
            VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)
            ON CONFLICT (day, key_id, model, status_code, error_code) DO UPDATE SET
                requests = {table}.requests + excluded.requests,
                prompt_tokens = {table}.prompt_tokens + excluded.prompt_tokens,
                completion_tokens = {table}.completion_tokens + excluded.completion_tokens,
                latency_ms_sum = {table}.latency_ms_sum + excluded.latency_ms_sum
            """,
            [
                day,
                user_id,
                key_id,
                model,
                status_code,
                error_code,
                requests,
                prompt_tokens,
                completion_tokens,
                latency_ms_sum,
            ],
        )


# ---------------------------------------------------------------------------------------
# Keys


def api_key_create(
    *,
    user: User,
    name: str,
    acting_user: User | None,
    monthly_token_budget: int | None = None,
    daily_token_budget: int | None = None,
    is_playground: bool = False,
    encrypted_secret: str = "",
) -> tuple[ApiKey, str]:
    """Create a key with the default budgets (capped at the account's monthly budget) and
    return it with its secret, which is never stored and must be shown once."""
    prefix, secret = api_key_generate()
    account_cap = user.monthly_token_budget or settings.ACS_DEFAULT_ACCOUNT_MONTHLY_TOKENS
    with transaction.atomic():
        key = ApiKey.objects.create(
            user=user,
            name=name,
            prefix=prefix,
            secret_hash=api_key_hash(secret),
            scopes=[Scope.COMPLETIONS],
            is_playground=is_playground,
            encrypted_secret=encrypted_secret,
            monthly_token_budget=min(
                monthly_token_budget or settings.ACS_DEFAULT_KEY_MONTHLY_TOKENS, account_cap
            ),
            daily_token_budget=daily_token_budget or settings.ACS_DEFAULT_KEY_DAILY_TOKENS,
            monthly_activation_quota=settings.ACS_DEFAULT_ACTIVATION_QUOTA,
            monthly_harvest_quota=settings.ACS_DEFAULT_HARVEST_QUOTA,
        )
        audit_log(
            actor=acting_user,
            action="key.create",
            target=key,
            after={"name": name, "prefix": prefix, "budgets": api_key_budgets(key)},
        )
    return key, secret


def api_key_budgets(key: ApiKey) -> dict:
    """A key's budget settings as a plain dict (for audit before/after)."""
    return {
        "monthly_token_budget": key.monthly_token_budget,
        "daily_token_budget": key.daily_token_budget,
        "monthly_input_budget": key.monthly_input_budget,
        "monthly_output_budget": key.monthly_output_budget,
        "monthly_activation_quota": key.monthly_activation_quota,
        "monthly_harvest_quota": key.monthly_harvest_quota,
    }


# ---------------------------------------------------------------------------------------
# Service-wide switches


def service_spend_cap_set(*, paused: bool, acting_user: User, reason: str = "") -> None:
    """Pause (429 spend_cap on every request) or resume all API traffic."""
    with transaction.atomic():
        current = ServiceSettings.objects.select_for_update().get_or_create(pk=1)[0]
        before = {"spend_cap_paused": current.spend_cap_paused}
        current.spend_cap_paused = paused
        current.spend_cap_reason = reason
        current.updated_by = acting_user
        current.save()
        audit_log(
            actor=acting_user,
            action="service.spend_cap",
            target=current,
            before=before,
            after={"spend_cap_paused": paused},
            note=reason,
        )
