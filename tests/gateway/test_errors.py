"""Every error code the gateway produces, with its status and retry headers."""

import base64
import time

import numpy as np
import pytest
import zstandard

from accounts.models import ApiKey, KeyStatus, User, UserStatus
from accounts.services.service import service_spend_cap_set
from acs_client.codec import encode_vector
from metering.models import UsageRecord

pytestmark = pytest.mark.django_db(transaction=True)

BASE = {"model": "stub-model", "prompt": "hello", "max_tokens": 2}


def assert_error(response, status, code, *, retry_after=None, should_retry=None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code
    assert error["message"] and error["type"]
    assert response.headers["X-Request-Id"]
    if retry_after is None:
        assert "Retry-After" not in response.headers
    else:
        assert response.headers["Retry-After"] == str(retry_after)
    if should_retry is False:
        assert response.headers["X-Should-Retry"] == "false"
    else:
        assert "X-Should-Retry" not in response.headers
    return error


def wait_for_the_health_probe_interval(url, timeout=5.0) -> None:
    """Until the gateway may ask `url`'s /health again: its probe lock (set for
    HEALTH_PROBE_INTERVAL_MS by the last probe) has lapsed."""
    import redis
    from django.conf import settings

    from api import upstream

    r = redis.Redis.from_url(settings.REDIS_URL)
    deadline = time.monotonic() + timeout
    while r.exists(upstream.circuit_keys(url)[3]):
        assert time.monotonic() < deadline, "the health probe's lock never lapsed"
        time.sleep(0.005)


def steering(hidden=8, layers=(1,), shape=None, **extra):
    vector = np.ones(shape or (len(layers), hidden), dtype=np.float32)
    return [{"activations": encode_vector(vector), "layer_indices": list(layers), **extra}]


def lying_steering(shape, frame_values):
    """A steering vector whose shape claims `shape` but whose zstd frame declares (and holds)
    `frame_values` values."""
    frame = zstandard.ZstdCompressor().compress(b"\0" * 2 * frame_values)
    vector = steering()[0]
    vector["activations"] = {
        **vector["activations"],
        "shape": list(shape),
        "data": base64.b64encode(frame).decode(),
    }
    return [vector]


@pytest.mark.parametrize(
    ("changes", "code", "mentions"),
    [
        ({"temperatur": 1.0}, "invalid_request", "temperatur"),
        ({"n": 17, "max_tokens": 1}, "invalid_request", "n"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "invalid_request", "stop"),
        ({"logprobs": 101}, "invalid_request", "logprobs"),
        ({"prompt_logprobs": -2}, "invalid_request", "prompt_logprobs"),
        ({"max_tokens": 0}, "invalid_request", "max_tokens"),
        ({"max_tokens": "5"}, "invalid_request", "max_tokens"),
        ({"prompt": ["hello", "the"], "max_tokens": None}, "invalid_request", "max_tokens"),
        ({"n": 2, "max_tokens": None}, "invalid_request", "max_tokens"),
        ({"prompt": ["hello"] * 16, "n": 16, "max_tokens": 126}, "invalid_request", "cap"),
        ({"prompt": ""}, "invalid_request", "empty"),
        ({"prompt": [5, 1000]}, "invalid_request", "vocabulary"),
        ({"stream_options": {"include_usage": True}}, "invalid_request", "stream"),
        # What vLLM refuses is refused before it, the same for every upstream.
        ({"stop": ["\n", ""]}, "invalid_request", "'stop' holds an empty string"),
        ({"temperature": 2.5}, "invalid_request", "temperature"),
        (
            {"prompt_logprobs": 1, "stream": True},
            "invalid_request",
            "'prompt_logprobs' cannot be streamed",
        ),
        (
            {"echo": True, "return_token_ids": True},
            "invalid_request",
            "'echo' with 'return_token_ids'",
        ),
        ({"output_residual_stream": [4]}, "invalid_request", "Layer 4"),
        ({"output_residual_stream": [1, 1]}, "invalid_request", "twice"),
        (
            {"output_residual_stream": True, "prompt": ["a", "b"], "max_tokens": 1},
            "invalid_request",
            "one prompt",
        ),
        ({"output_residual_stream": True, "n": 2}, "invalid_request", "n = 1"),
        ({"output_residual_stream": True, "stream": True}, "invalid_request", "streamed"),
        ({"apply_steering_vectors": steering(hidden=9)}, "invalid_request", "hidden size"),
        ({"apply_steering_vectors": steering(layers=(9,))}, "invalid_request", "Layer 9"),
        ({"apply_steering_vectors": steering() * 9}, "invalid_request", "apply_steering"),
        (
            {"apply_steering_vectors": steering(shape=(1, 3, 8))},
            "invalid_request",
            "apply_steering_vectors.0.activations.shape' is [layers, positions, hidden], which "
            "needs position_indices",
        ),
        (
            {"apply_steering_vectors": steering(shape=(1, 2, 8), position_indices=[0, 1, 2])},
            "invalid_request",
            "apply_steering_vectors.0.activations.shape' is [1, 2, 8], but layer_indices and "
            "position_indices make it [1, 3, 8]",
        ),
        (
            {"apply_steering_vectors": steering(shape=(1, 1, 8), position_indices=[3])},
            "invalid_request",
            "Position 3 in 'apply_steering_vectors.0.position_indices' is outside the sequence",
        ),
        (
            {"apply_steering_vectors": steering(shape=(1, 2, 8), position_indices=[1, 1])},
            "invalid_request",
            "names a position twice",
        ),
        (
            {"apply_steering_vectors": lying_steering((1, 8), 512 * 1024)},
            "invalid_request",
            "apply_steering_vectors.0.activations.data': data holds 1048576 bytes but shape "
            "[1, 8] needs 16",
        ),
        ({"model": "nope"}, "model_not_found", "nope"),
        ({"max_tokens": 15_601, "stream": False}, "deadline_infeasible", "15600"),
        ({"max_tokens": 60, "prompt": "the capital of france is"}, "context_length_exceeded", "64"),
        (
            {"prompt_logprobs": -1, "prompt": "hello " * 20, "n": 13, "max_tokens": 1},
            "full_vocab_prompt_too_long",
            "256",
        ),
        (
            {"prompt_logprobs": -1, "prompt": "hello " * 17, "output_residual_stream": True},
            "full_vocab_prompt_too_long",
            "16",
        ),
    ],
)
def test_invalid_body_is_refused_before_any_upstream_work(client, stub, changes, code, mentions):
    body = {**BASE, **changes}
    body = {k: v for k, v in body.items() if v is not None}
    response = client.post("/v1/completions", json=body)
    error = assert_error(response, 400, code, should_retry=False)
    assert mentions in error["message"]
    assert stub.requests == []
    assert UsageRecord.objects.get().error_code == code


def test_steering_vectors_over_the_value_limit_are_refused(client, stub, monkeypatch):
    from api import validation

    monkeypatch.setattr(validation, "STEERING_MAX_VALUES", 15)
    body = {**BASE, "apply_steering_vectors": steering() * 2}
    error = assert_error(
        client.post("/v1/completions", json=body), 400, "invalid_request", should_retry=False
    )
    assert "'apply_steering_vectors' hold 16 values together; at most 15" in error["message"]
    assert stub.requests == []


def test_context_limit_of_the_real_max_model_len_with_long_streams(client, stub):
    body = {**BASE, "max_tokens": 15_601, "stream": True}
    assert_error(
        client.post("/v1/completions", json=body),
        400,
        "context_length_exceeded",
        should_retry=False,
    )


def test_capture_too_large_is_activation_prompt_too_long(client, stub, monkeypatch):
    from api import validation

    monkeypatch.setattr(validation, "CAPTURE_MAX_VALUES", 10)
    body = {**BASE, "output_residual_stream": True}
    assert_error(
        client.post("/v1/completions", json=body),
        400,
        "activation_prompt_too_long",
        should_retry=False,
    )


def test_model_without_activations_is_activation_engine_unconfigured(client, stub):
    from api.models import LanguageModel
    from api.selectors import registry_clear

    LanguageModel.objects.update(supports_activations=False)
    registry_clear()
    for extra in ({"output_residual_stream": True}, {"apply_steering_vectors": steering()}):
        response = client.post("/v1/completions", json={**BASE, **extra})
        assert_error(response, 503, "activation_engine_unconfigured", should_retry=False)


def test_bad_json_and_non_object_bodies(client, stub):
    bad = client.post("/v1/completions", content=b"{nope")
    assert_error(bad, 400, "bad_json", should_retry=False)
    listed = client.post("/v1/completions", json=[1, 2])
    assert_error(listed, 400, "invalid_request", should_retry=False)


def test_body_over_8_mib_is_413_before_parsing(client, stub):
    huge = b'{"prompt": "' + b"a" * (8 * 1024 * 1024) + b'"}'
    response = client.post("/v1/completions", content=huge)
    assert_error(response, 413, "request_too_large", should_retry=False)


def test_body_over_8_mib_without_content_length_is_413(client, stub):
    def chunks():
        yield b'{"prompt": "'
        for _ in range(9):
            yield b"a" * (1024 * 1024)
        yield b'"}'

    response = client.post("/v1/completions", content=chunks())
    assert_error(response, 413, "request_too_large", should_retry=False)


def test_chat_completions_is_unsupported(client):
    response = client.post("/v1/chat/completions", json={"messages": []})
    assert_error(response, 400, "chat_completions_unsupported", should_retry=False)


def test_wrong_method_is_405_envelope(client):
    response = client.get("/v1/completions")
    assert_error(response, 405, "method_not_allowed", should_retry=False)


# --- authentication --------------------------------------------------------------------


def test_missing_and_invalid_keys(gateway_url, model):
    import httpx

    with httpx.Client(base_url=gateway_url) as http:
        missing = http.post("/v1/completions", json=BASE)
        assert_error(missing, 401, "missing_authorization", should_retry=False)
        bad = http.post("/v1/completions", json=BASE, headers={"Authorization": "Bearer acs-x"})
        assert_error(bad, 401, "invalid_api_key", should_retry=False)


@pytest.mark.parametrize(
    ("change", "status", "code"),
    [
        ({"key_status": KeyStatus.REVOKED}, 401, "key_revoked"),
        ({"key_status": KeyStatus.DISABLED}, 401, "key_disabled"),
        ({"user_status": UserStatus.PENDING}, 401, "account_not_approved"),
        ({"user_status": UserStatus.SUSPENDED}, 401, "account_suspended"),
        ({"scopes": []}, 403, "scope_denied"),
    ],
)
def test_refused_keys(client, api_key, change, status, code):
    if "key_status" in change:
        ApiKey.objects.filter(pk=api_key.pk).update(status=change["key_status"])
    if "user_status" in change:
        User.objects.filter(pk=api_key.user_id).update(status=change["user_status"])
    if "scopes" in change:
        ApiKey.objects.filter(pk=api_key.pk).update(scopes=change["scopes"])
    assert_error(client.post("/v1/completions", json=BASE), status, code, should_retry=False)


# --- budgets -----------------------------------------------------------------------------


def test_exhausted_budget_is_429_without_retry_after(client, stub, api_key):
    ApiKey.objects.filter(pk=api_key.pk).update(daily_token_budget=1)
    response = client.post("/v1/completions", json=BASE)
    assert_error(response, 429, "budget_exceeded", should_retry=False)
    assert stub.requests == []


def test_small_budget_clamps_max_tokens_with_header(client, stub, api_key):
    ApiKey.objects.filter(pk=api_key.pk).update(daily_token_budget=4)
    response = client.post("/v1/completions", json={**BASE, "max_tokens": 10})
    assert response.status_code == 200
    assert response.headers["X-Acs-Max-Tokens-Clamped"] == "requested=10,applied=3,reason=budget"
    assert stub.requests[-1]["max_tokens"] == 3


def test_spend_cap_is_429_with_retry_after_3600(client, stub, staff_user):
    service_spend_cap_set(paused=True, acting_user=staff_user, reason="test")
    assert_error(client.post("/v1/completions", json=BASE), 429, "spend_cap", retry_after=3600)


def test_activation_quota_exceeded(client, stub, api_key):
    ApiKey.objects.filter(pk=api_key.pk).update(monthly_activation_quota=0)
    response = client.post("/v1/completions", json={**BASE, "output_residual_stream": [0]})
    assert_error(response, 429, "activation_quota_exceeded", should_retry=False)


# --- upstream failures -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "status", "code", "retry_after", "should_retry"),
    [
        (
            {"status": 500, "error": {"code": "x", "message": "boom"}},
            502,
            "upstream_server_error",
            None,
            False,
        ),
        ({"status": 500, "retry_after": 7}, 502, "upstream_server_error", 7, None),
        (
            {"status": 500, "error": {"code": "x", "message": "CUDA out of memory"}},
            502,
            "vllm_oom",
            5,
            None,
        ),
        (
            {
                "status": 503,
                "error": {"code": "engine_overloaded", "message": "busy"},
                "retry_after": 3,
            },
            503,
            "wrapper_saturated",
            3,
            None,
        ),
        (
            {"status": 503, "error": {"code": "model_loading", "message": "loading"}},
            503,
            "modal_cold_boot",
            30,
            None,
        ),
        (
            {"status": 400, "error": {"code": "invalid_request", "message": "bad top_k"}},
            400,
            "vllm_invalid_request",
            None,
            False,
        ),
        (
            {"status": 400, "error": {"code": "x", "message": "exceeds maximum context length"}},
            400,
            "vllm_context_length",
            None,
            False,
        ),
        ({"status": 401}, 502, "upstream_auth", None, False),
        ({"status": 504}, 504, "upstream_deadline", None, False),
        (
            {"status": 500, "error": {"code": "capture_incomplete", "message": "partial"}},
            502,
            "capture_incomplete",
            5,
            None,
        ),
        (
            {"status": 400, "error": {"code": "position_steering_unavailable", "message": "no"}},
            400,
            "position_steering_unavailable",
            None,
            False,
        ),
    ],
)
def test_upstream_failures_map_to_contract_codes(
    client, stub, mode, status, code, retry_after, should_retry
):
    stub.mode.update(mode)
    response = client.post("/v1/completions", json=BASE)
    assert_error(response, status, code, retry_after=retry_after, should_retry=should_retry)
    record = UsageRecord.objects.get()
    assert (record.status_code, record.error_code) == (status, code)


