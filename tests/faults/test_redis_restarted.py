"""Redis (admission, access generation, Celery broker, playground streams) is SIGKILLed and
started again, empty, while a stream is running."""

import json
import threading
import time
import uuid

import httpx
import redis

from accounts.services.keys import api_key_revoke
from api.auth import GENERATION_KEY, access_generation_bump
from metering.models import UsageRecord
from playground.models import Run
from playground.runs.services import run_create
from tests.playground.conftest import replay

from .conftest import STUB_MODEL, wait_for

RECOVERY_BOUND_S = 5.0


def _count_tokens(frame: dict) -> int:
    """Tokens in a stream frame, counted as the gateway meters them."""
    count = 0
    for choice in frame.get("choices") or ():
        tokens = (choice.get("logprobs") or {}).get("tokens")
        count += len(tokens) if tokens else (1 if choice.get("text") else 0)
    return count


def _restart_redis(system) -> float:
    system.redis.kill()
    system.redis.start()
    system.redis.wait_ready()
    return time.monotonic()


def test_redis_restart_keeps_holds_and_admission_and_playground_recover(
    system, account, fault_table, playground_sends_to_system
):
    http = httpx.Client(
        base_url=system.web_url,
        headers={"Authorization": f"Bearer {account.secret}"},
        timeout=60,
    )
    # The playground worked before the restart (the worker holds Redis connections).
    _playground_run_succeeds(account)
    system.stub.mode["gap"] = 0.1
    seen = {"tokens": 0, "done": False, "error": None, "request_id": uuid.uuid4().hex}
    restarted = threading.Event()
    back_at = []

    def stream():
        body = {"model": STUB_MODEL, "prompt": "hello", "max_tokens": 40, "stream": True}
        with http.stream(
            "POST", "/v1/completions", json=body, headers={"X-Request-Id": seen["request_id"]}
        ) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    seen["done"] = True
                    continue
                frame = json.loads(line[len("data: ") :])
                if "error" in frame:
                    seen["error"] = frame["error"]
                    continue
                seen["tokens"] += _count_tokens(frame)
                if seen["tokens"] == 5:
                    back_at.append(_restart_redis(system))
                    restarted.set()

    streamer = threading.Thread(target=stream)
    streamer.start()
    assert restarted.wait(60), "the stream never reached its fifth token"

    # Admission (and the key check) recover: the first request after the restart is served.
    plain = {"model": STUB_MODEL, "prompt": "hello", "max_tokens": 1}
    first_codes = []

    def admitted():
        response = http.post("/v1/completions", json=plain)
        if response.status_code != 200:
            first_codes.append(response.json()["error"]["code"])
            time.sleep(0.1)
        return response.status_code == 200

    wait_for(admitted, timeout=30, what="a request to be admitted again")
    admitted_after = time.monotonic() - back_at[0]

    # The playground recovers: a run sent through the broker succeeds.
    _playground_run_succeeds(account)
    playground_after = time.monotonic() - back_at[0]

    # The stream that ran across the restart finished, and its hold was settled: it is
    # metered exactly once, and nothing stays reserved.
    streamer.join(60)
    system.stub.mode.pop("gap")
    assert seen["done"] and seen["error"] is None, seen
    record = wait_for(
        lambda: UsageRecord.objects.filter(request_id=seen["request_id"]).first(),
        timeout=15,
        what="the stream's usage record",
    )
    assert UsageRecord.objects.filter(request_id=seen["request_id"]).count() == 1
    assert record.completion_tokens == seen["tokens"] == 40
    wait_for(
        lambda: account.reserved_tokens() == 0,
        timeout=20,
        what="every hold to be settled or given back",
    )
    stream_tokens = record.prompt_tokens + record.completion_tokens
    assert account.used_tokens() == sum(
        r.prompt_tokens + r.completion_tokens for r in UsageRecord.objects.filter(key=account.key)
    )
    # No request failed for the restart: a pooled connection Redis closed is replaced.
    assert first_codes == []
    assert admitted_after <= RECOVERY_BOUND_S, admitted_after
    assert playground_after <= RECOVERY_BOUND_S, playground_after
    fault_table.add(
        fault="Redis SIGKILLed and restarted empty mid-stream",
        client_saw=f"the stream ran on to [DONE] ({seen['tokens']} tokens); next request"
        " 200; playground run succeeded",
        metered=f"{stream_tokens} for the stream (1 record); 0 left reserved",
        produced=f"{stream_tokens} ({record.prompt_tokens} prompt + {seen['tokens']} received)",
        recovery=f"admission {admitted_after:.1f} s, playground run done"
        f" {playground_after:.1f} s after Redis was back",
    )
    http.close()


