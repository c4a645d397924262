"""A batch of usage records (as the gateway's lease writer sends them) in one statement each for
the records and the daily roll-up: every field as given, each record with its own id."""

import datetime as dt

import pytest

from metering.models import UsageDaily, UsageRecord
from metering.sql import run_steps
from metering.usage import usage_records_steps

AT = dt.datetime(2026, 12, 4, 3, 45, 12, 345678, tzinfo=dt.UTC)


def unsaved(api_key, index: int, **fields) -> UsageRecord:
    values = {
        "created_at": AT + dt.timedelta(microseconds=index),
        "key_id": api_key.pk,
        "user_id": api_key.user_id,
        "request_id": f"batch-{index}",
        "endpoint": "completions",
        "status_code": 200,
        "latency_ms": 1.25 + index,
        "model": "smollm2-135m",
        "prompt_tokens": index,
        "completion_tokens": 2 * index,
        **fields,
    }
    return UsageRecord(**values)


@pytest.mark.django_db
def test_a_batch_writes_every_record_as_given_with_its_own_id(api_key):
    records = [unsaved(api_key, index) for index in range(40)]
    records[3] = unsaved(
        api_key,
        3,
        activation_layers=[0, 7, 29],
        upstream_latency_ms=0.1 + 0.2,
        ttft_ms=None,
        stream=True,
        status_code=499,
        error_code="client_disconnected",
        workload="élan 'quoted'",
    )
    run_steps(lambda: usage_records_steps(records=records))

    fields = [field.attname for field in UsageRecord._meta.concrete_fields]
    for record in records:
        stored = UsageRecord.objects.get(pk=record.pk)
        assert stored.request_id == record.request_id
        assert [getattr(stored, name) for name in fields] == [
            getattr(record, name) for name in fields
        ]
    assert UsageRecord.objects.get(request_id="batch-0").activation_layers is None


@pytest.mark.django_db
def test_a_batch_adds_to_the_daily_roll_up(api_key):
    run_steps(lambda: usage_records_steps(records=[unsaved(api_key, i) for i in range(3)]))
    run_steps(lambda: usage_records_steps(records=[unsaved(api_key, i) for i in range(3, 5)]))
    daily = UsageDaily.objects.get(key_id=api_key.pk, status_code=200)
    assert daily.day == AT.date()
    assert (daily.requests, daily.prompt_tokens, daily.completion_tokens) == (5, 10, 20)
    assert daily.latency_ms_sum == pytest.approx(sum(1.25 + i for i in range(5)))
