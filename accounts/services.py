"""Writes for accounts, keys, budgets and usage.

Functions are named `<entity>_<action>` and take keyword-only arguments. Those that change
access or money take `acting_user` and write an `AuditLog` row in the same transaction.
"""

import base64
import hashlib
import hmac
import json
import re
import secrets
import string
from dataclasses import dataclass

from cryptography.fernet import Fernet, InvalidToken
from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.mail import send_mail
from django.db import connection, transaction
from django.db.models import F
from django.utils import timezone
from django.utils.crypto import salted_hmac

from .models import (
    AccessApplication,
    ApiKey,
    ApplicationStatus,
    AuditLog,
    BudgetLease,
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
    api_key_check(key, scope=scope)
    now = timezone.now()
    if key.last_used_at is None or (now - key.last_used_at).total_seconds() > (
        _LAST_USED_RESOLUTION
    ):
        ApiKey.objects.filter(pk=key.pk).update(last_used_at=now)
        key.last_used_at = now
    return key


def api_key_check(key: ApiKey, *, scope: str = Scope.COMPLETIONS) -> None:
    """Raise `AuthError` unless `key` (with `.user` loaded) may call the API now: key_revoked,
    key_disabled, account_suspended, account_not_approved (401), scope_denied (403)."""
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


def api_key_recheck(*, key_id: int, scope: str = Scope.COMPLETIONS) -> ApiKey:
    """Read the key and its account again and `api_key_check` them: for work that starts
    long after its request was authenticated (jobs), which a revoked or paused key or a
    suspended account must stop."""
    key = ApiKey.objects.select_related("user").get(pk=key_id)
    api_key_check(key, scope=scope)
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

    @property
    def ids(self) -> tuple[int, int, int]:
        return self.key_month.pk, self.key_day.pk, self.account_month.pk


# The budget and usage writes run on every API request, so they are plain SQL (the ORM cost
# several milliseconds of CPU per request on these machines), written as *step generators*:
# a generator yields a batch of `(sql, params)` statements to run in one round trip, receives
# the rows of the batch's last statement that returns rows, and finally returns its result.
# `run_steps` runs one in a transaction on Django's connection; the gateway runs the same
# generators on its async PostgreSQL pool (`api.db.run_steps_async`), so the logic exists once.
Statements = list[tuple[str, list]]

_PERIODS = UsagePeriod._meta.db_table
_PERIOD_COLUMNS = [field.attname for field in UsagePeriod._meta.concrete_fields]
_RESERVATIONS = BudgetReservation._meta.db_table
_SPEND_CAP_PAUSED = f"SELECT spend_cap_paused FROM {ServiceSettings._meta.db_table} WHERE id = 1"
_WINDOWS_WHERE = (
    "(key_id = %s AND ((period = 'month' AND start = %s) OR (period = 'day' AND start = %s)))"
    " OR (key_id IS NULL AND user_id = %s AND period = 'month' AND start = %s)"
)
# On PostgreSQL, lets the current transaction's COMMIT return before its WAL reaches disk
# (for this transaction only). Locks, constraints and consistency are unchanged; only a crash
# of the database server itself can lose the last fraction of a second of holds and usage.
# That trade saves one disk flush (about 3 ms on this project's machines) on every API
# request's hot path.
_NO_FLUSH_WAIT = "SET LOCAL synchronous_commit = off"
# May end the last batch of a step generator that is run on its own (not composed into a
# bigger transaction): the async driver then commits in that round trip instead of another.
# The sync driver leaves committing to its atomic block.
COMMIT = ("COMMIT", [])


class WindowsMissing(Exception):
    """Raised by a step generator when a key's budget windows for the current period do not
    exist yet: the driver rolls back, calls `create()` and runs the steps again."""

    def __init__(self, *, key_id, user_id, month, day):
        super().__init__(f"budget windows of key {key_id} for {day} do not exist yet")
        self.key_id, self.user_id, self.month, self.day = key_id, user_id, month, day

    def create(self) -> None:
        UsagePeriod.objects.bulk_create(
            [
                UsagePeriod(
                    user_id=self.user_id, key_id=self.key_id, period=Period.MONTH, start=self.month
                ),
                UsagePeriod(
                    user_id=self.user_id, key_id=self.key_id, period=Period.DAY, start=self.day
                ),
                UsagePeriod(user_id=self.user_id, key=None, period=Period.MONTH, start=self.month),
            ],
            ignore_conflicts=True,
        )


def run_steps(make_steps):
    """Run the step generator `make_steps()` in one transaction on Django's connection and
    return its result (creating missing budget windows and starting again if it asks)."""
    while True:
        try:
            with transaction.atomic(), connection.cursor() as cursor:
                steps, rows = make_steps(), None
                while True:
                    try:
                        batch = steps.send(rows)
                    except StopIteration as done:
                        return done.value
                    rows = _execute_in_one_trip(cursor, batch)
        except WindowsMissing as missing:
            missing.create()


def statements_joined(statements: Statements) -> tuple[str, list]:
    """One SQL string and parameter list for `statements`, to execute in one round trip with
    client-side parameter binding (PostgreSQL)."""
    return (
        "; ".join(sql for sql, _ in statements),
        [param for _, params in statements for param in params],
    )


def _execute_in_one_trip(cursor, statements: Statements) -> list:
    """Execute statements in order, in one round trip on PostgreSQL, and return the rows of
    the last one that returns rows. Skips `COMMIT`, and `_NO_FLUSH_WAIT` on other databases."""
    statements = [statement for statement in statements if statement is not COMMIT]
    if connection.vendor == "postgresql":
        cursor.execute(*statements_joined(statements))
        return _rows_of_last_result(cursor)
    rows = []
    for sql, params in statements:
        if sql != _NO_FLUSH_WAIT:
            cursor.execute(sql, params)
            rows = cursor.fetchall() if cursor.description else rows
    return rows


def _rows_of_last_result(cursor) -> list:
    """After a multi-statement execute: the rows of the last statement that returned any."""
    rows = cursor.fetchall() if cursor.description else []
    while cursor.nextset():
        if cursor.description:
            rows = cursor.fetchall()
    return rows


def _windows_params(*, key_id, user_id, month, day):
    adapt = connection.ops.adapt_datefield_value
    return [key_id, adapt(month), adapt(day), user_id, adapt(month)]


def _windows_locking_select(columns: str) -> str:
    """SELECT `columns` of a key's and account's windows, locking them in id order (so
    concurrent requests cannot deadlock); SQLite has no row locks and serialises writers."""
    lock = " FOR UPDATE" if connection.features.has_select_for_update else ""
    return f"SELECT {columns} FROM {_PERIODS} WHERE {_WINDOWS_WHERE} ORDER BY id{lock}"


def _lock_windows_steps(*, key_id, user_id, month, day):
    """Steps: lock and read the key's and account's windows; returns `(_Windows,
    spend_cap_paused)`, the service's spend-cap flag being read in the same round trip."""
    columns = ", ".join(_PERIOD_COLUMNS)
    rows = yield [
        (
            _windows_locking_select(f"{columns}, ({_SPEND_CAP_PAUSED})"),
            _windows_params(key_id=key_id, user_id=user_id, month=month, day=day),
        )
    ]
    if len(rows) < 3:
        raise WindowsMissing(key_id=key_id, user_id=user_id, month=month, day=day)
    periods = [UsagePeriod(**dict(zip(_PERIOD_COLUMNS, row, strict=False))) for row in rows]
    by_role = {("key" if row.key_id else "account", row.period): row for row in periods}
    windows = _Windows(
        key_month=by_role[("key", Period.MONTH)],
        key_day=by_role[("key", Period.DAY)],
        account_month=by_role[("account", Period.MONTH)],
    )
    return windows, bool(rows[0][-1])


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
    activation: int = 0,
    now=None,
) -> BudgetReservation:
    """Hold `prompt_tokens + completions * max_tokens` against every budget window of the key
    and its account. If the windows cannot cover it, `max_tokens` is lowered
    (`reservation.max_tokens_applied`); if not even the prompt and one token per completion
    fit, raise `BudgetExceeded`. `completions` is prompt_count × n. `activation` is how many
    activation requests the hold counts against the monthly quota (a /v1 request: True, one;
    a harvest batch: one per prompt), refused whole if they do not all fit. Concurrent calls
    never reserve past any limit. Always pair with `budget_settle`."""
    now = now or timezone.now()
    return run_steps(
        lambda: budget_reserve_steps(
            key=key,
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            completions=completions,
            activation=activation,
            now=now,
        )
    )