def test_upstream_failure_before_stream_opens_is_a_json_error(client, stub):
    stub.mode.update({"status": 503, "retry_after": 2})
    response = client.post("/v1/completions", json={**BASE, "stream": True})
    assert_error(response, 503, "wrapper_saturated", retry_after=2)


def test_unreachable_upstream_is_502_with_retry_after(client, stub):
    from api.models import LanguageModel
    from api.selectors import registry_clear

    LanguageModel.objects.update(upstream_urls=["http://127.0.0.1:9"])
    registry_clear()
    response = client.post("/v1/completions", json={**BASE, "prompt": [1, 2]})
    assert_error(response, 502, "upstream_unreachable", retry_after=5)


def test_upstream_timeout_is_504_upstream_deadline(client, stub, monkeypatch):
    from api import upstream

    monkeypatch.setattr(upstream, "NON_STREAMING_TIMEOUT_S", 0.2)
    stub.mode["delay"] = 1.0
    assert_error(
        client.post("/v1/completions", json=BASE), 504, "upstream_deadline", should_retry=False
    )


def test_failing_upstream_opens_the_circuit_then_recovers(client, stub, monkeypatch):
    from api import upstream

    stub.mode.update({"status": 500})
    for _ in range(upstream.FAILURE_THRESHOLD):
        assert client.post("/v1/completions", json=BASE).status_code == 502
    response = client.post("/v1/completions", json=BASE)
    error = assert_error(response, 503, "circuit_open", retry_after=2)
    assert "failing" in error["message"]
    assert len(stub.requests) == upstream.FAILURE_THRESHOLD
    # After the open period one probe goes through; its success closes the circuit.
    import redis
    from django.conf import settings

    r = redis.Redis.from_url(settings.REDIS_URL)
    r.set(upstream.circuit_keys(stub.url)[0], 0)
    stub.mode.clear()
    assert client.post("/v1/completions", json=BASE).status_code == 200
    assert r.get(upstream.circuit_keys(stub.url)[0]) is None
    assert client.post("/v1/completions", json=BASE).status_code == 200


