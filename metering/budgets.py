"""Budgets: reserve a request's worst case before it runs, settle to the actual count after
it; budget leases (see `metering.leases`, which keeps them in memory); quotas.

Every step generator here runs with `sql.run_steps` or `sql.run_steps_async`, so the logic
exists once for the sync callers (jobs, sweeps) and the async gateway. The windows and their
limits come from `metering.windows`.
"""

from functools import reduce
from operator import or_

from django.db import connection
from django.db.models import F, Q
from django.utils import timezone

from accounts.models import ApiKey, ServiceSettings

from . import windows
from .models import BudgetLease, BudgetReservation, ReservationStatus, UsagePeriod
from .sql import COMMIT, NO_FLUSH_WAIT, Statements, int_array, run_steps


class BudgetExceeded(Exception):
    """A request the budgets refuse; `code` is budget_exceeded, activation_quota_exceeded,
    harvest_quota_exceeded or spend_cap."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


_ROWS_TABLE = UsagePeriod._meta.db_table
_PERIOD_COLUMNS = [field.attname for field in UsagePeriod._meta.concrete_fields]
_RESERVATIONS = BudgetReservation._meta.db_table
_LEASES = BudgetLease._meta.db_table
_SPEND_CAP_PAUSED = f"SELECT spend_cap_paused FROM {ServiceSettings._meta.db_table} WHERE id = 1"


class _Locked:
    """A key's window rows, locked: `row[(scope, period)]` and their `ids`."""

    def __init__(self, periods: list[UsagePeriod]):
        self.row = {windows.row_of(period): period for period in periods}
        self.ids = [period.pk for period in periods]


def _lock_windows_steps(*, key_id, user_id, day):
    """Steps: lock and read the key's and account's window rows; returns `(_Locked,
    spend_cap_paused)`, the service's spend-cap flag being read in the same round trip."""
    columns = ", ".join(_PERIOD_COLUMNS)
    rows = yield [
        (
            windows.locking_select(f"{columns}, ({_SPEND_CAP_PAUSED})"),
            windows.params(key_id=key_id, user_id=user_id, day=day),
        )
    ]
    if len(rows) < len(windows.rows()):
        raise windows.WindowsMissing(key_id=key_id, user_id=user_id, day=day)
    periods = [UsagePeriod(**dict(zip(_PERIOD_COLUMNS, row, strict=False))) for row in rows]
    return _Locked(periods), bool(rows[0][-1])


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


def _tightest_windows(*, key, locked: _Locked, spend_cap_paused, activation):
    """`(total, input, output)` tokens left for a request of `key` in its locked windows
    (input and output None when the key has no such budget); raises BudgetExceeded when the
    spend cap or the activation quota refuses the request (`activation` requests of it)."""
    _spend_cap_check(spend_cap_paused)
    activations = windows.tightest(key, locked.row, windows.ACTIVATION_REQUESTS)
    if activation and activations is not None and activations[0] < activation:
        raise BudgetExceeded(
            "activation_quota_exceeded",
            f"{activations[1].whose} {activations[1].period.adjective} activation-request quota"
            f" is spent; it resets {activations[1].period.resets} (UTC).",
        )
    return (
        windows.left(key, locked.row, windows.TOKENS),
        windows.left(key, locked.row, windows.INPUT),
        windows.left(key, locked.row, windows.OUTPUT),
    )


def _id_list(ids) -> str:
    return ", ".join(["%s"] * len(ids))


