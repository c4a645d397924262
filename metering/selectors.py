"""Budget and usage reads: a key's budget windows, and behind the usage pages per-day
series, totals and errors from the `UsageDaily` roll-up, the keyset-paged request log and
the staff overview.

Every period is a whole number of UTC days, `start` to `end` inclusive. Series read only the
roll-up (one row per day, key, model, status and error code), never the raw records; the
request log and the latency percentiles read `UsageRecord` through its indexes, bounded.
"""

import datetime as dt
import statistics
from dataclasses import dataclass
from functools import reduce
from operator import or_

from django.db import connection
from django.db.models import Q, Sum
from django.utils import timezone

from accounts.models import ApiKey, User

from . import windows
from .models import UsageDaily, UsagePeriod, UsageRecord

STATUS_CLASSES = ("2xx", "4xx", "5xx")
REQUEST_LOG_PAGE_SIZE = 50
TOP_N = 10
# Latency percentiles read at most this many of the newest records per model, so the staff
# overview costs the same however busy the last 24 hours were.
LATENCY_SAMPLE_PER_MODEL = 20_000


def budget_windows(*, key: ApiKey, now=None) -> list[dict]:
    """Every budget window of a key and its account (`windows.WINDOWS`), as
    `{name, label, used, reserved, limit, remaining, resets_at}`; `limit` and `remaining` are
    None for a window with no limit. `reserved` counts the worst cases of running requests and
    the unspent tokens of the gateway's budget leases (given back 2 s after a key's last
    request; see `metering.leases`). Used by the dashboard, the keys page and GET /v1/usage."""
    day = windows.utc_day(now or timezone.now())
    owners = {windows.KEY: Q(key=key), windows.ACCOUNT: Q(key__isnull=True, user_id=key.user_id)}
    rows = UsagePeriod.objects.filter(
        reduce(
            or_,
            (
                owners[scope] & Q(period=period.name, start=period.start(day))
                for scope, period in windows.rows()
            ),
        )
    )
    by_row = {windows.row_of(row): row for row in rows}
    result = []
    for window in windows.WINDOWS:
        row = by_row.get(window.row, UsagePeriod())
        used, reserved, limit = window.used(row), window.reserved(row), window.limit_of(key)
        result.append(
            {
                "name": window.name,
                "label": window.label,
                "used": used,
                "reserved": reserved,
                "limit": limit,
                "remaining": None if limit is None else max(limit - used - reserved, 0),
                "resets_at": window.period.next_reset(day),
            }
        )
    return result


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


# ---------------------------------------------------------------------------------------
# Usage


@dataclass(frozen=True)
class UsageDateRange:
    """Whole UTC days `start`..`end` (inclusive), optionally one user, key and model."""

    start: dt.date
    end: dt.date
    user_id: int | None = None
    key_id: int | None = None
    model: str | None = None

    @property
    def days(self) -> list[dt.date]:
        return [self.start + dt.timedelta(days=i) for i in range((self.end - self.start).days + 1)]

    @property
    def start_at(self) -> dt.datetime:
        return dt.datetime.combine(self.start, dt.time.min, tzinfo=dt.UTC)

    @property
    def end_before(self) -> dt.datetime:
        """The first instant after the range."""
        return dt.datetime.combine(self.end + dt.timedelta(days=1), dt.time.min, tzinfo=dt.UTC)