def test_an_open_circuit_closes_as_soon_as_the_upstream_health_comes_back(
    client, stub, monkeypatch
):
    import redis
    from django.conf import settings

    from api import upstream

    monkeypatch.setattr(upstream, "HEALTH_PROBE_INTERVAL_MS", 100)
    stub.mode.update({"status": 500, "healthy": False})
    for _ in range(upstream.FAILURE_THRESHOLD):
        assert client.post("/v1/completions", json=BASE).status_code == 502
    # The circuit is open (for OPEN_MS); a request finds /health failing and is refused.
    assert_error(client.post("/v1/completions", json=BASE), 503, "circuit_open", retry_after=2)
    assert stub.paths.count("/health") == 1
    # Within the probe interval nobody asks again: the probe is shared by all clients.
    assert_error(client.post("/v1/completions", json=BASE), 503, "circuit_open", retry_after=2)
    assert stub.paths.count("/health") == 1
    stub.mode.clear()
    wait_for_the_health_probe_interval(stub.url)
    # The next request's probe finds the upstream back: the circuit closes and it is served.
    assert client.post("/v1/completions", json=BASE).status_code == 200
    r = redis.Redis.from_url(settings.REDIS_URL)
    assert not any(r.exists(key) for key in upstream.circuit_keys(stub.url))
    assert len(stub.requests) == upstream.FAILURE_THRESHOLD + 1