def budget_reserve_steps(*, key, prompt_tokens, max_tokens, completions, activation, now):
    """`budget_reserve` as steps (see `sql.run_steps`)."""
    day = windows.utc_day(now)
    locked, spend_cap_paused = yield from _lock_windows_steps(
        key_id=key.pk, user_id=key.user_id, day=day
    )
    total_left, input_left, output_left = _tightest_windows(
        key=key, locked=locked, spend_cap_paused=spend_cap_paused, activation=activation
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
        month_start=windows.MONTH.start(day),
        day_start=day,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        max_tokens_requested=max_tokens,
        max_tokens_applied=applied,
        activation_requests=int(activation),
    )
    ops = connection.ops
    hold = (
        f"UPDATE {_ROWS_TABLE} SET reserved_tokens = reserved_tokens + %s,"
        " reserved_input = reserved_input + %s, reserved_output = reserved_output + %s,"
        " requests = requests + 1, activation_requests = activation_requests + %s"
        f" WHERE id IN ({_id_list(locked.ids)})",
        [
            prompt_tokens + output_tokens,
            prompt_tokens,
            output_tokens,
            int(activation),
            *locked.ids,
        ],
    )
    insert = (
        f"INSERT INTO {_RESERVATIONS} (key_id, user_id, created_at, alive_at, month_start,"
        " day_start, prompt_tokens, output_tokens, max_tokens_requested,"
        " max_tokens_applied, activation_requests, status)"
        " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s) RETURNING id",
        [
            key.pk,
            key.user_id,
            ops.adapt_datetimefield_value(now),
            ops.adapt_datetimefield_value(now),
            ops.adapt_datefield_value(reservation.month_start),
            ops.adapt_datefield_value(day),
            prompt_tokens,
            output_tokens,
            max_tokens,
            applied,
            int(activation),
            ReservationStatus.RESERVED,
        ],
    )
    rows = yield [NO_FLUSH_WAIT, hold, insert, COMMIT]
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
        " RETURNING key_id, user_id, day_start, prompt_tokens, output_tokens,"
        " activation_requests",
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
    """`budget_settle` as steps (see `sql.run_steps`)."""
    tokens = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}
    target = ReservationStatus.RELEASED if release else ReservationStatus.SETTLED
    rows = yield [
        NO_FLUSH_WAIT,
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
    key_id, user_id, day, held_prompt, held_output, activations = rows[0]
    if not still_held:
        held_prompt = held_output = 0
    # A hold the sweep frees gives its activation requests back (no capture reached its
    # caller, whose process died: a harvest re-run counts the batch again); a late
    # settlement of such a hold counts them once more.
    activations_change = -activations if release else (0 if still_held else activations)
    params = windows.params(key_id=key_id, user_id=user_id, day=day)
    move = (
        f"UPDATE {_ROWS_TABLE} SET reserved_tokens = reserved_tokens - %s,"
        " reserved_input = reserved_input - %s, reserved_output = reserved_output - %s,"
        " used_tokens = used_tokens + %s, used_input = used_input + %s,"
        " used_output = used_output + %s, activation_requests = activation_requests + %s"
        f" WHERE {windows.where()}",
        [
            held_prompt + held_output,
            held_prompt,
            held_output,
            prompt_tokens + completion_tokens,
            prompt_tokens,
            completion_tokens,
            activations_change,
            *params,
        ],
    )
    # Locked first, in id order, so that concurrent settlements cannot deadlock.
    yield [(windows.locking_select("id"), params), move]
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
    statements = [NO_FLUSH_WAIT]
    when = connection.ops.adapt_datetimefield_value(now)
    for table, ids, still_held, params in (
        (_RESERVATIONS, reservation_ids, "status = %s", [ReservationStatus.RESERVED]),
        (_LEASES, lease_ids, "returned_at IS NULL", []),
    ):
        if ids:
            statements.append(
                (
                    f"UPDATE {table} SET alive_at = %s"
                    f" WHERE id IN ({_id_list(ids)}) AND {still_held}",
                    [when, *ids, *params],
                )
            )
    yield [*statements, COMMIT]


# ---------------------------------------------------------------------------------------
# Budget leases. A lease takes at most 1/LEASE_SHARE of what the tightest window has left,
# and at most LEASE_MAX_TOKENS; none is granted unless it covers LEASE_MIN_REQUESTS requests
# like the one asking, so near a limit every request is reserved exactly, with the clamping
# and refusals of `budget_reserve`.
LEASE_SHARE = 16
LEASE_MAX_TOKENS = 1_000_000
LEASE_MIN_REQUESTS = 4


def _lease_windows(lease) -> list:
    return windows.params(key_id=lease.key_id, user_id=lease.user_id, day=lease.day_start)


def _windows_reserved_change(lease, tokens: int):
    return (
        f"UPDATE {_ROWS_TABLE} SET reserved_tokens = reserved_tokens + %s WHERE {windows.where()}",
        [tokens, *_lease_windows(lease)],
    )


def budget_lease_steps(*, key, lease: BudgetLease, retiring, give_back: int, worst_case: int, now):
    """Steps: lease tokens of `key`'s windows of today, for requests of up to `worst_case`
    tokens, to `lease` (new and unsaved; created if granted), after giving `give_back`
    unused tokens of `retiring` (None, or a lease of the same windows) back. Returns the
    tokens granted, 0 when the windows are too close to their limits for leasing; a granted
    `lease` gets the ids of its windows as `window_ids`. Raises BudgetExceeded(spend_cap)
    when the service is paused (then nothing is given back)."""
    locked, spend_cap_paused = yield from _lock_windows_steps(
        key_id=key.pk, user_id=key.user_id, day=lease.day_start
    )
    total_left, _, _ = _tightest_windows(
        key=key, locked=locked, spend_cap_paused=spend_cap_paused, activation=False
    )
    statements = [NO_FLUSH_WAIT]
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
    lease.window_ids = locked.ids
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
        (windows.locking_select("id"), _lease_windows(lease)),
        (f"SELECT held_tokens FROM {_LEASES} WHERE id = %s AND returned_at IS NULL", [lease.pk]),
    ]
    if not rows:
        return 0
    statements = _lease_return_statements(lease, rows[0][0], final=True, now=timezone.now())
    yield [NO_FLUSH_WAIT, *statements, COMMIT]
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
        NO_FLUSH_WAIT,
        (
            f"SELECT id FROM {_ROWS_TABLE} WHERE id = ANY(%s::bigint[]) ORDER BY id FOR UPDATE",
            [int_array(window_ids)],
        ),
        (
            f"SELECT id FROM {_LEASES} WHERE id = ANY(%s::bigint[]) AND returned_at IS NULL",
            [int_array(lease_ids)],
        ),
    ]
    held = {lease_id for (lease_id,) in rows}
    by_window: dict[int, list[int]] = {window_id: [0, 0, 0, 0] for window_id in window_ids}
    for spend in spends:
        prompt, completion = spend["prompt_tokens"], spend["completion_tokens"]
        released = prompt + completion if spend["lease"].pk in held else 0
        for window_id in spend["lease"].window_ids:
            totals = by_window[window_id]
            totals[0] += released
            totals[1] += prompt
            totals[2] += completion
            totals[3] += spend["requests"]
    move = (
        f"UPDATE {_ROWS_TABLE} AS w SET reserved_tokens = w.reserved_tokens - d.released,"
        " used_tokens = w.used_tokens + d.prompt + d.completion,"
        " used_input = w.used_input + d.prompt, used_output = w.used_output + d.completion,"
        " requests = w.requests + d.requests"
        " FROM unnest(%s::bigint[], %s::bigint[], %s::bigint[], %s::bigint[], %s::integer[])"
        " AS d(id, released, prompt, completion, requests) WHERE w.id = d.id",
        [
            int_array(window_ids),
            *(int_array(by_window[i][column] for i in window_ids) for column in range(4)),
        ],
    )
    leases = (
        f"UPDATE {_LEASES} AS l SET held_tokens = l.held_tokens - CASE WHEN"
        " l.returned_at IS NULL THEN d.prompt + d.completion ELSE 0 END,"
        " spent_prompt_tokens = l.spent_prompt_tokens + d.prompt,"
        " spent_completion_tokens = l.spent_completion_tokens + d.completion,"
        " requests = l.requests + d.requests"
        " FROM unnest(%s::bigint[], %s::bigint[], %s::bigint[], %s::integer[])"
        " AS d(id, prompt, completion, requests) WHERE l.id = d.id",
        [
            int_array(lease_ids),
            *(int_array(spend[name] for spend in spends) for name in _SPEND_FIELDS),
        ],
    )
    yield [move, leases]


