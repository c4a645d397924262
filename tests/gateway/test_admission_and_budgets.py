"""Admission limits and budgets under real concurrency (Redis, PostgreSQL, live gateway)."""

import asyncio
import contextlib
import threading
import time

import httpx
import pytest
import redis
from asgiref.sync import async_to_sync, sync_to_async
from django.conf import settings
from django.db.models import Sum

from accounts.models import ApiKey
from api import admission
from metering import windows
from metering.models import BudgetReservation, UsagePeriod, UsageRecord

from .conftest import ASYNC_SETTLED_HOOKS

pytestmark = pytest.mark.django_db(transaction=True)

BODY = {"model": "stub-model", "prompt": "hello", "max_tokens": 1}


@contextlib.asynccontextmanager
async def posting(gateway_url, secret, count, body=BODY):
    """`count` concurrent completion requests, as tasks that end with their responses; those
    still running when the block ends are cancelled (the block failed)."""
    headers = {"Authorization": f"Bearer {secret}"}
    limits = httpx.Limits(max_connections=count + 10)
    async with httpx.AsyncClient(
        base_url=gateway_url,
        headers=headers,
        timeout=60,
        limits=limits,
        event_hooks=ASYNC_SETTLED_HOOKS,
    ) as http:
        requests = [
            asyncio.ensure_future(http.post("/v1/completions", json=body)) for _ in range(count)
        ]
        try:
            yield requests
        finally:
            for request in requests:
                request.cancel()
            await asyncio.gather(*requests, return_exceptions=True)


async def fire(gateway_url, secret, count, body=BODY):
    async with posting(gateway_url, secret, count, body) as requests:
        return await asyncio.gather(*requests)


async def until(condition, what: str, timeout: float = 30.0) -> None:
    """Wait until the coroutine function `condition` returns true."""
    deadline = time.monotonic() + timeout
    while not await condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


async def test_sixteen_run_sixty_four_wait_and_the_rest_get_queue_full(
    gateway_url, api_secret, api_key, stub, model
):
    gate = threading.Event()
    stub.mode["gate"] = gate
    async with posting(gateway_url, api_secret, 16 + 64 + 6) as requests:

        async def every_request_admitted_queued_or_refused():
            answered = sum(request.done() for request in requests)
            counts = await admission.admission_counts(api_key.pk)
            running = stub.in_flight >= 16 and counts == {"running": 16, "waiting": 64}
            return running and answered == 6

        await until(
            every_request_admitted_queued_or_refused,
            "16 running, 64 waiting and 6 answered were never seen together",
        )
        # None can arrive any more: the gate holds every slot.
        assert stub.in_flight == 16
        gate.set()
        responses = await asyncio.gather(*requests)
    statuses = [r.status_code for r in responses]
    assert statuses.count(200) == 80
    refused = [r for r in responses if r.status_code == 429]
    assert len(refused) == 6
    for response in refused:
        assert response.json()["error"]["code"] == "queue_full"
        assert int(response.headers["Retry-After"]) >= 1
    assert stub.max_in_flight == 16
    assert await admission.admission_counts(api_key.pk) == {"running": 0, "waiting": 0}


async def test_limits_are_per_key(gateway_url, api_secret, api_key, stub, model, limits):
    from accounts.services.keys import api_key_create

    limits(MAX_RUNNING=1, MAX_WAITING=0)
    gate = threading.Event()
    stub.mode["gate"] = gate
    _, other_secret = await sync_to_async(api_key_create)(
        user=await sync_to_async(lambda: api_key.user)(), name="second", acting_user=None
    )
    async with (
        posting(gateway_url, api_secret, 2) as my_requests,
        posting(gateway_url, other_secret, 1) as their_requests,
    ):

        async def one_of_mine_refused_while_theirs_runs():
            # Theirs runs (not refused by my slot) beside my first; my second is refused.
            return stub.in_flight == 2 and sum(request.done() for request in my_requests) == 1

        await until(
            one_of_mine_refused_while_theirs_runs, "each key's first never ran side by side"
        )
        gate.set()
        mine, theirs = await asyncio.gather(*my_requests), await asyncio.gather(*their_requests)
    assert sorted(r.status_code for r in mine) == [200, 429]
    assert theirs[0].status_code == 200


async def test_an_accounts_keys_share_its_running_and_waiting_slots(
    gateway_url, api_secret, api_key, stub, model, limits, other_user
):
    """A second key brings no fresh share: with room for one request per account, the
    account's second key is refused while its first runs; another account still runs."""
    from accounts.services.keys import api_key_create

    limits(ACCOUNT_MAX_RUNNING=1, ACCOUNT_MAX_WAITING=0)
    gate = threading.Event()
    stub.mode["gate"] = gate
    owner = await sync_to_async(lambda: api_key.user)()
    _, second_secret = await sync_to_async(api_key_create)(
        user=owner, name="second", acting_user=None
    )
    _, stranger_secret = await sync_to_async(api_key_create)(
        user=other_user, name="theirs", acting_user=None
    )
    async with posting(gateway_url, api_secret, 1) as first:

        async def first_running():
            return stub.in_flight == 1

        await until(first_running, "the first key's request never ran")
        async with posting(gateway_url, stranger_secret, 1) as stranger:

            async def stranger_running():
                return stub.in_flight == 2

            await until(stranger_running, "another account's request never ran beside it")
            [refused] = await fire(gateway_url, second_secret, 1)
            gate.set()
            answered = await asyncio.gather(*first, *stranger)
    assert [r.status_code for r in answered] == [200, 200]
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "queue_full"
    assert refused.json()["error"]["message"].startswith("This account already has 1 requests")
    counts = await admission.admission_counts(user_id=owner.pk)
    assert counts == {"running": 0, "waiting": 0}


