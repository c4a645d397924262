"""The budget periods and windows, declared once.

A period is a span of whole UTC days: where the one containing a day starts, and the day the
next starts (its reset). A window is a limit on one counter of one `UsagePeriod` row: the row
of a key or of its account (`scope`) for the current period. Its limit is an attribute of the
key, or of the key's user for an account window (None: no limit); flags say who may set it
and how. Every query, lock, selector, lease decision, budget form, budget setting and audit
reads these tables: adding a window, even on a new period, is one entry here and its limit's
model field (with its migration; a required limit also gets its default where keys are
created).

Every counter is kept in every row (a request's hold and usage go to all rows), so a new
window on an existing row needs no other change.
"""

import datetime as dt
import functools
from collections.abc import Callable
from dataclasses import dataclass

from django.db import connection

from .models import UsagePeriod
from .sql import MissingRows


def utc_day(moment: dt.datetime) -> dt.date:
    """The UTC day of `moment`: every period's start is a function of it."""
    return moment.astimezone(dt.UTC).date()


@dataclass(frozen=True)
class Period:
    name: str  # as stored in `UsagePeriod.period`
    adjective: str  # "a daily budget"
    start: Callable[[dt.date], dt.date]  # the first day of the period containing a day
    following: Callable[[dt.date], dt.date]  # the first day of the next period
    resets: str  # when it resets, after the adjective: "monthly on the 1st"

    def next_reset(self, day: dt.date) -> dt.datetime:
        """The instant the period containing `day` ends."""
        return dt.datetime.combine(self.following(day), dt.time.min, tzinfo=dt.UTC)


def _month_start(day: dt.date) -> dt.date:
    return day.replace(day=1)


def _next_month(day: dt.date) -> dt.date:
    return (_month_start(day) + dt.timedelta(days=31)).replace(day=1)


def _week_start(day: dt.date) -> dt.date:
    return day - dt.timedelta(days=day.weekday())


def _next_week(day: dt.date) -> dt.date:
    return _week_start(day) + dt.timedelta(days=7)


DAY = Period("day", "daily", lambda day: day, lambda day: day + dt.timedelta(days=1), "at midnight")
WEEK = Period("week", "weekly", _week_start, _next_week, "on Mondays")
MONTH = Period("month", "monthly", _month_start, _next_month, "on the 1st")
PERIODS = (DAY, WEEK, MONTH)

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
    period: Period
    counter: Counter
    limit: str  # attribute of the key (KEY) or of its user (ACCOUNT)
    # Who may set the limit: the key's owner (up to their account's monthly budget) or only
    # staff; whether it may be empty (no limit); the window whose limit it may not exceed.
    owner_sets: bool = False
    optional: bool = False
    at_most: str | None = None

    @property
    def row(self) -> tuple[str, str]:
        return self.scope, self.period.name

    @property
    def whose(self) -> str:
        """Whose limit it is, as a refusal names it: "This key's" or "This account's"."""
        return "This key's" if self.scope == KEY else "This account's"

    def limit_of(self, key) -> int | None:
        return getattr(key if self.scope == KEY else key.user, self.limit)

    def used(self, row: UsagePeriod) -> int:
        return getattr(row, self.counter.used)

    def reserved(self, row: UsagePeriod) -> int:
        return 0 if self.counter.reserved is None else getattr(row, self.counter.reserved)


WINDOWS = (
    Window(
        "key_monthly",
        "Key, this month (tokens)",
        KEY,
        MONTH,
        TOKENS,
        "monthly_token_budget",
        owner_sets=True,
    ),
    Window(
        "key_daily",
        "Key, today (tokens)",
        KEY,
        DAY,
        TOKENS,
        "daily_token_budget",
        owner_sets=True,
        at_most="key_monthly",
    ),
    Window(
        "account_monthly",
        "Account, this month (tokens)",
        ACCOUNT,
        MONTH,
        TOKENS,
        "monthly_token_budget",
    ),
    Window(
        "key_monthly_input",
        "Key input, this month (tokens)",
        KEY,
        MONTH,
        INPUT,
        "monthly_input_budget",
        owner_sets=True,
        optional=True,
        at_most="key_monthly",
    ),
    Window(
        "key_monthly_output",
        "Key output, this month (tokens)",
        KEY,
        MONTH,
        OUTPUT,
        "monthly_output_budget",
        owner_sets=True,
        optional=True,
        at_most="key_monthly",
    ),
    Window(
        "activation_requests",
        "Activation requests, this month",
        KEY,
        MONTH,
        ACTIVATION_REQUESTS,
        "monthly_activation_quota",
    ),
    Window(
        "harvest_jobs",
        "Harvest jobs, this month",
        KEY,
        MONTH,
        HARVEST_JOBS,
        "monthly_harvest_quota",
    ),
    # The account's quotas, across its keys: a new key's fresh quota adds nothing to them.
    Window(
        "account_activation_requests",
        "Account activation requests, this month",
        ACCOUNT,
        MONTH,
        ACTIVATION_REQUESTS,
        "monthly_activation_quota",
    ),
    Window(
        "account_harvest_jobs",
        "Account harvest jobs, this month",
        ACCOUNT,
        MONTH,
        HARVEST_JOBS,
        "monthly_harvest_quota",
    ),
)
# The window whose limit caps what a key's owner may set (`Window.owner_sets`).
ACCOUNT_MONTHLY = "account_monthly"


