"""Budget leases and batched metering (metering.leases) on the live gateway, real PostgreSQL."""

import asyncio
import datetime as dt
import time

import httpx
import pytest
from asgiref.sync import sync_to_async
from django.db.models import Sum
from django.utils import timezone

from accounts.services import keys, service
from api import admission
from infra import background
from metering import budgets, gateway, leases, limits, sql, windows
from metering.models import BudgetLease, BudgetReservation, UsageRecord

from .conftest import key_day_window, wait_settled
from .test_admission_and_budgets import fire

pytestmark = pytest.mark.django_db(transaction=True)

BODY = {"model": "stub-model", "prompt": "hello", "max_tokens": 4}


@pytest.fixture
def lasting_leases(monkeypatch):
    """Leases outlive their requests (as in production) until `give_back` is called."""
    monkeypatch.setattr(leases, "LEASE_IDLE_S", 600)

    def give_back():
        monkeypatch.setattr(leases, "LEASE_IDLE_S", 0)
        on_each_loop(idle_timer_fired)
        wait_settled()

    return give_back


def on_each_loop(make_coroutine) -> None:
    """Run `make_coroutine(leases)` on the server loop of each loop's leases, and wait for it."""
    for loop, book in list(leases._by_loop.items()):
        asyncio.run_coroutine_threadsafe(make_coroutine(book), loop).result(timeout=10)


async def idle_timer_fired(book) -> None:
    """What the lease writer's idle timer does, on the server loop, awaited."""
    background.on_server_loop.set(True)
    book._timer_fired()
    while book.writer is not None:
        await asyncio.shield(book.writer)


def test_requests_of_a_key_share_one_lease_and_settle_exactly(
    client, stub, api_key, lasting_leases
):
    responses = [client.post("/v1/completions", json=BODY) for _ in range(5)]
    assert [r.status_code for r in responses] == [200] * 5
    assert not BudgetReservation.objects.exists()
    lease = BudgetLease.objects.get()
    assert (lease.requests, lease.spent_prompt_tokens, lease.spent_completion_tokens) == (5, 5, 20)
    window = key_day_window(api_key)
    assert (window.requests, window.used_input, window.used_output) == (5, 5, 20)
    # The lease's unspent tokens stay reserved while the process keeps it...
    assert window.reserved_tokens == lease.held_tokens > 0
    lasting_leases()
    # ...and nothing is left held once it is given back.
    window = key_day_window(api_key)
    assert (window.used_tokens, window.reserved_tokens) == (25, 0)
    lease.refresh_from_db()
    assert lease.held_tokens == 0 and lease.returned_at is not None
    assert UsageRecord.objects.aggregate(total=Sum("completion_tokens"))["total"] == 20


def test_usage_records_are_written_in_batches(client, stub, api_key, monkeypatch):
    writes = []
    run_steps_async = leases.run_steps_async

    async def counted(make_steps):
        writes.append(make_steps)
        return await run_steps_async(make_steps)

    monkeypatch.setattr(leases, "run_steps_async", counted)
    monkeypatch.setattr(leases, "FLUSH_DELAY_S", 2.0)
    with httpx.Client(
        base_url=client.base_url, headers=client.headers, timeout=30
    ) as without_waiting:
        for _ in range(4):
            assert without_waiting.post("/v1/completions", json=BODY).status_code == 200
    wait_settled()
    assert UsageRecord.objects.count() == 4
    # One lease grant, one batch of four records and spends, one give-back.
    assert len(writes) == 3
    assert key_day_window(api_key).used_tokens == 20


def test_lowering_a_budget_retires_the_lease_at_once(client, stub, api_key, lasting_leases):
    assert client.post("/v1/completions", json=BODY).status_code == 200
    limits.api_key_budget_set(key=api_key, acting_user=None, budgets={"daily_token_budget": 10})
    response = client.post("/v1/completions", json={**BODY, "max_tokens": 8})
    # Held exactly against what is left (10 - 5 used - the old lease given back).
    assert response.status_code == 200
    assert response.headers["X-Acs-Max-Tokens-Clamped"] == "requested=8,applied=4,reason=budget"
    lasting_leases()
    window = key_day_window(api_key)
    assert (window.used_tokens, window.reserved_tokens) == (10, 0)