def test_a_healthy_health_check_does_not_close_a_circuit_its_completions_opened(
    client, stub, monkeypatch
):
    """/health answering all along is no sign of recovery: the circuit stays open for
    OPEN_MS, so an upstream failing behind a healthy /health is not retried every second."""
    from api import upstream

    monkeypatch.setattr(upstream, "HEALTH_PROBE_INTERVAL_MS", 100)
    stub.mode.update({"status": 500})
    for _ in range(upstream.FAILURE_THRESHOLD):
        assert client.post("/v1/completions", json=BASE).status_code == 502
    for _ in range(3):
        wait_for_the_health_probe_interval(stub.url)
        assert_error(client.post("/v1/completions", json=BASE), 503, "circuit_open", retry_after=2)
    assert stub.paths.count("/health") == 3
    assert len(stub.requests) == upstream.FAILURE_THRESHOLD


def upstream_answer(status: int, code: str, message: str, **error) -> dict:
    """The stub's mode answering every completion with this error."""
    return {"status": status, "error": {"code": code, "message": message, **error}}


@pytest.mark.parametrize(
    ("mode", "status", "code"),
    [
        (upstream_answer(503, "engine_overloaded", "busy"), 503, "wrapper_saturated"),
        (upstream_answer(429, "too_many", "busy"), 503, "wrapper_saturated"),
        (upstream_answer(503, "model_loading", "loading"), 503, "modal_cold_boot"),
        (upstream_answer(500, "oom", "out of memory on its size"), 502, "vllm_oom"),
        (
            upstream_answer(500, "x", "m", type="invalid_request_error"),
            502,
            "upstream_server_error",
        ),
        (
            upstream_answer(400, "invalid_request", "too many sequences"),
            400,
            "vllm_invalid_request",
        ),
    ],
)
def test_answers_about_the_request_or_load_never_open_the_circuit(client, stub, mode, status, code):
    """Each answer keeps its own status and code (never 503 circuit_open) however often."""
    from api import upstream

    stub.mode.update(mode)
    for _ in range(upstream.FAILURE_THRESHOLD + 2):
        response = client.post("/v1/completions", json=BASE)
        assert (response.status_code, response.json()["error"]["code"]) == (status, code)
    stub.mode.clear()
    assert client.post("/v1/completions", json=BASE).status_code == 200
    assert len(stub.requests) == upstream.FAILURE_THRESHOLD + 3


