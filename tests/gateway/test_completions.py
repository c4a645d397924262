import json
import threading
import time

import pytest

from metering.models import UsageRecord

from .conftest import key_day_window, wait_settled

pytestmark = pytest.mark.django_db(transaction=True)


def test_completion_returns_upstream_body_and_meters_it(client, stub, api_key):
    response = client.post(
        "/v1/completions",
        json={"model": "stub-model", "prompt": "the capital of france is", "max_tokens": 3},
        headers={"X-Acs-Workload": "batch"},
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["choices"][0]["text"] == " tok tok tok"
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    assert response.headers["X-Request-Id"].startswith("req_")
    assert "gateway;dur=" in response.headers["Server-Timing"]
    assert "upstream;dur=" in response.headers["Server-Timing"]
    record = UsageRecord.objects.get()
    assert (record.prompt_tokens, record.completion_tokens, record.status_code) == (5, 3, 200)
    assert record.workload == "batch"
    assert record.upstream_latency_ms is not None
    assert record.request_id == response.headers["X-Request-Id"]
    window = key_day_window(api_key)
    assert (window.used_input, window.used_output, window.reserved_tokens) == (5, 3, 0)


def test_safe_inbound_request_id_is_echoed_and_unsafe_one_replaced(client, stub):
    body = {"model": "stub-model", "prompt": "hello", "max_tokens": 1}
    echoed = client.post("/v1/completions", json=body, headers={"X-Request-Id": "trace-42"})
    assert echoed.headers["X-Request-Id"] == "trace-42"
    replaced = client.post("/v1/completions", json=body, headers={"X-Request-Id": "bad id<>"})
    assert replaced.headers["X-Request-Id"].startswith("req_")


def test_unknown_v1_path_still_has_request_id(client):
    response = client.get("/v1/nowhere")
    assert response.status_code == 404
    assert response.headers["X-Request-Id"]


def test_large_body_is_gzipped_when_asked(client, stub):
    body = {"model": "stub-model", "prompt": "hello", "max_tokens": 40, "n": 8}
    response = client.post("/v1/completions", json=body, headers={"Accept-Encoding": "gzip"})
    assert response.headers["Content-Encoding"] == "gzip"
    assert len(response.json()["choices"]) == 8
    raw = client.post("/v1/completions", json=body, headers={"Accept-Encoding": "identity"})
    assert "Content-Encoding" not in raw.headers
    assert response.json()["choices"] == raw.json()["choices"]
    assert int(response.headers["Content-Length"]) < len(raw.content)


def test_upstream_gets_registry_limits_applied_and_model_name(client, stub):
    client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
    assert stub.requests[-1]["model"] == "stub-model"
    assert stub.requests[-1]["max_tokens"] == 2


def test_served_model_name_is_sent_upstream_and_renamed_back(client, stub):
    from api.models import LanguageModel
    from api.selectors import registry_clear

    LanguageModel.objects.filter(name="stub-model").update(served_model_name="upstream-name")
    registry_clear()
    response = client.post("/v1/completions", json={"model": "stub-model", "prompt": "hello"})
    assert stub.requests[-1]["model"] == "upstream-name"
    assert response.json()["model"] == "stub-model"


def test_streaming_relays_frames_usage_and_done(client, stub, api_key):
    body = {
        "model": "stub-model",
        "prompt": "hello",
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["X-Request-Id"]
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    frames = [json.loads(line[6:]) for line in lines[:-1]]
    assert "".join(f["choices"][0]["text"] for f in frames[:-1]) == " tok" * 4
    assert frames[-1]["choices"] == [] and frames[-1]["usage"]["completion_tokens"] == 4
    record = UsageRecord.objects.get()
    assert record.stream and record.completion_tokens == 4 and record.ttft_ms is not None


def test_stream_frame_longer_than_the_clients_default_line_limit_is_relayed_whole(client, stub):
    # aiohttp refuses a line over 128 KiB by default; one frame of many choices' top
    # logprobs can be longer.
    stub.mode["text"] = "x" * 300_000
    body = {"model": "stub-model", "prompt": "hello", "max_tokens": 2, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert [json.loads(line[6:])["choices"][0]["text"] for line in lines[:-1]] == [
        "x" * 300_000
    ] * 2


def test_stream_without_include_usage_hides_the_usage_frame(client, stub):
    body = {"model": "stub-model", "prompt": "hello", "max_tokens": 2, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as response:
        lines = [line for line in response.iter_lines() if line]
    assert stub.requests[-1]["stream_options"] == {"include_usage": True}
    assert all("usage" not in json.loads(line[6:]) for line in lines[:-1])
    assert lines[-1] == "data: [DONE]"
    assert UsageRecord.objects.get().completion_tokens == 2


def test_stream_server_timing_reports_the_time_the_upstream_took_to_open_it(client, stub):
    from acs_client.client import parse_server_timing

    stub.mode["delay"] = 0.3
    body = {"model": "stub-model", "prompt": "hello", "max_tokens": 1, "stream": True}
    sent_at = time.perf_counter()
    with client.stream("POST", "/v1/completions", json=body) as response:
        opened_ms = (time.perf_counter() - sent_at) * 1000
        timing = parse_server_timing(response.headers["Server-Timing"])
        response.read()
    assert timing["upstream"] >= 300
    # The gateway's own part (key, admission, budget) takes time, and both parts happened
    # between the client sending the request and receiving the stream's headers.
    assert timing["gateway"] > 0
    assert timing["gateway"] + timing["upstream"] <= opened_ms


def test_idle_stream_gets_keepalive_comments(client, stub, limits):
    limits(KEEPALIVE_S=0.05)
    stub.mode["gap"] = 0.3
    body = {"model": "stub-model", "prompt": "hello", "max_tokens": 2, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as response:
        lines = list(response.iter_lines())
    assert ": keepalive" in lines
    assert lines[-2:] == ["data: [DONE]", ""] or "data: [DONE]" in lines


def test_upstream_dying_mid_stream_yields_one_error_frame_without_done_and_records_the_error(
    client, stub, api_key
):
    stub.mode["die_after"] = 2
    body = {"model": "stub-model", "prompt": "hello", "max_tokens": 10, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line]
    wait_settled()  # the lease is given back after the record is written
    assert "data: [DONE]" not in lines
    error = json.loads(lines[-1][6:])["error"]
    assert error["code"] == "vllm_engine_dead"
    assert len(lines) == 3
    record = UsageRecord.objects.get()
    # The request log shows how the stream ended, not the 200 it opened with.
    assert (record.status_code, record.error_code) == (502, "vllm_engine_dead")
    assert record.completion_tokens == 2
    window = key_day_window(api_key)
    assert (window.used_output, window.reserved_tokens) == (2, 0)


def test_upstream_error_frame_mid_stream_is_mapped(client, stub):
    stub.mode["stream_error_after"] = 1
    body = {"model": "stub-model", "prompt": "hello", "max_tokens": 5, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as response:
        lines = [line for line in response.iter_lines() if line]
    assert json.loads(lines[-1][6:])["error"]["code"] == "vllm_oom"
    assert "data: [DONE]" not in lines


def test_stream_cut_by_the_client_is_settled_and_frees_its_slot(client, stub, api_key):
    from asgiref.sync import async_to_sync

    from api.admission import admission_counts

    stub.mode["gap"] = 0.05
    body = {"model": "stub-model", "prompt": "hello", "max_tokens": 60, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as response:
        seen = 0
        for line in response.iter_lines():
            if line.startswith("data:"):
                seen += 1
            if seen == 3:
                break
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        window = key_day_window(api_key)
        if window.used_tokens and not window.reserved_tokens:
            break
        time.sleep(0.05)
    assert window.reserved_tokens == 0
    assert 3 <= window.used_output < 60
    assert window.used_input == 1
    record = UsageRecord.objects.get()
    assert record.status_code == 499 and record.error_code == "client_disconnected"
    assert async_to_sync(admission_counts)(api_key.pk) == {"running": 0, "waiting": 0}


def post_and_leave(gateway_url, api_secret, *, after: float) -> None:
    """POST a small completion, hang up after `after` seconds without an answer, and wait
    until the gateway has metered the abandoned request (it does so in the background)."""
    import httpx

    body = {"model": "stub-model", "prompt": "hello", "max_tokens": 4}
    headers = {"Authorization": f"Bearer {api_secret}"}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{gateway_url}/v1/completions", json=body, headers=headers, timeout=after)
    deadline = time.monotonic() + 10
    while not UsageRecord.objects.exists():
        assert time.monotonic() < deadline, "the abandoned request was never metered"
        time.sleep(0.05)
    wait_settled()  # the lease is given back after the record is written


def test_client_leaving_a_non_streaming_request_is_billed_its_prompt_and_frees_its_hold(
    gateway_url, api_secret, stub, model, api_key
):
    """The upstream holds the answer (a gate) until the client has hung up: the request is
    billed its prompt, which the upstream took (it was billed 0 before), and nothing else
    stays held."""
    from asgiref.sync import async_to_sync

    from api.admission import admission_counts

    gate = threading.Event()
    stub.mode["gate"] = gate
    try:
        post_and_leave(gateway_url, api_secret, after=0.5)
    finally:
        gate.set()
    record = UsageRecord.objects.get()
    assert record.status_code == 499 and record.error_code == "client_disconnected"
    assert (record.prompt_tokens, record.completion_tokens) == (stub.count("hello"), 0)
    window = key_day_window(api_key)
    assert (window.requests, window.reserved_tokens) == (1, 0)
    assert (window.used_input, window.used_output) == (stub.count("hello"), 0)
    assert async_to_sync(admission_counts)(api_key.pk) == {"running": 0, "waiting": 0}


def test_unexpected_failure_is_a_500_envelope_not_a_traceback(client, stub, monkeypatch):
    from api import completions_app

    async def broken(*args, **kwargs):
        raise RuntimeError("database went away")

    monkeypatch.setattr(completions_app, "authenticate_header", broken)
    response = client.post("/v1/completions", json={"model": "stub-model", "prompt": "hello"})
    assert response.status_code == 500
    assert response.json()["error"]["code"] == "internal_error"
    assert response.headers["X-Request-Id"] in response.json()["error"]["message"]


def test_client_leaving_during_the_budget_hold_gets_the_hold_released(
    gateway_url, api_secret, stub, model, api_key, monkeypatch
):
    import asyncio
    import threading

    from api import completions_app
    from metering import gateway

    hold, watch = gateway.reserve, completions_app._cancel_when_gone
    client_gone = threading.Event()

    async def watched(request, reply, receive):
        await watch(request, reply, receive)
        if reply.client_gone:
            client_gone.set()  # the request has been cancelled

    async def hold_once_the_client_left(**kwargs):
        deadline = time.monotonic() + 10
        while not client_gone.is_set():
            assert time.monotonic() < deadline, "the gateway never saw the client leave"
            await asyncio.sleep(0.005)
        return await hold(**kwargs)

    monkeypatch.setattr(completions_app, "_cancel_when_gone", watched)
    monkeypatch.setattr(gateway, "reserve", hold_once_the_client_left)
    post_and_leave(gateway_url, api_secret, after=0.2)
    assert client_gone.is_set()
    # The hold the request was making when its client left is made, then released at once
    # (not left reserved until the sweep), and the upstream was never called.
    window = key_day_window(api_key)
    assert (window.requests, window.used_tokens, window.reserved_tokens) == (1, 0, 0)
    assert UsageRecord.objects.get().status_code == 499
    assert stub.requests == []
