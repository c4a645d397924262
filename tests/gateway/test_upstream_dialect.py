"""The gateway speaks vLLM-Lens's dialect to its upstreams (capture and steering inside
`vllm_xargs`) and makes one public behaviour of what vLLM-Lens and the engine do differently
(`api.dialect`, `api.validation`). The stub upstream answers captures as vLLM-Lens does
(layers in ascending order, each layer's values equal to its index), or, with its `plugin`
off, as plain vLLM does (it ignores `vllm_xargs`). The real vLLM-Lens answers the same
requests in tests/vllm."""

import json

import numpy as np
import pytest

from acs_client.codec import decode, encode_vector
from api import dialect, selectors
from metering import windows
from metering.models import UsagePeriod, UsageRecord

from .conftest import wait_settled

pytestmark = pytest.mark.django_db(transaction=True)

HIDDEN = 8  # the stub model's
BODY = {"model": "stub-model", "prompt": "the capital of france is", "max_tokens": 2}


@pytest.fixture(autouse=True)
def probes_forgotten():
    selectors.probes_clear()
    yield
    selectors.probes_clear()


def vector(rows: int, *, value: float = 1.0, **fields) -> dict:
    values = np.full((rows, HIDDEN), value, np.float32)
    return {"activations": encode_vector(values), "layer_indices": list(range(rows)), **fields}


def activation_requests(key) -> int:
    wait_settled()
    return UsagePeriod.objects.get(key=key, period=windows.MONTH.name).activation_requests


def test_capture_travels_in_vllm_xargs_and_comes_back_in_the_requests_layer_order(client, stub):
    response = client.post("/v1/completions", json={**BODY, "output_residual_stream": [3, 1]})
    assert response.status_code == 200, response.text
    sent = stub.requests[-1]
    assert "output_residual_stream" not in sent
    assert sent["vllm_xargs"] == {"output_residual_stream": [1, 3]}
    rows = decode(response.json()["activations"]["residual_stream"])
    # 5 prompt tokens + 2 generated - 1; the stub's rows hold their layer's index.
    assert rows.shape == (2, 6, HIDDEN)
    assert (rows[0] == 3).all() and (rows[1] == 1).all()


def test_steering_travels_in_vllm_xargs_as_one_json_string(client, stub):
    steering = [vector(1, scale=2.0)]
    response = client.post("/v1/completions", json={**BODY, "apply_steering_vectors": steering})
    assert response.status_code == 200, response.text
    sent = stub.requests[-1]
    assert "apply_steering_vectors" not in sent
    assert json.loads(sent["vllm_xargs"]["apply_steering_vectors"]) == steering


def test_a_2d_vector_with_positions_is_sent_as_the_3d_vector_it_means(client, stub):
    """vLLM-Lens adds a 2-D vector at every position, whatever its position_indices."""
    values = np.arange(2 * HIDDEN, dtype=np.float32).reshape(2, HIDDEN)
    steering = {"activations": encode_vector(values), "layer_indices": [0, 2]}
    body = {
        **BODY,
        "max_tokens": 1,
        "apply_steering_vectors": [{**steering, "position_indices": [1, 3]}],
    }
    assert client.post("/v1/completions", json=body).status_code == 200
    [sent] = json.loads(stub.requests[-1]["vllm_xargs"]["apply_steering_vectors"])
    assert sent["position_indices"] == [1, 3]
    per_position = decode(sent["activations"])
    assert per_position.shape == (2, 2, HIDDEN)
    np.testing.assert_array_equal(per_position, np.repeat(values[:, None, :], 2, axis=1))


def test_a_reply_without_the_capture_is_capture_incomplete_and_costs_nothing(client, stub, api_key):
    """An upstream that took the plugin's probe but answers a capture without one."""
    captured = client.post("/v1/completions", json={**BODY, "output_residual_stream": [1]})
    assert captured.status_code == 200
    assert activation_requests(api_key) == 1
    stub.mode["plugin"] = False
    response = client.post("/v1/completions", json={**BODY, "output_residual_stream": [1]})
    assert response.status_code == 502, response.text
    assert response.json()["error"]["code"] == "capture_incomplete"
    assert "Retry-After" in response.headers
    assert activation_requests(api_key) == 1
    record = UsageRecord.objects.get(error_code="capture_incomplete")
    assert (record.prompt_tokens, record.completion_tokens) == (0, 0)


def test_an_activation_upstream_without_the_plugin_refuses_activation_requests(client, stub):
    stub.mode["plugin"] = False
    for activation in ({"output_residual_stream": [1]}, {"apply_steering_vectors": [vector(1)]}):
        response = client.post("/v1/completions", json={**BODY, **activation})
        assert response.status_code == 503, response.text
        error = response.json()["error"]
        assert error["code"] == "activation_engine_unconfigured"
        assert "vLLM-Lens plugin" in error["message"]
    assert stub.probes == 1  # asked once, remembered
    assert client.post("/v1/completions", json=BODY).status_code == 200
    assert [len(request.get("vllm_xargs", {})) for request in stub.requests] == [0]