def test_pausing_the_service_applies_to_the_next_leased_request(
    client, stub, api_key, staff_user, lasting_leases
):
    assert client.post("/v1/completions", json=BODY).status_code == 200
    service.service_spend_cap_set(paused=True, acting_user=staff_user, reason="over budget")
    response = client.post("/v1/completions", json=BODY)
    assert response.status_code == 429
    assert response.json()["error"]["code"] == "spend_cap"
    lasting_leases()
    assert key_day_window(api_key).reserved_tokens == 0


async def test_leased_and_exact_requests_together_never_overspend(
    async_db_connections_closed, gateway_url, api_secret, api_key, stub, model, monkeypatch
):
    # 1,000 tokens: leases while far from the limit, then each request reserved exactly.
    await sync_to_async(limits.api_key_budget_set)(
        key=api_key, acting_user=None, budgets={"daily_token_budget": 1000}
    )
    monkeypatch.setattr(admission, "MAX_WAITING", 200)
    body = {"model": "stub-model", "prompt": "hello", "max_tokens": 10}
    responses = await fire(gateway_url, api_secret, 120, body)

    def check():
        codes = {r.status_code for r in responses}
        assert codes == {200, 429}
        refused = [r.json()["error"]["code"] for r in responses if r.status_code == 429]
        assert set(refused) == {"budget_exceeded"}
        assert BudgetLease.objects.exists() and BudgetReservation.objects.exists()
        window = key_day_window(api_key)
        assert window.used_tokens <= 1000
        assert window.reserved_tokens == 0
        delivered = sum(
            r.json()["usage"]["total_tokens"] for r in responses if r.status_code == 200
        )
        recorded = UsageRecord.objects.aggregate(p=Sum("prompt_tokens"), c=Sum("completion_tokens"))
        assert delivered == window.used_tokens == recorded["p"] + recorded["c"]
        assert UsageRecord.objects.count() == 120
        assert not BudgetLease.objects.filter(returned_at=None).exists()

    await sync_to_async(check)()


def test_the_sweep_frees_the_lease_of_a_dead_process_and_late_spends_still_count(api_key):
    now = timezone.now()
    lease = BudgetLease(
        key=api_key,
        user=api_key.user,
        month_start=windows.MONTH.start(windows.utc_day(now)),
        day_start=windows.utc_day(now),
    )
    granted = sql.run_steps(
        lambda: budgets.budget_lease_steps(
            key=api_key, lease=lease, retiring=None, give_back=0, worst_case=10, now=now
        )
    )
    assert granted > 0 and key_day_window(api_key).reserved_tokens == granted
    assert budgets.budget_release_stale(older_than=dt.timedelta(minutes=30)) == 0
    BudgetLease.objects.filter(pk=lease.pk).update(alive_at=now - dt.timedelta(hours=1))
    assert budgets.budget_release_stale(older_than=dt.timedelta(minutes=30)) == 1
    assert key_day_window(api_key).reserved_tokens == 0
    assert BudgetLease.objects.get().returned_at is not None
    assert budgets.budget_release_stale(older_than=dt.timedelta(minutes=30)) == 0
    # Its process was only frozen: what it spent still counts, and nothing goes negative.
    spend = {"lease": lease, "prompt_tokens": 3, "completion_tokens": 4, "requests": 1}
    sql.run_steps(lambda: budgets.budget_lease_spend_steps(spends=[spend]))
    window = key_day_window(api_key)
    assert (window.used_tokens, window.reserved_tokens, window.requests) == (7, 0, 1)
    assert BudgetLease.objects.get().held_tokens == 0