_SPEND_FIELDS = ("prompt_tokens", "completion_tokens", "requests")


def harvest_quota_consume(*, key: ApiKey, now=None) -> None:
    """Count one harvest job against the key's monthly quota, or raise `BudgetExceeded`
    (harvest_quota_exceeded, or spend_cap while the service is paused)."""
    now = now or timezone.now()
    run_steps(lambda: _harvest_quota_steps(key=key, now=now))


def _harvest_quota_steps(*, key: ApiKey, now):
    locked, spend_cap_paused = yield from _lock_windows_steps(
        key_id=key.pk, user_id=key.user_id, day=windows.utc_day(now)
    )
    _spend_cap_check(spend_cap_paused)
    quotas = windows.windows_of(windows.HARVEST_JOBS)
    harvests = windows.tightest(key, locked.row, windows.HARVEST_JOBS)
    if harvests is not None and harvests[0] < 1:
        raise BudgetExceeded(
            "harvest_quota_exceeded",
            f"{harvests[1].whose} harvest-job quota is spent; it resets "
            f"{harvests[1].period.resets} (UTC).",
        )
    ids = [locked.row[window.row].pk for window in quotas]
    yield [
        (
            f"UPDATE {_ROWS_TABLE} SET harvest_jobs = harvest_jobs + 1"
            f" WHERE id IN ({_id_list(ids)})",
            ids,
        )
    ]


def harvest_quota_refund(*, key_id: int, submitted_at) -> None:
    """Give back one harvest job counted against the key's and its account's quotas when it
    was submitted (at `submitted_at`), for a job that ended without delivering files."""
    day = windows.utc_day(submitted_at)
    user_id = ApiKey.objects.filter(pk=key_id).values_list("user_id", flat=True).get()
    owners = {windows.KEY: Q(key_id=key_id), windows.ACCOUNT: Q(key=None, user_id=user_id)}
    rows = reduce(
        or_,
        (
            owners[window.scope] & Q(period=window.period.name, start=window.period.start(day))
            for window in windows.windows_of(windows.HARVEST_JOBS)
        ),
    )
    UsagePeriod.objects.filter(rows, harvest_jobs__gt=0).update(harvest_jobs=F("harvest_jobs") - 1)


def budget_activations_refund_steps(*, reservation: BudgetReservation, count: int):
    """Steps: give back `count` of the activation requests `reservation` counted, for
    captures it held that did no work (a harvest batch that failed). Compose after the
    reservation's `budget_settle_steps`, in the same transaction."""
    params = windows.params(
        key_id=reservation.key_id, user_id=reservation.user_id, day=reservation.day_start
    )
    yield [
        (windows.locking_select("id"), params),
        (
            f"UPDATE {_ROWS_TABLE} SET activation_requests = activation_requests - %s"
            f" WHERE {windows.where()}",
            [count, *params],
        ),
    ]