def test_round_robin_skips_an_open_upstream(client, stub):
    import redis
    from django.conf import settings

    from api import upstream
    from api.models import LanguageModel
    from api.selectors import registry_clear

    dead = "http://127.0.0.1:9"
    LanguageModel.objects.update(upstream_urls=[dead, stub.url])
    registry_clear()
    r = redis.Redis.from_url(settings.REDIS_URL)
    r.set(upstream.circuit_keys(dead)[0], 10**15)
    for _ in range(4):
        assert client.post("/v1/completions", json=BASE).status_code == 200
    assert len(stub.requests) == 4


def test_a_circuit_opened_by_another_replica_is_seen_within_the_trust_delay(
    client, stub, monkeypatch
):
    import time

    import redis
    from django.conf import settings

    from api import upstream

    monkeypatch.setattr(upstream, "CLOSED_TRUST_S", 0.3)
    assert client.post("/v1/completions", json=BASE).status_code == 200
    checked_at = time.monotonic()
    r = redis.Redis.from_url(settings.REDIS_URL)
    r.set(upstream.circuit_keys(stub.url)[0], int((time.time() + 30) * 1000))
    # Still trusted closed: this request costs no Redis round trip.
    assert client.post("/v1/completions", json=BASE).status_code == 200
    # The trust, given when the first request found the circuit closed, lapses within the
    # delay (this process runs the gateway: its trust is this module's).
    lapses_by = checked_at + upstream.CLOSED_TRUST_S
    while upstream._trusted_closed_until.get(stub.url, 0.0) > (now := time.monotonic()):
        assert now < lapses_by, "the circuit is still trusted closed past CLOSED_TRUST_S"
        time.sleep(0.005)
    response = client.post("/v1/completions", json=BASE)
    assert response.status_code == 503 and response.json()["error"]["code"] == "circuit_open"
    r.delete(upstream.circuit_keys(stub.url)[0])


def test_an_unknown_v1_path_is_404_in_the_api_envelope(client):
    response = client.get("/v1/no-such-endpoint")
    error = assert_error(response, 404, "not_found", should_retry=False)
    assert "/v1/no-such-endpoint" in error["message"]
    assert response.headers["content-type"] == "application/json"


def test_an_unexpected_failure_in_a_v1_view_is_a_500_envelope(client, stub, monkeypatch):
    from api import views

    async def broken():
        raise RuntimeError("registry went away")

    monkeypatch.setattr(views, "model_list", broken)
    response = client.get("/v1/models")
    error = assert_error(response, 500, "internal_error")
    assert response.headers["X-Request-Id"] in error["message"]


def test_a_saturated_database_pool_is_503_db_pool_exhausted(client, stub, monkeypatch):
    from psycopg_pool import PoolTimeout

    from metering import sql

    async def saturated(pool, steps):
        raise PoolTimeout("no connection within the timeout")

    monkeypatch.setattr(sql, "_run_on", saturated)
    response = client.post("/v1/completions", json=BASE)
    assert_error(response, 503, "db_pool_exhausted", retry_after=2)
    assert stub.requests == []