def status_class(status_code: int) -> str:
    """'2xx', '4xx' or '5xx' (1xx/3xx, which the gateway never records, count as 2xx)."""
    return {4: "4xx", 5: "5xx"}.get(status_code // 100, "2xx")


def _daily_rows(date_range: UsageDateRange):
    rows = UsageDaily.objects.filter(day__gte=date_range.start, day__lte=date_range.end)
    if date_range.user_id is not None:
        rows = rows.filter(user_id=date_range.user_id)
    if date_range.key_id is not None:
        rows = rows.filter(key_id=date_range.key_id)
    if date_range.model is not None:
        rows = rows.filter(model=date_range.model)
    return rows


def usage_summary(date_range: UsageDateRange) -> dict:
    """Per-day series, totals and errors by code for the date range, from one roll-up query.

    Returns `{days: [{day, requests, 2xx, 4xx, 5xx, prompt_tokens, completion_tokens,
    total_tokens, latency_ms_avg}], totals: {same keys but day}, errors: [{status_code,
    error_code, requests, share_percent}]}`; every day of the range is present, zeros included."""
    grouped = (
        _daily_rows(date_range)
        .values("day", "status_code", "error_code")
        .annotate(
            n=Sum("requests"),
            prompt=Sum("prompt_tokens"),
            completion=Sum("completion_tokens"),
            latency=Sum("latency_ms_sum"),
        )
        .order_by()
    )
    by_day = {day: _empty_counts() for day in date_range.days}
    totals = _empty_counts()
    errors: dict[tuple[int, str], int] = {}
    for row in grouped:
        for counts in (by_day[row["day"]], totals):
            counts["requests"] += row["n"]
            counts[status_class(row["status_code"])] += row["n"]
            counts["prompt_tokens"] += row["prompt"]
            counts["completion_tokens"] += row["completion"]
            counts["latency_ms_sum"] += row["latency"]
        if row["status_code"] >= 400:
            code = (row["status_code"], row["error_code"])
            errors[code] = errors.get(code, 0) + row["n"]
    days = [{"day": day, **_finish(counts)} for day, counts in by_day.items()]
    return {
        "days": days,
        "totals": _finish(totals),
        "errors": _error_rows(errors, totals["requests"]),
    }


def _empty_counts() -> dict:
    return {
        "requests": 0,
        **dict.fromkeys(STATUS_CLASSES, 0),
        "prompt_tokens": 0,
        "completion_tokens": 0,
        "latency_ms_sum": 0.0,
    }


def _finish(counts: dict) -> dict:
    latency = counts.pop("latency_ms_sum")
    counts["total_tokens"] = counts["prompt_tokens"] + counts["completion_tokens"]
    counts["latency_ms_avg"] = latency / counts["requests"] if counts["requests"] else None
    return counts


def _error_rows(errors: dict[tuple[int, str], int], total_requests: int) -> list[dict]:
    return [
        {
            "status_code": status_code,
            "error_code": error_code,
            "requests": n,
            "share_percent": 100 * n / total_requests,
        }
        for (status_code, error_code), n in sorted(errors.items(), key=lambda item: -item[1])
    ]


def usage_models(*, user_id: int | None = None) -> list[str]:
    """Model names that appear in the roll-up (of one user, or of everyone)."""
    rows = (
        UsageDaily.objects.all() if user_id is None else UsageDaily.objects.filter(user_id=user_id)
    )
    return sorted(m for m in rows.values_list("model", flat=True).distinct().order_by() if m)


# ---------------------------------------------------------------------------------------
# Request log


@dataclass(frozen=True)
class RequestLogFilter:
    user_id: int
    key_id: int | None = None
    model: str | None = None
    status_code: int | None = None
    status_class: str | None = None
    error_code: str | None = None
    start: dt.date | None = None
    end: dt.date | None = None


def request_log_page(
    log_filter: RequestLogFilter,
    *,
    before: tuple[dt.datetime, int] | None = None,
    size: int = REQUEST_LOG_PAGE_SIZE,
) -> tuple[list[UsageRecord], tuple[dt.datetime, int] | None]:
    """One page of the user's requests, newest first, and the cursor of the next page (None on
    the last). Keyset pagination on (created_at, id): `before` is the last row of the
    previous page, so every page is an index range scan on (user, -created_at)."""
    rows = UsageRecord.objects.filter(user_id=log_filter.user_id).select_related("key")
    if log_filter.key_id is not None:
        rows = rows.filter(key_id=log_filter.key_id)
    if log_filter.model is not None:
        rows = rows.filter(model=log_filter.model)
    if log_filter.status_code is not None:
        rows = rows.filter(status_code=log_filter.status_code)
    if log_filter.status_class is not None:
        low = int(log_filter.status_class[0]) * 100
        rows = rows.filter(status_code__gte=low, status_code__lt=low + 100)
    if log_filter.error_code:
        rows = rows.filter(error_code=log_filter.error_code)
    if log_filter.start is not None:
        rows = rows.filter(
            created_at__gte=UsageDateRange(log_filter.start, log_filter.start).start_at
        )
    if log_filter.end is not None:
        rows = rows.filter(created_at__lt=UsageDateRange(log_filter.end, log_filter.end).end_before)
    if before is not None:
        created_at, record_id = before
        rows = rows.filter(created_at__lte=created_at).exclude(
            created_at=created_at, id__gte=record_id
        )
    page = list(
        rows.defer("user_id", "upstream_latency_ms", "workload").order_by("-created_at", "-id")[
            : size + 1
        ]
    )
    if len(page) <= size:
        return page, None
    page = page[:size]
    return page, (page[-1].created_at, page[-1].id)


# ---------------------------------------------------------------------------------------
# Staff overview


def usage_top_users_and_keys(date_range: UsageDateRange, *, limit: int = TOP_N) -> dict:
    """Users and keys with the most tokens in the date range, most first, from one roll-up query:
    `{users: [{user, requests, prompt_tokens, completion_tokens, total_tokens}], keys: [the
    same with key (its .user loaded) instead of user]}`."""
    per_key = list(
        _daily_rows(date_range)
        .values("user_id", "key_id")
        .annotate(
            requests=Sum("requests"),
            prompt_tokens=Sum("prompt_tokens"),
            completion_tokens=Sum("completion_tokens"),
        )
        .order_by()
    )
    per_user: dict[int, dict] = {}
    for row in per_key:
        row["total_tokens"] = row["prompt_tokens"] + row["completion_tokens"]
        totals = per_user.setdefault(
            row["user_id"],
            {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
        )
        for name in totals:
            totals[name] += row[name]
    top_keys = sorted(per_key, key=lambda row: (-row["total_tokens"], row["key_id"]))[:limit]
    top_users = sorted(per_user.items(), key=lambda item: (-item[1]["total_tokens"], item[0]))[
        :limit
    ]
    keys = ApiKey.objects.select_related("user").in_bulk([row["key_id"] for row in top_keys])
    users = User.objects.in_bulk([user_id for user_id, _ in top_users])
    counts = ("requests", "prompt_tokens", "completion_tokens", "total_tokens")
    return {
        "users": [{"user": users[user_id], **totals} for user_id, totals in top_users],
        "keys": [
            {"key": keys[row["key_id"]], **{name: row[name] for name in counts}} for row in top_keys
        ],
    }


def latency_percentiles(*, now: dt.datetime, hours: int = 24) -> list[dict]:
    """p50 and p95 of request latency per model over the last `hours`:
    `{model, requests, p50_ms, p95_ms}`. Each model reads at most `LATENCY_SAMPLE_PER_MODEL`
    of its newest records through the (model, -created_at) index; `requests` says how many
    were used."""
    since = now - dt.timedelta(hours=hours)
    models = sorted(
        m
        for m in UsageDaily.objects.filter(day__gte=since.date())
        .values_list("model", flat=True)
        .distinct()
        .order_by()
        if m
    )
    if not models:
        return []
    if connection.vendor == "postgresql":
        return _latency_percentiles_postgresql(models, since)
    return _latency_percentiles_python(models, since)


def _latency_percentiles_postgresql(models: list[str], since: dt.datetime) -> list[dict]:
    table = UsageRecord._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(
            f"""
            SELECT m.model, count(*),
                   percentile_cont(0.5) WITHIN GROUP (ORDER BY r.latency_ms),
                   percentile_cont(0.95) WITHIN GROUP (ORDER BY r.latency_ms)
            FROM unnest(%s::text[]) AS m(model)
            CROSS JOIN LATERAL (
                SELECT latency_ms FROM {table}
                WHERE model = m.model AND created_at >= %s
                ORDER BY created_at DESC
                LIMIT %s
            ) AS r
            GROUP BY m.model
            ORDER BY m.model
            """,
            [models, since, LATENCY_SAMPLE_PER_MODEL],
        )
        return [
            {"model": model, "requests": n, "p50_ms": p50, "p95_ms": p95}
            for model, n, p50, p95 in cursor.fetchall()
        ]


def _latency_percentiles_python(models: list[str], since: dt.datetime) -> list[dict]:
    """The same figures for SQLite (the zero-configuration dev database), which lacks
    percentile_cont; `statistics.quantiles(method="inclusive")` interpolates the same way."""
    result = []
    for model in models:
        latencies = list(
            UsageRecord.objects.filter(model=model, created_at__gte=since)
            .order_by("-created_at")
            .values_list("latency_ms", flat=True)[:LATENCY_SAMPLE_PER_MODEL]
        )
        if not latencies:
            continue
        if len(latencies) == 1:
            p50 = p95 = latencies[0]
        else:
            cuts = statistics.quantiles(latencies, n=100, method="inclusive")
            p50, p95 = cuts[49], cuts[94]
        result.append({"model": model, "requests": len(latencies), "p50_ms": p50, "p95_ms": p95})
    return result


def usage_record_for_user(*, user_id: int, record_id: int) -> UsageRecord | None:
    """One of the user's own records, or None (another user's record is not theirs to see)."""
    return UsageRecord.objects.select_related("key").filter(pk=record_id, user_id=user_id).first()