def _spend_cap_check(spend_cap_paused: bool) -> None:
    if spend_cap_paused:
        raise BudgetExceeded("spend_cap", "The service is paused by its spend cap.")


def _tightest_windows(*, key, windows, spend_cap_paused, activation):
    """`(total, input, output)` tokens left for a request of `key` in its locked windows
    (input and output None when the key has no such budget); raises BudgetExceeded when the
    spend cap or the activation quota refuses the request (`activation` requests of it)."""
    _spend_cap_check(spend_cap_paused)
    if (
        activation
        and windows.key_month.activation_requests + activation > key.monthly_activation_quota
    ):
        raise BudgetExceeded(
            "activation_quota_exceeded",
            "This key's monthly activation-request quota is spent; it resets on the 1st.",
        )
    remaining = budget_remaining(key=key, windows=windows)
    total_left = min(
        v for name, v in remaining.items() if v is not None and not name.startswith("key_monthly_")
    )
    return total_left, remaining["key_monthly_input"], remaining["key_monthly_output"]


def budget_reserve_steps(*, key, prompt_tokens, max_tokens, completions, activation, now):
    """`budget_reserve` as steps (see `run_steps`)."""
    month, day = month_start(now), day_start(now)
    windows, spend_cap_paused = yield from _lock_windows_steps(
        key_id=key.pk, user_id=key.user_id, month=month, day=day
    )
    total_left, input_left, output_left = _tightest_windows(
        key=key, windows=windows, spend_cap_paused=spend_cap_paused, activation=activation
    )
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
    reservation = BudgetReservation(
        key=key,
        user_id=key.user_id,
        created_at=now,
        alive_at=now,
        month_start=month,
        day_start=day,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        max_tokens_requested=max_tokens,
        max_tokens_applied=applied,
        activation=bool(activation),
    )
    ops = connection.ops
    hold = (
        f"UPDATE {_PERIODS} SET reserved_tokens = reserved_tokens + %s,"
        " reserved_input = reserved_input + %s, reserved_output = reserved_output + %s,"
        " requests = requests + 1, activation_requests = activation_requests + %s"
        " WHERE id IN (%s, %s, %s)",
        [
            prompt_tokens + output_tokens,
            prompt_tokens,
            output_tokens,
            int(activation),
            *windows.ids,
        ],
    )
    insert = (
        f"INSERT INTO {_RESERVATIONS} (key_id, user_id, created_at, alive_at, month_start,"
        " day_start, prompt_tokens, output_tokens, max_tokens_requested,"
        " max_tokens_applied, activation, status)"
        " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s) RETURNING id",
        [
            key.pk,
            key.user_id,
            ops.adapt_datetimefield_value(now),
            ops.adapt_datetimefield_value(now),
            ops.adapt_datefield_value(month),
            ops.adapt_datefield_value(day),
            prompt_tokens,
            output_tokens,
            max_tokens,
            applied,
            bool(activation),
            ReservationStatus.RESERVED,
        ],
    )
    rows = yield [(_NO_FLUSH_WAIT, []), hold, insert, COMMIT]
    reservation.pk = rows[0][0]
    return reservation