def named(name: str) -> Window:
    return next(window for window in WINDOWS if window.name == name)


def of_scope(scope: str) -> list[Window]:
    """The windows whose limits are attributes of a key (KEY) or of an account (ACCOUNT)."""
    return [window for window in WINDOWS if window.scope == scope]


def windows_of(counter: Counter) -> list[Window]:
    return [window for window in WINDOWS if window.counter is counter]


def rows() -> tuple[tuple[str, Period], ...]:
    """The `(scope, period)` rows the windows live in, in a fixed order."""
    return _rows(WINDOWS)


@functools.cache
def _rows(windows) -> tuple[tuple[str, Period], ...]:
    return tuple(dict.fromkeys((window.scope, window.period) for window in windows))


def row_of(period: UsagePeriod) -> tuple[str, str]:
    """The `Window.row` of a `UsagePeriod`."""
    return (KEY if period.key_id else ACCOUNT), period.period


def tightest(key, locked: dict, counter: Counter) -> tuple[int, Window] | None:
    """What the tightest window of `counter` has left for `key`, and that window, given the
    key's rows `locked` (by `Window.row`); None when none of them has a limit."""
    lefts = [
        (limit - window.used(locked[window.row]) - window.reserved(locked[window.row]), window)
        for window in windows_of(counter)
        if (limit := window.limit_of(key)) is not None
    ]
    return min(lefts, key=lambda item: item[0]) if lefts else None


def left(key, locked: dict, counter: Counter) -> int | None:
    """The least that the windows of `counter` have left for `key` (see `tightest`)."""
    found = tightest(key, locked, counter)
    return None if found is None else found[0]


def has_split_limit(key) -> bool:
    """Whether a window limits the key's input or output tokens apart from the total (such
    requests are reserved exactly, never out of a budget lease)."""
    return any(
        window.limit_of(key) is not None for window in (*windows_of(INPUT), *windows_of(OUTPUT))
    )


def period_resets() -> list[str]:
    """When the windows' periods reset ("monthly on the 1st", ...), once each."""
    return list(dict.fromkeys(f"{period.adjective} {period.resets}" for _, period in rows()))


# ---------------------------------------------------------------------------------------
# SQL of a key's rows

_ROWS_TABLE = UsagePeriod._meta.db_table


def where() -> str:
    """SQL condition selecting a key's rows of the current periods; parameters by `params`."""
    return _where(rows())


@functools.cache
def _where(rows) -> str:
    conditions = []
    for scope, owner in ((KEY, "key_id = %s"), (ACCOUNT, "key_id IS NULL AND user_id = %s")):
        periods = [f"(period = '{period.name}' AND start = %s)" for s, period in rows if s == scope]
        if periods:
            conditions.append(f"({owner} AND ({' OR '.join(periods)}))")
    return " OR ".join(conditions)


def params(*, key_id, user_id, day) -> list:
    """The parameters of `where()` for a key and its user, in the periods containing the UTC
    date `day`."""
    adapt = connection.ops.adapt_datefield_value
    values = []
    for scope, owner in ((KEY, key_id), (ACCOUNT, user_id)):
        starts = [adapt(period.start(day)) for s, period in rows() if s == scope]
        if starts:
            values += [owner, *starts]
    return values


def locking_select(columns: str) -> str:
    """SELECT `columns` of a key's rows, locking them in id order (so concurrent requests
    cannot deadlock); SQLite has no row locks and serialises writers."""
    lock = " FOR UPDATE" if connection.features.has_select_for_update else ""
    return f"SELECT {columns} FROM {_ROWS_TABLE} WHERE {where()} ORDER BY id{lock}"


class WindowsMissing(MissingRows):
    """A key's rows for the periods of a day do not exist yet: `create()` makes them."""

    def __init__(self, *, key_id, user_id, day):
        super().__init__(f"budget windows of key {key_id} for {day} do not exist yet")
        self.key_id, self.user_id, self.day = key_id, user_id, day

    def create(self) -> None:
        UsagePeriod.objects.bulk_create(
            [
                UsagePeriod(
                    user_id=self.user_id,
                    key_id=self.key_id if scope == KEY else None,
                    period=period.name,
                    start=period.start(self.day),
                )
                for scope, period in rows()
            ],
            ignore_conflicts=True,
        )
