"""Usage records and their daily roll-up (`UsageDaily`), written in one round trip."""

import orjson
from django.db import connection
from django.utils import timezone

from accounts.models import ApiKey

from .models import UsageDaily, UsageRecord
from .sql import NO_FLUSH_WAIT, run_steps
from .windows import utc_day

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
    values = []
    days: dict[tuple, list] = {}
    for record in records:
        values.append([getattr(record, column) for column in _RECORD_COLUMNS])
        group = (
            utc_day(record.created_at),
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
    rows = yield [NO_FLUSH_WAIT, daily, insert]
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
    """One INSERT of `rows` (Python values, in the order of `columns`) into `model`'s table,
    then `suffix`. On PostgreSQL the rows travel as one JSON document, read back with
    json_to_recordset: the statement's text is the same for any number of rows, so psycopg
    reuses its parsed form, and orjson encodes a row in ~1.6 µs where psycopg's quoting of
    one array per column took ~18 µs (the gateway writes every request's record this way)."""
    table, names = model._meta.db_table, ", ".join(columns)
    fields = [model._meta.get_field(column) for column in columns]
    if connection.vendor == "postgresql":
        spec = ", ".join(
            f"{column} {field.db_type(connection)}"
            for column, field in zip(columns, fields, strict=True)
        )
        sql = (
            f"INSERT INTO {table} ({names}) SELECT {names}"
            f" FROM json_to_recordset(%s::json) AS batch({spec}){suffix}"
        )
        document = orjson.dumps([dict(zip(columns, row, strict=True)) for row in rows])
        return sql, [document.decode()]
    marks = f"({', '.join(['%s'] * len(columns))})"
    sql = f"INSERT INTO {table} ({names}) VALUES {', '.join([marks] * len(rows))}{suffix}"
    return sql, [
        field.get_db_prep_value(value, connection, prepared=False)
        for row in rows
        for field, value in zip(fields, row, strict=True)
    ]