def _playground_run_succeeds(account) -> None:
    """Send a playground run through the system's broker; its worker calls the gateway and
    publishes the run's events to Redis."""
    run = run_create(
        user=account.user, request={"model": STUB_MODEL, "prompt": "hello", "max_tokens": 2}
    )
    finished = wait_for(
        lambda: Run.objects.filter(pk=run.pk, finished_at__isnull=False).first(),
        timeout=60,
        what="the playground run to finish",
    )
    assert finished.status == "succeeded", (finished.error_code, finished.error_message)
    assert replay(run.pk)[-1]["type"] == "end"


def test_key_revoked_after_a_redis_restart_is_refused(system, account, fault_table):
    """The access generation starts again from nothing after a restart; a revocation must
    still retire every cached copy of the key, whatever generation it was cached under."""
    http = httpx.Client(
        base_url=system.web_url,
        headers={"Authorization": f"Bearer {account.secret}"},
        timeout=60,
    )
    plain = {"model": STUB_MODEL, "prompt": "hello", "max_tokens": 1}
    assert http.post("/v1/completions", json=plain).status_code == 200  # cached now
    cached_under = system_redis_generation(system)
    _restart_redis(system)
    api_key_revoke(key=account.key, acting_user=None)
    # More access changes follow (each bumps the generation), as many as there were before
    # the restart: a counter would now read what the cached copy was read under.
    for _ in range(100):
        if system_redis_generation(system) == cached_under:
            break
        access_generation_bump()
    response = http.post("/v1/completions", json=plain)
    assert response.status_code == 401, response.text
    assert response.json()["error"]["code"] == "key_revoked"
    fault_table.add(
        fault="Redis restarted, then a key revoked",
        client_saw="401 `key_revoked` on the next request",
        metered="—",
        produced="—",
        recovery="immediate",
    )
    http.close()


def system_redis_generation(system):
    client = redis.Redis.from_url(system.redis.url)
    try:
        return client.get(GENERATION_KEY)
    finally:
        client.close()


REDIS_DOWN_RECOVERY_BOUND_S = 1.0


def test_redis_down_answers_503_with_retry_after_and_recovers_within_a_second(
    system, account, fault_table
):
    http = httpx.Client(
        base_url=system.web_url,
        headers={"Authorization": f"Bearer {account.secret}"},
        timeout=60,
    )
    plain = {"model": STUB_MODEL, "prompt": "hello", "max_tokens": 2}
    before = http.post("/v1/completions", json=plain)  # the key is cached now
    assert before.status_code == 200, before.text
    system.redis.kill()
    try:
        refusals = [
            http.post("/v1/completions", json=plain),
            http.post("/v1/completions", json={**plain, "stream": True}),
            http.get("/v1/models"),
            http.post(
                "/v1/completion-jobs", json=plain, headers={"Idempotency-Key": uuid.uuid4().hex}
            ),
            http.post("/v1/harvest", json={"model": STUB_MODEL, "prompts": ["hello"]}),
        ]
    finally:
        system.redis.start()
    for response in refusals:
        assert response.status_code == 503, (response.request.url, response.text)
        assert response.json()["error"]["code"] == "redis_unavailable", response.text
        assert response.headers["Retry-After"] == "1"
    system.redis.wait_ready()
    back_at = time.monotonic()
    codes = []

    def served():
        response = http.post("/v1/completions", json=plain)
        codes.append(response.status_code)
        return response if response.status_code == 200 else time.sleep(0.02)

    first = wait_for(served, timeout=30, what="a request served after Redis came back")
    recovered_after = time.monotonic() - back_at
    assert recovered_after <= REDIS_DOWN_RECOVERY_BOUND_S, (recovered_after, codes)
    # Nothing was metered for the refusals: the only records are the two served requests.
    records = wait_for(
        lambda: (
            (rows := list(UsageRecord.objects.filter(key=account.key))) and len(rows) >= 2 and rows
        ),
        timeout=15,
        what="the usage records of the served requests",
    )
    assert len(records) == 2, [(r.status_code, r.error_code) for r in records]
    wait_for(lambda: account.reserved_tokens() == 0, timeout=20, what="every hold settled")
    metered = account.used_tokens()
    produced = sum(r.json()["usage"]["total_tokens"] for r in (before, first))
    assert metered == produced
    fault_table.add(
        fault="Redis SIGKILLed and left down, then started again",
        client_saw=f"{len(refusals)}× 503 `redis_unavailable` with `Retry-After: 1`"
        " (completion, stream, models, completion job, harvest); then 200",
        metered=f"0 for the refusals; {metered} for the 2 served requests (2 records)",
        produced=f"{produced} in the 200 bodies",
        recovery=f"{recovered_after:.2f} s after Redis was back ({len(codes)} tries at 20 ms)",
    )
    http.close()
