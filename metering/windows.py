"""The budget windows, declared once.

A window is a limit on one counter of one `UsagePeriod` row: the row of a key or of its
account (`scope`), for the current UTC month or day (`period`). Its limit is an attribute of
the key, or of the key's user for an account window (None: no limit). Every query, lock,
selector and lease decision of the money path reads this table: adding a window is one entry
here, its limit's model field (a migration) and its form field.

Every counter is kept in every row (a request's hold and usage go to all rows), so a new
window on an existing row needs no other change.
"""

import functools
from dataclasses import dataclass

from django.db import connection

from accounts.models import Period, UsagePeriod

from .sql import MissingRows

KEY, ACCOUNT = "key", "account"


@dataclass(frozen=True)
class Counter:
    """Columns of `UsagePeriod` that a window limits: what is used, and what running
    requests hold (None for counters that are never held, such as quotas)."""

    used: str
    reserved: str | None = None


TOKENS = Counter("used_tokens", "reserved_tokens")
INPUT = Counter("used_input", "reserved_input")
OUTPUT = Counter("used_output", "reserved_output")
ACTIVATION_REQUESTS = Counter("activation_requests")
HARVEST_JOBS = Counter("harvest_jobs")


@dataclass(frozen=True)
class Window:
    name: str
    label: str
    scope: str  # KEY or ACCOUNT
    period: str  # Period.MONTH or Period.DAY
    counter: Counter
    limit: str  # attribute of the key (KEY) or of its user (ACCOUNT)

    @property
    def row(self) -> tuple[str, str]:
        return self.scope, self.period

    def limit_of(self, key) -> int | None:
        return getattr(key if self.scope == KEY else key.user, self.limit)

    def used(self, row: UsagePeriod) -> int:
        return getattr(row, self.counter.used)

    def reserved(self, row: UsagePeriod) -> int:
        return 0 if self.counter.reserved is None else getattr(row, self.counter.reserved)


WINDOWS = (
    Window(
        "key_monthly", "Key, this month (tokens)", KEY, Period.MONTH, TOKENS, "monthly_token_budget"
    ),
    Window("key_daily", "Key, today (tokens)", KEY, Period.DAY, TOKENS, "daily_token_budget"),
    Window(
        "account_monthly",
        "Account, this month (tokens)",
        ACCOUNT,
        Period.MONTH,
        TOKENS,
        "monthly_token_budget",
    ),
    Window(
        "key_monthly_input",
        "Key input, this month (tokens)",
        KEY,
        Period.MONTH,
        INPUT,
        "monthly_input_budget",
    ),
    Window(
        "key_monthly_output",
        "Key output, this month (tokens)",
        KEY,
        Period.MONTH,
        OUTPUT,
        "monthly_output_budget",
    ),
    Window(
        "activation_requests",
        "Activation requests, this month",
        KEY,
        Period.MONTH,
        ACTIVATION_REQUESTS,
        "monthly_activation_quota",
    ),
    Window(
        "harvest_jobs",
        "Harvest jobs, this month",
        KEY,
        Period.MONTH,
        HARVEST_JOBS,
        "monthly_harvest_quota",
    ),
)


def windows_of(counter: Counter) -> list[Window]:
    return [window for window in WINDOWS if window.counter is counter]


def rows() -> tuple[tuple[str, str], ...]:
    """The `(scope, period)` rows the windows live in, in a fixed order."""
    return _rows(WINDOWS)


@functools.cache
def _rows(windows) -> tuple[tuple[str, str], ...]:
    return tuple(dict.fromkeys(window.row for window in windows))


def row_of(period: UsagePeriod) -> tuple[str, str]:
    return (KEY if period.key_id else ACCOUNT), period.period


def left(key, locked: dict, counter: Counter) -> int | None:
    """The least that the windows of `counter` have left for `key`, given its rows
    `locked` (by `(scope, period)`); None when none of them has a limit."""
    lefts = [
        limit - window.used(locked[window.row]) - window.reserved(locked[window.row])
        for window in windows_of(counter)
        if (limit := window.limit_of(key)) is not None
    ]
    return min(lefts) if lefts else None


def has_split_limit(key) -> bool:
    """Whether a window limits the key's input or output tokens apart from the total (such
    requests are reserved exactly, never out of a budget lease)."""
    return any(
        window.limit_of(key) is not None for window in (*windows_of(INPUT), *windows_of(OUTPUT))
    )


# ---------------------------------------------------------------------------------------
# SQL of a key's rows

_PERIODS = UsagePeriod._meta.db_table


def where() -> str:
    """SQL condition selecting a key's rows of the current period; parameters by `params`."""
    return _where(rows())


@functools.cache
def _where(rows) -> str:
    conditions = []
    for scope, owner in ((KEY, "key_id = %s"), (ACCOUNT, "key_id IS NULL AND user_id = %s")):
        periods = [f"(period = '{period}' AND start = %s)" for s, period in rows if s == scope]
        if periods:
            conditions.append(f"({owner} AND ({' OR '.join(periods)}))")
    return " OR ".join(conditions)


def params(*, key_id, user_id, month, day) -> list:
    """The parameters of `where()` for a key, its user and the period starts."""
    adapt = connection.ops.adapt_datefield_value
    starts = {Period.MONTH: adapt(month), Period.DAY: adapt(day)}
    values = []
    for scope, owner in ((KEY, key_id), (ACCOUNT, user_id)):
        periods = [starts[period] for s, period in rows() if s == scope]
        if periods:
            values += [owner, *periods]
    return values


def locking_select(columns: str) -> str:
    """SELECT `columns` of a key's rows, locking them in id order (so concurrent requests
    cannot deadlock); SQLite has no row locks and serialises writers."""
    lock = " FOR UPDATE" if connection.features.has_select_for_update else ""
    return f"SELECT {columns} FROM {_PERIODS} WHERE {where()} ORDER BY id{lock}"


class WindowsMissing(MissingRows):
    """A key's rows for the current period do not exist yet: `create()` makes them."""

    def __init__(self, *, key_id, user_id, month, day):
        super().__init__(f"budget windows of key {key_id} for {day} do not exist yet")
        self.key_id, self.user_id, self.month, self.day = key_id, user_id, month, day

    def create(self) -> None:
        starts = {Period.MONTH: self.month, Period.DAY: self.day}
        UsagePeriod.objects.bulk_create(
            [
                UsagePeriod(
                    user_id=self.user_id,
                    key_id=self.key_id if scope == KEY else None,
                    period=period,
                    start=starts[period],
                )
                for scope, period in rows()
            ],
            ignore_conflicts=True,
        )