@pytest.mark.parametrize(
    "fields, refused",
    [
        ({"scale": 1e30}, "values × scale reach 1e+30"),
        ({"scale": -2e6}, "values × scale reach 2e+06"),
        ({"scale": 2e6, "norm_match": True}, "scale (with norm_match) reach 2e+06"),
    ],
)
def test_steering_that_could_overflow_is_refused_before_any_upstream_work(
    client, stub, fields, refused
):
    """An infinite residual value leaves NaN in vLLM-Lens's KV cache, which then fails every
    later request of every user until it restarts (tests/vllm shows it)."""
    body = {**BODY, "apply_steering_vectors": [vector(1, **fields)]}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "invalid_request"
    assert f"'apply_steering_vectors.0': its {refused}; at most 1e+06" in error["message"]
    assert stub.requests == []
    within = {**BODY, "apply_steering_vectors": [vector(1, scale=1e6)]}
    assert client.post("/v1/completions", json=within).status_code == 200


def test_output_vllm_could_not_encode_is_the_upstreams_failure(client, stub):
    """vLLM answers 400 "Out of range float values are not JSON compliant" when its output
    holds NaN: from an upstream whose KV cache an earlier request left NaN."""
    message = "Out of range float values are not JSON compliant"
    stub.mode.update({"status": 400, "error": {"code": 400, "message": message}})
    for _ in range(5):
        response = client.post("/v1/completions", json=BODY)
        assert response.status_code == 502
        assert response.json()["error"]["code"] == "upstream_server_error"
    stub.mode.pop("status")
    refused = client.post("/v1/completions", json=BODY)
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "circuit_open"


@pytest.mark.parametrize(
    "max_tokens, positions, refused",
    [
        (2, [5], "'apply_steering_vectors.0.position_indices': Position 5 is a generated"),
        (2, [0], "Position 0 would also be steered at every generated token"),
        (1, [0, 4], None),
        (2, [1, 4], None),
    ],
)
def test_steering_by_position_reaches_the_prompt_only(client, stub, max_tokens, positions, refused):
    """vLLM-Lens counts every generated token as position 0: it cannot steer generated
    positions, and would add a position-0 vector to every generated token."""
    steering = vector(1, value=1.0, position_indices=positions)
    steering["activations"] = encode_vector(np.ones((1, len(positions), HIDDEN), np.float32))
    body = {**BODY, "max_tokens": max_tokens, "apply_steering_vectors": [steering]}
    response = client.post("/v1/completions", json=body)
    if refused is None:
        assert response.status_code == 200, response.text
        return
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "position_steering_unavailable"
    assert refused in error["message"]


def test_greedy_sampling_with_n_above_one_is_refused(client, stub):
    """vLLM refuses it; the engine would return n copies of one completion."""
    body = {**BODY, "n": 2, "temperature": 0}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_request"
    assert "temperature 0" in response.json()["error"]["message"]
    assert stub.requests == []


def test_a_client_cannot_send_vllm_xargs_of_its_own(client, stub):
    """vLLM-Lens runs pickled code from `vllm_xargs.apply_hooks`: never passed on."""
    body = {**BODY, "vllm_xargs": {"apply_hooks": "[]"}}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "Unknown field 'vllm_xargs'."
    assert stub.requests == []


def test_return_token_ids_is_vllms_own_field_and_reaches_the_upstream_as_sent(client, stub):
    response = client.post("/v1/completions", json={**BODY, "return_token_ids": True})
    assert response.status_code == 200, response.text
    assert stub.requests[-1]["return_token_ids"] is True
    refused = client.post("/v1/completions", json={**BODY, "return_token_ids": "yes"})
    assert refused.status_code == 400 and "return_token_ids" in refused.json()["error"]["message"]


SPECIAL = frozenset({"<|im_start|>", "<|im_end|>"})


def offsets_of(tokens: list[str], text: str, offsets: list[int]) -> list[int]:
    choice = {"text": text, "logprobs": {"tokens": tokens, "text_offset": offsets}}
    dialect.public_offsets(choice, SPECIAL)
    return choice["logprobs"]["text_offset"]


def test_a_generated_special_token_that_the_text_leaves_out_takes_no_room():
    # As vLLM answers `ignore_eos`: "<|im_end|>" counted at its length, absent from text.
    text = " Paris.\n"
    tokens = [" Paris", "<|im_end|>", ".", "\n"]
    assert offsets_of(tokens, text, [0, 6, 16, 17]) == [0, 6, 6, 7]


def test_an_echoed_special_token_that_the_text_holds_takes_its_length():
    # As the engine answered an echoed chat prompt: "<|im_start|>" at length 0.
    text = "<|im_start|>user\nHi"
    tokens = ["<|im_start|>", "user", "\n", "Hi"]
    offsets = offsets_of(tokens, text, [0, 0, 4, 5])
    assert offsets == [0, 12, 16, 17]
    assert [text[at : at + len(t)] for at, t in zip(offsets, tokens, strict=True)] == tokens


def test_a_stream_chunks_offsets_count_from_the_start_of_the_whole_text():
    # A chunk whose text begins at character 40 of the choice's text.
    assert offsets_of(["<|im_end|>", " x"], " x", [40, 50]) == [40, 40]
    assert offsets_of([" a", " b"], " a b", [40, 42]) == [40, 42]


def test_partial_characters_take_no_room_and_the_completing_token_takes_the_character():
    assert offsets_of([" caf", "", "é", "!"], " café!", [0, 4, 4, 5]) == [0, 4, 4, 5]
