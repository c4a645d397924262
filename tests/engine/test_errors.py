"""Bad input is a 400 naming the problem, before any model work; overload and disconnects."""

import base64
import time
from pathlib import Path

import numpy as np
import pytest
import zstandard
from conftest import MODEL, engine_in_process

from acs_client.codec import encode_vector
from acs_client.protocol import in_vllm_xargs
from tests.bombs import zero_bomb

HIDDEN = 576


def codec(shape) -> dict:
    return encode_vector(np.ones(shape, dtype=np.float32))


def steer(**spec) -> dict:
    return {"apply_steering_vectors": [{"layer_indices": [3], **spec}]}


BAD_REQUESTS = [
    ({"bogus": 1}, "invalid_request", "unknown field 'bogus'"),
    ({"model": "gpt-9"}, "model_not_found", "gpt-9"),
    ({"n": 17}, "invalid_request", "'n'"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "invalid_request", "stop"),
    ({"logprobs": 101}, "invalid_request", "'logprobs'"),
    ({"seed": 2**63}, "invalid_request", "'seed'"),
    ({"seed": -(2**63) - 1}, "invalid_request", "'seed'"),
    ({"prompt_logprobs": -2}, "invalid_request", "'prompt_logprobs'"),
    ({"max_tokens": "5"}, "invalid_request", "'max_tokens'"),
    ({"prompt": ""}, "invalid_request", "empty"),
    ({"prompt": []}, "invalid_request", "empty"),
    ({"prompt": [1, 49152]}, "invalid_request", "49152"),
    ({"prompt": [[5, -1]]}, "invalid_request", "-1"),
    ({"max_tokens": 8192}, "context_length_exceeded", "8192"),
    ({"output_residual_stream": [30]}, "invalid_request", "layer 30 is out of range"),
    ({"output_residual_stream": [1, 1]}, "invalid_request", "more than once"),
    ({"output_residual_stream": True, "n": 2}, "invalid_request", "needs n = 1"),
    ({"output_residual_stream": True, "prompt": ["a", "b"]}, "invalid_request", "one prompt"),
    ({"output_residual_stream": True, "stream": True}, "invalid_request", "cannot be streamed"),
    ({"echo": True, "return_token_ids": True}, "invalid_request", "'echo' with 'return_token_ids'"),
    ({"prompt": "word " * 300, "prompt_logprobs": -1}, "full_vocab_prompt_too_long", "256"),
    (steer(activations=codec((1, HIDDEN)), layer_indices=[31]), "invalid_request", "layer 31"),
    (steer(activations=codec((1, 100))), "invalid_request", "hidden size 100"),
    (steer(activations=codec((2, HIDDEN))), "invalid_request", "but layer_indices make it"),
    (steer(activations=codec((1, 2, HIDDEN))), "invalid_request", "needs position_indices"),
    (
        steer(activations=codec((1, 3, HIDDEN)), position_indices=[0, 1]),
        "invalid_request",
        "layer_indices and position_indices make it",
    ),
    (steer(activations=codec((HIDDEN,))), "invalid_request", "[layers, positions, hidden]"),
    (
        steer(activations={**codec((1, HIDDEN)), "data": "not base64!!"}),
        "invalid_request",
        "not valid base64",
    ),
    (
        steer(activations={**codec((1, HIDDEN)), "data": base64.b64encode(b"junk").decode()}),
        "invalid_request",
        "zstd",
    ),
    (
        steer(activations={**codec((1, HIDDEN)), "shape": [2, HIDDEN]}, layer_indices=[3, 4]),
        "invalid_request",
        "bytes",
    ),
    (
        steer(activations=codec((1, 1, HIDDEN)), position_indices=[10**6]),
        "invalid_request",
        "Position 1000000 in 'vllm_xargs.apply_steering_vectors.0.position_indices' is outside",
    ),
    (
        steer(activations=codec((1, 2, HIDDEN)), position_indices=[1, 1]),
        "invalid_request",
        "names a position twice",
    ),
    (
        {"prompt": ["a", "b"], "n": 16, "max_tokens": 1001},
        "invalid_request",
        "exceeds the output-work cap of 32,000",
    ),
    (steer(activations={**codec((1, HIDDEN)), "dtype": "float32"}), "invalid_request", "dtype"),
    (steer(activations={**codec((1, HIDDEN)), "compression": "gzip"}), "invalid_request", "gzip"),
    (steer(activations=codec((1, HIDDEN)), extra=1), "invalid_request", "extra"),
    (
        steer(activations=encode_vector(np.full((1, HIDDEN), np.inf, dtype=np.float32))),
        "invalid_request",
        "inf or nan",
    ),
]


@pytest.mark.parametrize("fields, code, message", BAD_REQUESTS)
def test_bad_request_is_a_400_naming_the_problem(client, fields, code, message):
    body = {"model": MODEL, "prompt": "Hello", **fields}
    response = client.post("/v1/completions", json=in_vllm_xargs(body))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == code
    assert message in error["message"]
    assert error["type"]