def budget_settle(
    *, reservation_id: int, prompt_tokens: int, completion_tokens: int, release: bool = False
) -> bool:
    """Replace a reservation's hold by the actual usage. Idempotent: settling twice changes
    nothing and returns False. `release=True` marks a reservation freed by the sweep; settling
    one the sweep freed still charges the usage (the sweep already took its hold away)."""
    return run_steps(
        lambda: budget_settle_steps(
            reservation_id=reservation_id,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            release=release,
        )
    )


def _reservation_status_change(*, reservation_id, source, target, prompt_tokens, completion_tokens):
    """The conditional update that is the lock and the idempotency check at once: moves the
    reservation from `source` to `target` status and returns its windows and hold."""
    return (
        f"UPDATE {_RESERVATIONS} SET status = %s, settled_prompt_tokens = %s,"
        " settled_completion_tokens = %s, settled_at = %s"
        " WHERE id = %s AND status = %s"
        " RETURNING key_id, user_id, month_start, day_start, prompt_tokens, output_tokens",
        [
            target,
            prompt_tokens,
            completion_tokens,
            connection.ops.adapt_datetimefield_value(timezone.now()),
            reservation_id,
            source,
        ],
    )


def budget_settle_steps(*, reservation_id, prompt_tokens, completion_tokens, release=False):
    """`budget_settle` as steps (see `run_steps`)."""
    tokens = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}
    target = ReservationStatus.RELEASED if release else ReservationStatus.SETTLED
    rows = yield [
        (_NO_FLUSH_WAIT, []),
        _reservation_status_change(
            reservation_id=reservation_id,
            source=ReservationStatus.RESERVED,
            target=target,
            **tokens,
        ),
    ]
    still_held = bool(rows)
    if not rows and not release:
        # The sweep freed this hold while its request still ran (its process was frozen or
        # lost its heartbeat): the usage is charged all the same, once, and nothing is
        # un-reserved a second time.
        rows = yield [
            _reservation_status_change(
                reservation_id=reservation_id,
                source=ReservationStatus.RELEASED,
                target=ReservationStatus.SETTLED,
                **tokens,
            )
        ]
    if not rows:
        return False
    key_id, user_id, month, day, held_prompt, held_output = rows[0]
    if not still_held:
        held_prompt = held_output = 0
    windows = _windows_params(key_id=key_id, user_id=user_id, month=month, day=day)
    move = (
        f"UPDATE {_PERIODS} SET reserved_tokens = reserved_tokens - %s,"
        " reserved_input = reserved_input - %s, reserved_output = reserved_output - %s,"
        " used_tokens = used_tokens + %s, used_input = used_input + %s,"
        f" used_output = used_output + %s WHERE {_WINDOWS_WHERE}",
        [
            held_prompt + held_output,
            held_prompt,
            held_output,
            prompt_tokens + completion_tokens,
            prompt_tokens,
            completion_tokens,
            *windows,
        ],
    )
    # Locked first, in id order, so that concurrent settlements cannot deadlock.
    yield [(_windows_locking_select("id"), windows), move]
    return True


def budget_release_stale(*, older_than) -> int:
    """Free the holds of reservations and leases whose process has not said they are alive
    (`alive_at`, see `budget_holds_alive_steps`) for `older_than`: it died. Returns how many
    were freed."""
    cutoff = timezone.now() - older_than
    stale = BudgetReservation.objects.filter(
        status=ReservationStatus.RESERVED, alive_at__lt=cutoff
    ).values_list("id", flat=True)
    released = sum(
        budget_settle(reservation_id=rid, prompt_tokens=0, completion_tokens=0, release=True)
        for rid in list(stale)
    )
    for lease in BudgetLease.objects.filter(returned_at=None, alive_at__lt=cutoff):
        released += run_steps(lambda lease=lease: budget_lease_return_steps(lease=lease))
    return released


def budget_holds_alive_steps(*, reservation_ids=(), lease_ids=(), now):
    """Steps: mark the reservations and leases (ids) that a process still holds for running
    requests as alive at `now`, so that the sweep of stale holds leaves them alone."""
    statements = [(_NO_FLUSH_WAIT, [])]
    when = connection.ops.adapt_datetimefield_value(now)
    for table, ids, still_held, params in (
        (_RESERVATIONS, reservation_ids, "status = %s", [ReservationStatus.RESERVED]),
        (_LEASES, lease_ids, "returned_at IS NULL", []),
    ):
        if ids:
            placeholders = ", ".join(["%s"] * len(ids))
            statements.append(
                (
                    f"UPDATE {table} SET alive_at = %s"
                    f" WHERE id IN ({placeholders}) AND {still_held}",
                    [when, *ids, *params],
                )
            )
    yield [*statements, COMMIT]


# Budget leases (see `api.ledger`, which keeps them in memory). A lease takes at most
# 1/LEASE_SHARE of what the tightest window has left, and at most LEASE_MAX_TOKENS; none is
# granted unless it covers LEASE_MIN_REQUESTS requests like the one asking, so near a limit
# every request is reserved exactly, with the clamping and refusals of `budget_reserve`.
LEASE_SHARE = 16
LEASE_MAX_TOKENS = 1_000_000
LEASE_MIN_REQUESTS = 4

_LEASES = BudgetLease._meta.db_table


def _lease_windows(lease) -> list:
    return _windows_params(
        key_id=lease.key_id, user_id=lease.user_id, month=lease.month_start, day=lease.day_start
    )


def _windows_reserved_change(lease, tokens: int):
    return (
        f"UPDATE {_PERIODS} SET reserved_tokens = reserved_tokens + %s WHERE {_WINDOWS_WHERE}",
        [tokens, *_lease_windows(lease)],
    )