async def test_an_accounts_keys_share_its_starts_per_minute(
    gateway_url, api_secret, api_key, stub, model, limits
):
    from accounts.services.keys import api_key_create

    limits(ACCOUNT_STARTS_PER_MINUTE=3)
    owner = await sync_to_async(lambda: api_key.user)()
    _, second_secret = await sync_to_async(api_key_create)(
        user=owner, name="second", acting_user=None
    )
    statuses = []
    for secret in (api_secret, second_secret, api_secret, second_secret):
        [response] = await fire(gateway_url, secret, 1)
        statuses.append(response.status_code)
    assert statuses == [200, 200, 200, 429]
    assert response.json()["error"]["code"] == "rate_limited"
    assert response.json()["error"]["message"] == (
        "This account started 3 requests in the last minute."
    )


async def test_starts_per_minute_are_rate_limited(gateway_url, api_secret, stub, model, limits):
    limits(STARTS_PER_MINUTE=5)
    responses = []
    async with httpx.AsyncClient(
        base_url=gateway_url,
        headers={"Authorization": f"Bearer {api_secret}"},
        event_hooks=ASYNC_SETTLED_HOOKS,
    ) as http:
        for _ in range(6):
            responses.append(await http.post("/v1/completions", json=BODY))
    assert [r.status_code for r in responses] == [200] * 5 + [429]
    error = responses[-1]
    assert error.json()["error"]["code"] == "rate_limited"
    assert 1 <= int(error.headers["Retry-After"]) <= 60
    assert "X-Should-Retry" not in error.headers


def test_slots_of_a_dead_replica_expire(client, api_key, stub):
    """A crashed holder's leases run out: stale running members do not block the key."""
    r = redis.Redis.from_url(settings.REDIS_URL)
    running_key = admission._keys(api_key.pk)[0]
    expired = int(time.time() * 1000) - 1
    r.zadd(running_key, {f"dead-{i}": expired for i in range(16)})
    assert client.post("/v1/completions", json=BODY).status_code == 200
    assert r.zcard(running_key) == 0


def test_waiter_is_woken_when_a_slot_frees(api_key, redis_client, limits, monkeypatch):
    limits(MAX_RUNNING=1, MAX_WAITING=1)

    scripts_of = admission._scripts

    async def scenario():
        order, released = [], []
        holder_in, waiter_parked = asyncio.Event(), asyncio.Event()

        class WaiterWatched:
            """A client's admission scripts, telling when a waiter was told to wait on."""

            def __init__(self, scripts):
                self.scripts = scripts

            def __getattr__(self, name):
                return getattr(self.scripts, name)

            async def promote(self, **kwargs):
                promoted = await self.scripts.promote(**kwargs)
                if not promoted:
                    waiter_parked.set()
                return promoted

        monkeypatch.setattr(admission, "_scripts", lambda client: WaiterWatched(scripts_of(client)))

        async def holder():
            async with admission.admission_slot(api_key.pk, api_key.user_id):
                order.append("holder in")
                holder_in.set()
                # Released once the waiter waits for the release's message.
                await waiter_parked.wait()
                # Not after the block: the waiter may be in before the release's reply is.
                order.append("holder done")
                released.append(time.monotonic())

        async def waiter():
            await holder_in.wait()
            async with admission.admission_slot(api_key.pk, api_key.user_id):
                order.append("waiter in")
                return time.monotonic()

        _, waiter_in = await asyncio.gather(holder(), waiter())
        return order, waiter_in - released[0]

    order, waited = async_to_sync(scenario)()
    assert order == ["holder in", "holder done", "waiter in"]
    # Woken by pub/sub, not by the 1 s safety poll.
    assert waited < 0.5


async def test_concurrent_requests_never_overspend_and_usage_matches_settlements(
    async_db_connections_closed, gateway_url, api_secret, api_key, stub, model
):
    await sync_to_async(ApiKey.objects.filter(pk=api_key.pk).update)(daily_token_budget=100)
    body = {"model": "stub-model", "prompt": "hello", "max_tokens": 10}
    responses = await fire(gateway_url, api_secret, 30, body)

    def check():
        codes = {r.status_code for r in responses}
        assert codes <= {200, 429}
        assert all(
            r.json()["error"]["code"] == "budget_exceeded"
            for r in responses
            if r.status_code == 429
        )
        day = UsagePeriod.objects.get(key=api_key, period=windows.DAY.name)
        assert day.used_tokens <= 100
        assert day.reserved_tokens == 0
        settled = BudgetReservation.objects.aggregate(
            p=Sum("settled_prompt_tokens"), c=Sum("settled_completion_tokens")
        )
        assert day.used_tokens == settled["p"] + settled["c"]
        recorded = UsageRecord.objects.filter(status_code=200).aggregate(
            p=Sum("prompt_tokens"), c=Sum("completion_tokens")
        )
        assert day.used_tokens == recorded["p"] + recorded["c"]
        delivered = sum(
            r.json()["usage"]["total_tokens"] for r in responses if r.status_code == 200
        )
        assert delivered == day.used_tokens
        assert UsageRecord.objects.count() == 30
        assert sum(r.status_code == 200 for r in responses) >= 9

    await sync_to_async(check)()
