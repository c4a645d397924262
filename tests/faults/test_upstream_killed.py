"""The engine is SIGKILLed while it streams a completion."""

import json
import time
import uuid

import httpx
import redis as redis_lib
from django.conf import settings

from api import upstream
from metering.models import UsageRecord

from .conftest import ENGINE_MODEL, wait_for


def _stream_until_killed(http, body, *, kill_after_tokens: int, kill) -> dict:
    """Stream `body`, call `kill()` once `kill_after_tokens` tokens arrived; returns what the
    client saw: tokens (counted from the logprobs of the frames), the error frame, [DONE]."""
    seen = {"tokens": 0, "error": None, "done": False, "request_id": ""}
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, response.read()
        seen["request_id"] = response.headers["x-request-id"]
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                seen["done"] = True
                continue
            frame = json.loads(data)
            if "error" in frame:
                seen["error"] = frame["error"]
                continue
            for choice in frame["choices"]:
                seen["tokens"] += len((choice.get("logprobs") or {}).get("tokens") or [])
            if seen["tokens"] >= kill_after_tokens and kill is not None:
                kill()
                kill = None
    return seen


def test_engine_killed_mid_stream_meters_sent_tokens_and_breaker_recovers(
    system, engine_ready, account, fault_table
):
    http = httpx.Client(
        base_url=system.web_url,
        headers={"Authorization": f"Bearer {account.secret}"},
        timeout=60,
    )
    body = {
        "model": ENGINE_MODEL,
        "prompt": "Once upon a time",
        "max_tokens": 200,
        "logprobs": 1,
        "temperature": 0,
        "stream": True,
    }
    killed_at = []

    def kill():
        system.engine.kill()
        killed_at.append(time.monotonic())

    seen = _stream_until_killed(http, body, kill_after_tokens=5, kill=kill)

    # The client: a 200 stream that ends with one in-band error frame, no [DONE].
    assert seen["error"] is not None and seen["error"]["code"] == "vllm_engine_dead", seen
    assert not seen["done"]
    assert 5 <= seen["tokens"] < 200

    # Metered: exactly the tokens the client received, once.
    record = wait_for(
        lambda: UsageRecord.objects.filter(request_id=seen["request_id"]).first(),
        timeout=15,
        what="the stream's usage record",
    )
    assert UsageRecord.objects.filter(request_id=seen["request_id"]).count() == 1
    # Recorded with the error's status, though the client's stream had opened with a 200.
    assert (record.status_code, record.error_code) == (502, "vllm_engine_dead")
    assert record.completion_tokens == seen["tokens"]
    metered = wait_for(
        lambda: account.used_tokens() or None, timeout=15, what="the spend in the windows"
    )
    assert metered == record.prompt_tokens + seen["tokens"]

    # While the engine is down the breaker opens: requests fail fast with circuit_open.
    plain = {"model": ENGINE_MODEL, "prompt": "Hello", "max_tokens": 1, "temperature": 0}
    codes = []
    for _ in range(upstream.FAILURE_THRESHOLD + 2):
        response = http.post("/v1/completions", json=plain)
        codes.append(response.json()["error"]["code"])
    assert "upstream_unreachable" in codes and codes[-1] == "circuit_open", codes
    # Hold the circuit open for ten minutes, however long the engine takes to load on this
    # machine: only the gateway's health probe can close it within this test.
    redis_lib.Redis.from_url(settings.REDIS_URL).set(
        upstream.circuit_keys(system.engine_url)[0], int((time.time() + 600) * 1000)
    )

    # The engine comes back: the gateway's health probe sees it answer and closes the
    # circuit. A client retries after Retry-After.
    system.engine.start()
    system.engine.wait_ready()
    back_at = time.monotonic()

    def served():
        response = http.post(
            "/v1/completions", json=plain, headers={"X-Request-Id": uuid.uuid4().hex}
        )
        if response.status_code != 200:
            time.sleep(int(response.headers["retry-after"]))
        return response.status_code == 200

    wait_for(served, timeout=30, what="the breaker to close")
    recovered = time.monotonic()
    assert recovered - back_at <= 5, f"recovery took {recovered - back_at:.1f} s"
    fault_table.add(
        fault="engine SIGKILLed mid-stream, then restarted",
        client_saw=f"200 stream, {seen['tokens']} tokens, then an in-band `vllm_engine_dead`"
        f" frame (no [DONE]); then {codes.count('upstream_unreachable')}×"
        f" `upstream_unreachable`, then `circuit_open`",
        metered=f"{record.completion_tokens} completion (+{record.prompt_tokens} prompt)",
        produced=f"{seen['tokens']} received",
        recovery=f"{recovered - back_at:.1f} s after the engine was ready"
        f" ({recovered - killed_at[0]:.1f} s after the kill; the gateway probes /health"
        f" every {upstream.HEALTH_PROBE_INTERVAL_MS / 1000:.0f} s while the circuit is open)",
    )
    http.close()