def budget_lease_steps(*, key, lease: BudgetLease, retiring, give_back: int, worst_case: int, now):
    """Steps: lease tokens of `key`'s windows of today, for requests of up to `worst_case`
    tokens, to `lease` (new and unsaved; created if granted), after giving `give_back`
    unused tokens of `retiring` (None, or a lease of the same windows) back. Returns the
    tokens granted, 0 when the windows are too close to their limits for leasing; a granted
    `lease` gets the ids of its windows as `window_ids`. Raises BudgetExceeded(spend_cap)
    when the service is paused (then nothing is given back)."""
    windows, spend_cap_paused = yield from _lock_windows_steps(
        key_id=key.pk, user_id=key.user_id, month=lease.month_start, day=lease.day_start
    )
    total_left, _, _ = _tightest_windows(
        key=key, windows=windows, spend_cap_paused=spend_cap_paused, activation=False
    )
    statements = [(_NO_FLUSH_WAIT, [])]
    if retiring is not None and give_back:
        statements += _lease_return_statements(retiring, give_back, final=False, now=now)
    grant = min(LEASE_MAX_TOKENS, (total_left + give_back) // LEASE_SHARE)
    if grant < worst_case * LEASE_MIN_REQUESTS:
        yield [*statements, COMMIT]
        return 0
    ops = connection.ops
    insert = (
        f"INSERT INTO {_LEASES} (key_id, user_id, created_at, alive_at, month_start,"
        " day_start, held_tokens, spent_prompt_tokens, spent_completion_tokens, requests)"
        " VALUES (%s, %s, %s, %s, %s, %s, %s, 0, 0, 0) RETURNING id",
        [
            key.pk,
            key.user_id,
            ops.adapt_datetimefield_value(now),
            ops.adapt_datetimefield_value(now),
            ops.adapt_datefield_value(lease.month_start),
            ops.adapt_datefield_value(lease.day_start),
            grant,
        ],
    )
    rows = yield [*statements, _windows_reserved_change(lease, grant), insert, COMMIT]
    lease.pk = rows[0][0]
    lease.window_ids = windows.ids
    return grant


def _lease_return_statements(lease, tokens: int, *, final: bool, now) -> Statements:
    """Statements giving `tokens` of `lease` back to its windows (which must be locked);
    `final` marks the lease returned."""
    returned = ", returned_at = %s" if final else ""
    params = [tokens, *([connection.ops.adapt_datetimefield_value(now)] if final else [])]
    return [
        _windows_reserved_change(lease, -tokens),
        (
            f"UPDATE {_LEASES} SET held_tokens = held_tokens - %s{returned} WHERE id = %s",
            [*params, lease.pk],
        ),
    ]


def budget_lease_return_steps(*, lease):
    """Steps: give all that `lease` (a BudgetLease) holds back to its windows and mark it
    returned. Returns 1, or 0 for a lease already returned."""
    rows = yield [
        (_windows_locking_select("id"), _lease_windows(lease)),
        (f"SELECT held_tokens FROM {_LEASES} WHERE id = %s AND returned_at IS NULL", [lease.pk]),
    ]
    if not rows:
        return 0
    statements = _lease_return_statements(lease, rows[0][0], final=True, now=timezone.now())
    yield [(_NO_FLUSH_WAIT, []), *statements, COMMIT]
    return 1


def budget_lease_spend_steps(*, spends: list[dict]):
    """Steps (PostgreSQL): move what requests spent from their leases' holds to used. Each
    of `spends` has `lease` (a BudgetLease with the `window_ids` that `budget_lease_steps`
    set), `prompt_tokens`, `completion_tokens` and `requests`. The windows are locked first,
    in id order, so concurrent flushes and reservations cannot deadlock; the statements are
    the same for any number of spends. What a lease the sweep already returned spent is
    counted as used without touching `reserved` (the sweep freed its hold)."""
    if not spends:
        return
    window_ids = sorted({window_id for spend in spends for window_id in spend["lease"].window_ids})
    lease_ids = [spend["lease"].pk for spend in spends]
    rows = yield [
        (_NO_FLUSH_WAIT, []),
        (f"SELECT id FROM {_PERIODS} WHERE id = ANY(%s) ORDER BY id FOR UPDATE", [window_ids]),
        (f"SELECT id FROM {_LEASES} WHERE id = ANY(%s) AND returned_at IS NULL", [lease_ids]),
    ]
    held = {lease_id for (lease_id,) in rows}
    windows: dict[int, list[int]] = {window_id: [0, 0, 0, 0] for window_id in window_ids}
    for spend in spends:
        prompt, completion = spend["prompt_tokens"], spend["completion_tokens"]
        released = prompt + completion if spend["lease"].pk in held else 0
        for window_id in spend["lease"].window_ids:
            totals = windows[window_id]
            totals[0] += released
            totals[1] += prompt
            totals[2] += completion
            totals[3] += spend["requests"]
    move = (
        f"UPDATE {_PERIODS} AS w SET reserved_tokens = w.reserved_tokens - d.released,"
        " used_tokens = w.used_tokens + d.prompt + d.completion,"
        " used_input = w.used_input + d.prompt, used_output = w.used_output + d.completion,"
        " requests = w.requests + d.requests"
        " FROM unnest(%s::bigint[], %s::bigint[], %s::bigint[], %s::bigint[], %s::integer[])"
        " AS d(id, released, prompt, completion, requests) WHERE w.id = d.id",
        [window_ids, *([windows[i][column] for i in window_ids] for column in range(4))],
    )
    leases = (
        f"UPDATE {_LEASES} AS l SET held_tokens = l.held_tokens - CASE WHEN"
        " l.returned_at IS NULL THEN d.prompt + d.completion ELSE 0 END,"
        " spent_prompt_tokens = l.spent_prompt_tokens + d.prompt,"
        " spent_completion_tokens = l.spent_completion_tokens + d.completion,"
        " requests = l.requests + d.requests"
        " FROM unnest(%s::bigint[], %s::bigint[], %s::bigint[], %s::integer[])"
        " AS d(id, prompt, completion, requests) WHERE l.id = d.id",
        [lease_ids, *([spend[name] for spend in spends] for name in _SPEND_FIELDS)],
    )
    yield [move, leases]


_SPEND_FIELDS = ("prompt_tokens", "completion_tokens", "requests")


def harvest_quota_consume(*, key: ApiKey, now=None) -> None:
    """Count one harvest job against the key's monthly quota, or raise `BudgetExceeded`
    (harvest_quota_exceeded, or spend_cap while the service is paused)."""
    now = now or timezone.now()
    run_steps(lambda: _harvest_quota_steps(key=key, now=now))


def _harvest_quota_steps(*, key: ApiKey, now):
    windows, spend_cap_paused = yield from _lock_windows_steps(
        key_id=key.pk, user_id=key.user_id, month=month_start(now), day=day_start(now)
    )
    _spend_cap_check(spend_cap_paused)
    if windows.key_month.harvest_jobs >= key.monthly_harvest_quota:
        raise BudgetExceeded(
            "harvest_quota_exceeded",
            "This key's monthly harvest-job quota is spent; it resets on the 1st.",
        )
    yield [
        (
            f"UPDATE {_PERIODS} SET harvest_jobs = harvest_jobs + 1 WHERE id = %s",
            [windows.key_month.pk],
        )
    ]


def harvest_quota_refund(*, key_id: int, month) -> None:
    """Give back one harvest job counted against the key's quota of `month` (the first day
    of the month it was submitted in), for a job that ended without delivering files."""
    UsagePeriod.objects.filter(
        key_id=key_id, period=Period.MONTH, start=month, harvest_jobs__gt=0
    ).update(harvest_jobs=F("harvest_jobs") - 1)


def budget_activations_refund_steps(*, reservation: BudgetReservation, count: int):
    """Steps: give back `count` of the activation requests `reservation` counted, for
    captures it held that did no work (a harvest batch that failed). Compose after the
    reservation's `budget_settle_steps`, in the same transaction."""
    windows = _windows_params(
        key_id=reservation.key_id,
        user_id=reservation.user_id,
        month=reservation.month_start,
        day=reservation.day_start,
    )
    yield [
        (_windows_locking_select("id"), windows),
        (
            f"UPDATE {_PERIODS} SET activation_requests = activation_requests - %s"
            f" WHERE {_WINDOWS_WHERE}",
            [count, *windows],
        ),
    ]


# ---------------------------------------------------------------------------------------
# Usage ledger

_RECORD_COLUMNS = [
    field.attname for field in UsageRecord._meta.concrete_fields if field.attname != "id"
]
_DAILY = UsageDaily._meta.db_table
_DAILY_COLUMNS = [
    field.attname for field in UsageDaily._meta.concrete_fields if field.attname != "id"
]


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
    """Write one request's metadata and add it to the daily roll-up, atomically (the
    gateway writes its records in batches with `usage_records_steps`)."""
    record = UsageRecord(
        created_at=now or timezone.now(),
        request_id=request_id,
        user_id=key.user_id,
        key_id=key.pk,
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
    run_steps(lambda: usage_records_steps(records=[record]))
    return record


def usage_records_steps(*, records: list[UsageRecord]):
    """Steps: insert unsaved `records` (setting their pk) and add them to the daily
    roll-up, in one round trip. Roll-up rows are upserted in a fixed order, so concurrent
    batches cannot deadlock."""
    if not records:
        return
    ops = connection.ops
    created_at, layers = (
        _RECORD_COLUMNS.index(name) for name in ("created_at", "activation_layers")
    )
    values = []
    days: dict[tuple, list] = {}
    for record in records:
        row = [getattr(record, column) for column in _RECORD_COLUMNS]
        row[created_at] = ops.adapt_datetimefield_value(record.created_at)
        if record.activation_layers is not None:
            row[layers] = json.dumps(record.activation_layers)
        values.append(row)
        group = (
            ops.adapt_datefield_value(day_start(record.created_at)),
            record.key_id,
            record.model,
            record.status_code,
            record.error_code,
        )
        totals = days.setdefault(group, [record.user_id, 0, 0, 0, 0.0])
        totals[1] += 1
        totals[2] += record.prompt_tokens
        totals[3] += record.completion_tokens
        totals[4] += record.latency_ms
    daily_rows = [
        [day, user_id, key_id, model, status_code, error_code, *sums]
        for (day, key_id, model, status_code, error_code), (user_id, *sums) in sorted(days.items())
    ]
    daily = _insert_rows(
        UsageDaily,
        _DAILY_COLUMNS,
        daily_rows,
        f""" ON CONFLICT (day, key_id, model, status_code, error_code) DO UPDATE SET
            requests = {_DAILY}.requests + excluded.requests,
            prompt_tokens = {_DAILY}.prompt_tokens + excluded.prompt_tokens,
            completion_tokens = {_DAILY}.completion_tokens + excluded.completion_tokens,
            latency_ms_sum = {_DAILY}.latency_ms_sum + excluded.latency_ms_sum""",
    )
    insert = _insert_rows(UsageRecord, _RECORD_COLUMNS, values, " RETURNING id")
    rows = yield [(_NO_FLUSH_WAIT, []), daily, insert]
    # The ids of a multi-row INSERT ... RETURNING come back in the order of its rows (as
    # Django's bulk_create also relies on, on PostgreSQL and SQLite).
    for record, (pk,) in zip(records, rows, strict=True):
        record.pk = pk


def usage_record_written_steps(*, record: UsageRecord):
    """Steps: whether the unsaved `record` was written already (by an attempt whose COMMIT
    was sent on a connection that then broke, so its outcome is unknown)."""
    rows = yield [
        (
            f"SELECT 1 FROM {UsageRecord._meta.db_table}"
            " WHERE key_id = %s AND created_at = %s AND request_id = %s",
            [
                record.key_id,
                connection.ops.adapt_datetimefield_value(record.created_at),
                record.request_id,
            ],
        )
    ]
    return bool(rows)


def _insert_rows(model, columns: list[str], rows: list[list], suffix: str) -> tuple[str, list]:
    """One INSERT of `rows` into `model`'s table, then `suffix`. On PostgreSQL the rows
    travel as one array per column, unnested: the statement's text and parameter count are
    the same for any number of rows, so psycopg reuses its parsed form (a VALUES list of a
    batch costs more CPU to parse than to send)."""
    table, names = model._meta.db_table, ", ".join(columns)
    if connection.vendor == "postgresql":
        types = [model._meta.get_field(column).db_type(connection) for column in columns]
        arrays = ", ".join(f"%s::{db_type}[]" for db_type in types)
        sql = f"INSERT INTO {table} ({names}) SELECT * FROM unnest({arrays}){suffix}"
        return sql, [list(column) for column in zip(*rows, strict=True)]
    marks = f"({', '.join(['%s'] * len(columns))})"
    sql = f"INSERT INTO {table} ({names}) VALUES {', '.join([marks] * len(rows))}{suffix}"
    return sql, [value for row in rows for value in row]


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


# ---------------------------------------------------------------------------------------
# Sign-up and access applications


def _user_state(user: User) -> dict:
    return {
        "status": user.status,
        "monthly_token_budget": user.monthly_token_budget,
        "is_staff": user.is_staff,
    }


def _user_status_change(user: User, status: str) -> None:
    user.status = status
    user.status_changed_at = timezone.now()
    user.save(update_fields=["status", "status_changed_at"])


def user_signup(
    *,
    email: str,
    password: str,
    name: str,
    organisation: str,
    planned_use: str,
    prior_work: str = "",
    profile_link: str = "",
    accepted_usage_rules: bool,
) -> User:
    """Create a `pending` account with its access application."""
    with transaction.atomic():
        user = User.objects.create_user(
            email, password, name=name, organisation=organisation, status=UserStatus.PENDING
        )
        application_submit(
            user=user,
            planned_use=planned_use,
            prior_work=prior_work,
            profile_link=profile_link,
            accepted_usage_rules=accepted_usage_rules,
        )
    return user


def application_submit(
    *,
    user: User,
    planned_use: str,
    prior_work: str = "",
    profile_link: str = "",
    accepted_usage_rules: bool,
) -> AccessApplication:
    """File an access application for a new (pending) or rejected account; a rejected account
    goes back to `pending`. Raises `ValidationError` for any other account or when an
    application is already waiting."""
    if not accepted_usage_rules:
        raise ValidationError({"accepted_usage_rules": "Accept the usage rules to apply."})
    with transaction.atomic():
        user = User.objects.select_for_update().get(pk=user.pk)
        if user.status not in (UserStatus.PENDING, UserStatus.REJECTED):
            raise ValidationError(f"An account that is {user.status} cannot apply.")
        if user.applications.filter(status=ApplicationStatus.PENDING).exists():
            raise ValidationError("An application of this account is already waiting for review.")
        if user.status == UserStatus.REJECTED:
            _user_status_change(user, UserStatus.PENDING)
        application = AccessApplication.objects.create(
            user=user,
            planned_use=planned_use,
            prior_work=prior_work,
            profile_link=profile_link,
            accepted_usage_rules=True,
        )
        audit_log(actor=user, action="application.submit", target=application)
    return application


def _application_decide(*, application, acting_user, note, approve: bool):
    """Lock and decide a pending application; return it, its locked user and the user's
    state before."""
    application = AccessApplication.objects.select_for_update().get(pk=application.pk)
    if application.status != ApplicationStatus.PENDING:
        raise ValidationError(f"This application was already {application.status}.")
    user = User.objects.select_for_update().get(pk=application.user_id)
    before = _user_state(user)
    application.status = ApplicationStatus.APPROVED if approve else ApplicationStatus.REJECTED
    application.decided_at = timezone.now()
    application.decided_by = acting_user
    application.decision_note = note
    application.save(update_fields=["status", "decided_at", "decided_by", "decision_note"])
    _user_status_change(user, UserStatus.APPROVED if approve else UserStatus.REJECTED)
    return application, user, before


def application_approve(
    *, application: AccessApplication, acting_user: User | None, note: str = ""
) -> AccessApplication:
    """Approve a pending application: the account becomes `approved` with the default budget
    (unless staff already set one), gets a first key "Default key" if it has none, and is
    e-mailed that the key waits on the API keys page. The secret is never e-mailed: it is
    kept encrypted in `ApiKey.pending_reveal` until the owner's first visit of /keys/."""
    with transaction.atomic():
        application, user, before = _application_decide(
            application=application, acting_user=acting_user, note=note, approve=True
        )
        if not user.monthly_token_budget:
            user.monthly_token_budget = settings.ACS_DEFAULT_ACCOUNT_MONTHLY_TOKENS
            user.save(update_fields=["monthly_token_budget"])
        if not user.api_keys.filter(is_playground=False).exists():
            key, secret = api_key_create(user=user, name="Default key", acting_user=acting_user)
            api_key_reveal_store(key=key, secret=secret)
        audit_log(
            actor=acting_user,
            action="user.approve",
            target=user,
            before=before,
            after=_user_state(user),
            note=note,
        )
        _decision_email_enqueue(application)
    return application


def application_reject(
    *, application: AccessApplication, acting_user: User | None, note: str = ""
) -> AccessApplication:
    """Reject a pending application and e-mail the applicant (with the note, if any); they
    may apply again."""
    with transaction.atomic():
        application, user, before = _application_decide(
            application=application, acting_user=acting_user, note=note, approve=False
        )
        audit_log(
            actor=acting_user,
            action="user.reject",
            target=user,
            before=before,
            after=_user_state(user),
            note=note,
        )
        _decision_email_enqueue(application)
    return application


def _decision_email_enqueue(application: AccessApplication) -> None:
    from .tasks import send_application_decision_email

    application_id = application.pk
    # robust: the decision stands even when the broker is down; the failure is logged.
    transaction.on_commit(
        lambda: send_application_decision_email.delay(application_id), robust=True
    )


def application_decision_email_send(*, application: AccessApplication) -> None:
    """E-mail the applicant the decision on their application. Never includes a key secret."""
    user = application.user
    site = settings.SITE_URL.rstrip("/")
    greeting = f"Hello {user.name or user.email},"
    if application.status == ApplicationStatus.APPROVED:
        subject = "Your ACS access is approved"
        body = (
            f"{greeting}\n\nYour application for the ACS research preview is approved.\n\n"
            f"Your first API key is waiting on the API keys page: {site}/keys/\n"
            "Its secret is shown there once, the first time you open the page, so copy it "
            "then.\n"
        )
    elif application.status == ApplicationStatus.REJECTED:
        subject = "Your ACS application"
        body = f"{greeting}\n\nWe could not approve your application for ACS this time.\n"
        if application.decision_note:
            body += f"\nNote from the reviewer:\n{application.decision_note}\n"
        body += f"\nYou may apply again at {site}/apply/ after logging in.\n"
    else:
        return
    send_mail(subject, body, settings.DEFAULT_FROM_EMAIL, [user.email])


# ---------------------------------------------------------------------------------------
# Account status and budgets (staff)


def user_suspend(*, user: User, acting_user: User | None, note: str = "") -> User:
    """Suspend an approved account: every key is refused with account_suspended."""
    return _user_status_move(
        user=user,
        acting_user=acting_user,
        note=note,
        source=UserStatus.APPROVED,
        target=UserStatus.SUSPENDED,
        action="user.suspend",
    )


def user_reactivate(*, user: User, acting_user: User | None, note: str = "") -> User:
    """Give a suspended account its access back."""
    return _user_status_move(
        user=user,
        acting_user=acting_user,
        note=note,
        source=UserStatus.SUSPENDED,
        target=UserStatus.APPROVED,
        action="user.reactivate",
    )


def _user_status_move(*, user, acting_user, note, source, target, action) -> User:
    with transaction.atomic():
        locked = User.objects.select_for_update().get(pk=user.pk)
        if locked.status != source:
            raise ValidationError(
                f"This account is {locked.status}; only {source} accounts can become {target}."
            )
        before = _user_state(locked)
        _user_status_change(locked, target)
        audit_log(
            actor=acting_user,
            action=action,
            target=locked,
            before=before,
            after=_user_state(locked),
            note=note,
        )
    user.status, user.status_changed_at = locked.status, locked.status_changed_at
    return user


def user_budget_set(*, user: User, acting_user: User | None, monthly_token_budget: int) -> User:
    """Set the account-wide monthly token budget (staff)."""
    if monthly_token_budget < 0:
        raise ValidationError({"monthly_token_budget": "A budget cannot be negative."})
    with transaction.atomic():
        locked = User.objects.select_for_update().get(pk=user.pk)
        before = {"monthly_token_budget": locked.monthly_token_budget}
        locked.monthly_token_budget = monthly_token_budget
        locked.save(update_fields=["monthly_token_budget"])
        audit_log(
            actor=acting_user,
            action="user.budget_set",
            target=locked,
            before=before,
            after={"monthly_token_budget": monthly_token_budget},
        )
    user.monthly_token_budget = monthly_token_budget
    return user


def user_login_lock(*, user, ip: str, failures: int, lockout_seconds: int):
    """Record that `user`'s sign-ins from `ip` are refused for `lockout_seconds` after
    `failures` wrong passwords (`accounts.login_throttle` keeps the lock itself)."""
    with transaction.atomic():
        return audit_log(
            actor=None,
            action="user.login_locked",
            target=user,
            after={"ip": ip, "failures": failures, "lockout_seconds": lockout_seconds},
        )


# ---------------------------------------------------------------------------------------
# Key management


KEY_BUDGET_FIELDS = (
    "monthly_token_budget",
    "daily_token_budget",
    "monthly_input_budget",
    "monthly_output_budget",
    "monthly_activation_quota",
    "monthly_harvest_quota",
)
# Token budgets a key's owner may set, each at most their account's monthly budget.
KEY_OWNER_BUDGET_FIELDS = KEY_BUDGET_FIELDS[:4]


def _key_locked(key: ApiKey) -> ApiKey:
    return ApiKey.objects.select_for_update().select_related("user").get(pk=key.pk)


def _is_operator(acting_user: User | None) -> bool:
    """Staff, or the system itself (CLI, admin scripts: no acting user)."""
    return acting_user is None or acting_user.is_staff


def api_key_rename(*, key: ApiKey, acting_user: User | None, name: str) -> ApiKey:
    name = name.strip()
    if not name:
        raise ValidationError({"name": "Give the key a name."})
    with transaction.atomic():
        locked = _key_locked(key)
        if locked.status == KeyStatus.REVOKED:
            raise ValidationError("A revoked key cannot be renamed.")
        before = {"name": locked.name}
        locked.name = name
        locked.save(update_fields=["name"])
        audit_log(
            actor=acting_user,
            action="key.rename",
            target=locked,
            before=before,
            after={"name": name},
        )
    return locked


def api_key_disable(*, key: ApiKey, acting_user: User | None) -> ApiKey:
    """Pause an active key: it is refused with key_disabled until enabled again."""
    return _api_key_status_move(
        key=key,
        acting_user=acting_user,
        sources=(KeyStatus.ACTIVE,),
        target=KeyStatus.DISABLED,
        action="key.disable",
    )


def api_key_enable(*, key: ApiKey, acting_user: User | None) -> ApiKey:
    """Resume a paused key."""
    return _api_key_status_move(
        key=key,
        acting_user=acting_user,
        sources=(KeyStatus.DISABLED,),
        target=KeyStatus.ACTIVE,
        action="key.enable",
    )


def api_key_revoke(*, key: ApiKey, acting_user: User | None) -> ApiKey:
    """Revoke a key for good (key_revoked); a secret still waiting to be shown is dropped."""
    return _api_key_status_move(
        key=key,
        acting_user=acting_user,
        sources=(KeyStatus.ACTIVE, KeyStatus.DISABLED),
        target=KeyStatus.REVOKED,
        action="key.revoke",
    )


def _api_key_status_move(*, key, acting_user, sources, target, action) -> ApiKey:
    with transaction.atomic():
        locked = _key_locked(key)
        if locked.status not in sources:
            raise ValidationError(
                f"This key is {locked.get_status_display().lower()}; it cannot be "
                f"{'revoked' if target == KeyStatus.REVOKED else 'changed that way'}."
            )
        before = {"status": locked.status}
        locked.status = target
        fields = ["status"]
        if target == KeyStatus.REVOKED:
            locked.revoked_at = timezone.now()
            locked.pending_reveal = ""
            fields += ["revoked_at", "pending_reveal"]
        locked.save(update_fields=fields)
        audit_log(
            actor=acting_user,
            action=action,
            target=locked,
            before=before,
            after={"status": target},
        )
    return locked


# Windows that are parts of a key's monthly window: none may be set above the whole.
_KEY_MONTHLY_PARTS = ("daily_token_budget", "monthly_input_budget", "monthly_output_budget")


def _key_budget_consistency_errors(key: ApiKey, budgets: dict) -> dict:
    """Errors for a change that sets a daily, input or output budget above the key's monthly
    budget. (Lowering only the monthly budget is allowed: it caps the others anyway.)"""
    monthly = budgets.get("monthly_token_budget", key.monthly_token_budget)
    return {
        field: f"At most the key's monthly budget ({monthly:,} tokens)."
        for field in _KEY_MONTHLY_PARTS
        if budgets.get(field) is not None and budgets[field] > monthly
    }


def api_key_budget_set(*, key: ApiKey, acting_user: User | None, budgets: dict) -> ApiKey:
    """Change some of a key's budgets (`budgets` maps names of `KEY_BUDGET_FIELDS` to values;
    None removes an optional input/output limit). Staff and the system may set anything; an
    owner may set only the token budgets, each at most the account's monthly budget.
    Raises `ValidationError` keyed by field."""
    unknown = set(budgets) - set(KEY_BUDGET_FIELDS)
    if unknown:
        raise ValueError(f"Unknown budget fields: {sorted(unknown)}")
    errors = {}
    with transaction.atomic():
        locked = _key_locked(key)
        account_cap = locked.user.monthly_token_budget
        for field, value in budgets.items():
            if value is None and field not in ("monthly_input_budget", "monthly_output_budget"):
                errors[field] = "This budget needs a value."
            elif value is not None and value < 0:
                errors[field] = "A budget cannot be negative."
            elif _is_operator(acting_user):
                continue
            elif field not in KEY_OWNER_BUDGET_FIELDS:
                errors[field] = "Only staff can change this quota."
            elif value is not None and value > account_cap:
                errors[field] = f"At most your account's monthly budget ({account_cap:,} tokens)."
        errors = _key_budget_consistency_errors(locked, budgets) | errors
        if errors:
            raise ValidationError(errors)
        before = api_key_budgets(locked)
        for field, value in budgets.items():
            setattr(locked, field, value)
        locked.save(update_fields=list(budgets))
        audit_log(
            actor=acting_user,
            action="key.budget_set",
            target=locked,
            before=before,
            after=api_key_budgets(locked),
        )
    return locked


# ---------------------------------------------------------------------------------------
# Showing a new key's secret once

# A Fernet key derived from SECRET_KEY for this one purpose: the secret waits encrypted in the
# database only until its owner's next visit of the API keys page.
_REVEAL_SALT = "accounts.api_key_pending_reveal"


def _reveal_cipher() -> Fernet:
    return Fernet(
        base64.urlsafe_b64encode(salted_hmac(_REVEAL_SALT, "", algorithm="sha256").digest())
    )


def api_key_reveal_store(*, key: ApiKey, secret: str) -> None:
    """Keep `secret` (encrypted) for one display on the owner's API keys page."""
    ApiKey.objects.filter(pk=key.pk).update(
        pending_reveal=_reveal_cipher().encrypt(secret.encode()).decode()
    )


def api_key_reveals_take(*, user: User) -> list[tuple[ApiKey, str | None]]:
    """Secrets waiting to be shown to `user`, each returned exactly once (a conditional clear,
    so two concurrent page loads cannot both show it). The secret is None when it can no
    longer be decrypted (SECRET_KEY rotated): the owner should revoke that key."""
    taken = []
    for key in ApiKey.objects.filter(user=user).exclude(pending_reveal=""):
        claimed = ApiKey.objects.filter(pk=key.pk, pending_reveal=key.pending_reveal).update(
            pending_reveal=""
        )
        if not claimed:
            continue
        try:
            secret = _reveal_cipher().decrypt(key.pending_reveal.encode()).decode()
        except InvalidToken:
            secret = None
        key.pending_reveal = ""
        taken.append((key, secret))
    return taken