def test_bad_json_is_a_400(client):
    response = client.post(
        "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "bad_json"


def test_zstd_frame_of_wrong_size_is_rejected(client):
    frame = zstandard.ZstdCompressor().compress(b"\x00" * 10)
    activations = {**codec((1, HIDDEN)), "data": base64.b64encode(frame).decode()}
    body = {"model": MODEL, "prompt": "Hello", **steer(activations=activations)}
    response = client.post("/v1/completions", json=in_vllm_xargs(body))
    assert response.status_code == 400
    assert "needs 1152" in response.json()["error"]["message"]


def wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def long_stream_body() -> dict:
    return {
        "model": MODEL,
        "prompt": "Count:",
        "max_tokens": 4000,
        "ignore_eos": True,
        "stream": True,
    }


def test_client_disconnect_mid_stream_frees_the_slot(engine):
    with engine.client.stream("POST", "/v1/completions", json=long_stream_body()) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        assert engine.stats()["active_sequences"] == 1
    wait_for(lambda: engine.stats()["active_sequences"] == 0, timeout_s=5)


@pytest.fixture(scope="module")
def tiny_engine(reference):
    with engine_in_process(reference, max_active=1, max_waiting=1) as engine:
        yield engine


def test_queue_overflow_is_a_503_with_retry_after(tiny_engine):
    client = tiny_engine.client
    with client.stream("POST", "/v1/completions", json=long_stream_body()) as running:
        running_lines = running.iter_lines()  # keep it: a dropped iterator closes the stream
        next(running_lines)
        with client.stream("POST", "/v1/completions", json=long_stream_body()) as waiting:
            wait_for(lambda: tiny_engine.stats()["waiting_sequences"] == 1)
            body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
            refused = client.post("/v1/completions", json=body)
            assert refused.status_code == 503
            assert refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["code"] == "engine_overloaded"
            assert waiting.status_code == 200
            assert tiny_engine.stats()["active_sequences"] == 1
    idle = {"active_sequences": 0, "waiting_sequences": 0}
    wait_for(lambda: tiny_engine.stats().items() >= idle.items(), timeout_s=5)
    assert client.post("/v1/completions", json=body).status_code == 200


def peak_rss_kb(pid: int) -> int:
    """The process's peak resident set size (VmHWM, kB) since it started or was reset."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1])


def reset_peak_rss(pid: int) -> None:
    """Lower the process's peak resident set size to its current one (proc(5): clear_refs 5),
    so the peak measures what comes next, not what the process held before."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


@pytest.mark.parametrize(
    ("shape", "values", "spec"),
    [
        # An 11 KB body whose zeros decompressed to 268 MB, then 537 MB of float32.
        ([1, 233017, HIDDEN], 233017 * HIDDEN, {}),
        # A 311-byte body whose shape alone asked for a 115 GB buffer (MemoryError, a 500).
        ([1, 10**8, HIDDEN], 8, {}),
        # A position past the sequence (its row would never be used).
        ([1, 2, HIDDEN], 2 * HIDDEN, {"position_indices": [0, 10**8]}),
    ],
)
def test_steering_decompression_bomb_is_a_400_without_a_memory_spike(
    tiny_engine, shape, values, spec
):
    vector = {"activations": zero_bomb(shape, values), "layer_indices": [3], **spec}
    bomb = {"apply_steering_vectors": [vector]}
    pid = tiny_engine.pid
    reset_peak_rss(pid)
    peak_before = peak_rss_kb(pid)
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 1, **bomb}
    response = tiny_engine.client.post("/v1/completions", json=in_vllm_xargs(body))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "invalid_request"
    assert "apply_steering_vectors.0" in response.json()["error"]["message"]
    assert peak_rss_kb(pid) - peak_before < 64 * 1024, "no allocation of the claimed shape"


def test_request_larger_than_the_waiting_queue_is_taken_in_when_the_queue_is_empty(tiny_engine):
    """The tiny engine waits at most 1 sequence and runs 1: a 3-prompt request is queued whole
    and its prompts run one after another (no retryable 503 for what can never fit)."""
    body = {"model": MODEL, "prompt": ["One", "Two", "Three"], "max_tokens": 1}
    response = tiny_engine.client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert [choice["index"] for choice in response.json()["choices"]] == [0, 1, 2]
    assert response.json()["usage"]["completion_tokens"] == 3


def test_more_samples_than_the_engine_runs_at_once_is_a_400(tiny_engine):
    body = {"model": MODEL, "prompt": "Hello", "n": 2, "max_tokens": 1}
    response = tiny_engine.client.post("/v1/completions", json=body, timeout=20)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "invalid_request"
    assert "at most 1 sequences at once" in response.json()["error"]["message"]


def test_health_and_completions_are_503_while_the_model_loads(tmp_path):
    from starlette.testclient import TestClient

    from engine.config import EngineConfig
    from engine.server import create_app

    # Without entering the client, the lifespan (which starts loading) never runs.
    client = TestClient(create_app(EngineConfig(cache_dir=tmp_path)), base_url="http://127.0.0.1")
    health = client.get("/health")
    assert health.status_code == 503 and health.json()["model_loaded"] is False
    refused = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi"})
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "model_loading"
    assert refused.headers["retry-after"] == "1"


RAW_DIALECT_REQUESTS = [
    # vLLM ignores them at the top level; the engine, stricter, names them.
    ({"output_residual_stream": True}, "unknown field 'output_residual_stream'"),
    ({"apply_steering_vectors": []}, "unknown field 'apply_steering_vectors'"),
    # Code travels as a pickled hook in vLLM-Lens's dialect: never taken here.
    ({"vllm_xargs": {"apply_hooks": "[]"}}, "unknown field 'vllm_xargs.apply_hooks'"),
    ({"vllm_xargs": {"apply_steering_vectors": "[{"}}, "is not a JSON string"),
    (
        {"vllm_xargs": {"apply_steering_vectors": '[{"layer_indices": [1]}]'}},
        "missing required field 'vllm_xargs.apply_steering_vectors.0.activations'",
    ),
]


@pytest.mark.parametrize("fields, message", RAW_DIALECT_REQUESTS)
def test_the_engine_takes_capture_and_steering_only_in_vllm_xargs(client, fields, message):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 1, **fields}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "invalid_request"
    assert message in response.json()["error"]["message"]