@pytest.mark.parametrize("exact", [True, False], ids=["reservation", "lease"])
def test_a_long_live_stream_keeps_its_hold_through_the_sweep(
    client, stub, api_key, request, settings, exact
):
    """The stream's heartbeat follows ACS_STALE_RESERVATION_SECONDS (here 1.5 s, far below
    what a deployment may set, so the test runs in seconds): the sweep never frees a live
    stream's hold, whatever the setting."""
    if exact:
        request.getfixturevalue("exact_budgets")
    settings.ACS_STALE_RESERVATION_SECONDS = 1.5
    stub.mode["gap"] = 0.1
    body = {**BODY, "max_tokens": 60, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as response:
        started, lines = time.monotonic(), response.iter_lines()
        for _ in lines:
            if time.monotonic() - started > 3:
                break
        # The hold was made 3 s ago, twice the sweep's age here, and the stream still runs.
        assert budgets.budget_release_stale(older_than=dt.timedelta(seconds=1.5)) == 0
        assert key_day_window(api_key).reserved_tokens > 0
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    wait_settled()
    window = key_day_window(api_key)
    assert (window.used_tokens, window.reserved_tokens) == (61, 0)


def test_a_record_that_cannot_be_written_does_not_lose_the_others(
    gateway_url, stub, model, api_key_pair, approved_user, monkeypatch
):
    key, secret = api_key_pair
    doomed, doomed_secret = keys.api_key_create(user=approved_user, name="doomed", acting_user=None)
    monkeypatch.setattr(leases, "FLUSH_DELAY_S", 1.0)
    for token in (secret, secret, doomed_secret):
        response = httpx.post(
            f"{gateway_url}/v1/completions",
            json=BODY,
            headers={"Authorization": f"Bearer {token}"},
            timeout=30,
        )
        assert response.status_code == 200
    # Deleted before the batch is written: its record can never be inserted.
    doomed.delete()
    wait_settled()
    assert list(UsageRecord.objects.values_list("key_id", flat=True)) == [key.pk, key.pk]
    window = key_day_window(key)
    assert (window.used_tokens, window.reserved_tokens) == (10, 0)


def steps_name(make_steps) -> str:
    """The name of the step generator `make_steps` makes (a driver may call it again)."""
    steps = make_steps()
    steps.close()
    return steps.gi_code.co_name


@pytest.mark.parametrize("committed", [False, True], ids=["lost-before", "lost-after-commit"])
def test_a_stream_whose_batch_fails_once_ends_with_done_and_is_metered_once(
    client, stub, api_key, monkeypatch, committed
):
    """The connection breaks while writing a batch: before the transaction reached the
    database, or after its COMMIT did (the outcome is unknown to the gateway)."""
    from django.db import OperationalError

    real, failures = leases.run_steps_async, []

    async def breaking_first_batch(make_steps):
        if steps_name(make_steps) == "_batch_steps" and not failures:
            failures.append(make_steps)
            if committed:
                await real(make_steps)
            raise OperationalError("connection lost")
        return await real(make_steps)

    monkeypatch.setattr(leases, "run_steps_async", breaking_first_batch)
    body = {**BODY, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as response:
        lines = [line for line in response.iter_lines() if line]
    wait_settled()
    # The [DONE] waited for the retried batch; the request was not metered a second time.
    assert failures and lines[-1] == "data: [DONE]"
    assert UsageRecord.objects.get().completion_tokens == 4
    window = key_day_window(api_key)
    assert (window.requests, window.used_tokens, window.reserved_tokens) == (1, 5, 0)


def test_shutdown_writes_what_is_queued_and_gives_every_lease_back(
    client, stub, api_key, monkeypatch
):
    monkeypatch.setattr(leases, "LEASE_IDLE_S", 600)
    monkeypatch.setattr(leases, "FLUSH_DELAY_S", 600)
    with httpx.Client(base_url=client.base_url, headers=client.headers, timeout=30) as plain:
        assert plain.post("/v1/completions", json=BODY).status_code == 200
    assert not UsageRecord.objects.exists()
    on_each_loop(lambda book: book.drain())
    assert UsageRecord.objects.count() == 1
    window = key_day_window(api_key)
    assert (window.used_tokens, window.reserved_tokens) == (5, 0)
    assert BudgetLease.objects.get().returned_at is not None


@pytest.mark.parametrize("committed", [False, True], ids=["lost-before", "lost-after-commit"])
def test_a_settlement_the_database_dropped_is_retried_and_metered_once(
    client, stub, api_key, exact_budgets, monkeypatch, committed
):
    """The connection breaks while settling a reservation: before the transaction reached
    the database, or after its COMMIT did (the outcome is unknown to the gateway)."""
    real, broken = gateway.run_steps_async, []
    monkeypatch.setattr(gateway, "SETTLE_RETRY_S", (0.05,))

    async def breaking_first_settlement(make_steps):
        if steps_name(make_steps) == "_settle_and_record_steps" and not broken:
            broken.append(make_steps)
            if committed:
                await real(make_steps)
            raise sql.DatabaseBusy("The connection was lost.")
        return await real(make_steps)

    monkeypatch.setattr(gateway, "run_steps_async", breaking_first_settlement)
    assert client.post("/v1/completions", json=BODY).status_code == 200
    wait_settled()
    assert broken
    assert UsageRecord.objects.get().completion_tokens == 4
    assert BudgetReservation.objects.get().status == "settled"
    window = key_day_window(api_key)
    assert (window.requests, window.used_tokens, window.reserved_tokens) == (1, 5, 0)
