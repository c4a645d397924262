"""Steering whose values times scale overflow the residual stream makes the model's logits NaN:
the engine answers 400 non_finite_output (reporting the work it did), never a token chosen
from NaN or a NaN in JSON (which JSON cannot carry)."""

import concurrent.futures

from conftest import MODEL

from acs_client.protocol import in_vllm_xargs
from tests.overflow import overflowing_steering, sse_payloads, strict_json

HIDDEN = 576
PROMPT = "Hello there"  # 2 tokens
LAST_LAYER = 29


def completion(**fields) -> dict:
    """A body with the activation fields as the gateway takes them, in the upstream dialect."""
    return in_vllm_xargs(
        {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "logprobs": 2, **fields}
    )


def assert_non_finite_error(error: dict) -> None:
    assert error["code"] == "non_finite_output"
    assert error["type"] == "invalid_request_error"
    assert "steering" in error["message"] and "lower the scale" in error["message"]


def test_overflowing_steering_is_a_400_with_the_prompt_billed(client):
    body = completion(apply_steering_vectors=overflowing_steering(HIDDEN))
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    answer = strict_json(response.text)
    assert_non_finite_error(answer["error"])
    assert answer["usage"] == {"prompt_tokens": 2, "completion_tokens": 0, "total_tokens": 2}


def test_overflow_at_a_generated_position_reports_the_tokens_before_it(client):
    # Positions 0-1 are the prompt; the third generated token sits at position 4, and the
    # logits computed from it (for the fourth token) are the first that overflow. The tokens
    # are sampled: ignore_eos keeps a sampled end of text (2% at the second token, seen)
    # from ending the completion before position 4.
    steering = overflowing_steering(HIDDEN, position_indices=[4])
    body = completion(max_tokens=6, ignore_eos=True, apply_steering_vectors=steering)
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    answer = strict_json(response.text)
    assert_non_finite_error(answer["error"])
    assert answer["usage"]["completion_tokens"] == 3


def test_overflowing_steering_ends_a_stream_with_an_error_frame(client):
    steering = overflowing_steering(HIDDEN, position_indices=[4])
    body = completion(max_tokens=6, ignore_eos=True, stream=True, apply_steering_vectors=steering)
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200
    payloads = sse_payloads(response.text)
    assert "[DONE]" not in payloads
    tokens = [
        choice["logprobs"]["tokens"] for frame in payloads[:-1] for choice in frame["choices"]
    ]
    assert len(tokens) == 3
    assert_non_finite_error(payloads[-1]["error"])


def test_prompt_logprobs_that_overflow_are_an_error_too(client):
    # Steering the last block at the first position only: the last position's logits stay
    # finite (nothing attends to that block's output), the first position's scores do not.
    steering = overflowing_steering(HIDDEN, layer=LAST_LAYER, position_indices=[0])
    body = completion(max_tokens=1, prompt_logprobs=1, apply_steering_vectors=steering)
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    assert_non_finite_error(strict_json(response.text)["error"])
    without_scores = completion(max_tokens=1, apply_steering_vectors=steering)
    assert client.post("/v1/completions", json=without_scores).status_code == 200


def test_a_batch_neighbour_of_an_overflowing_request_is_served(client):
    """Only the overflowing request fails; a request batched beside it completes."""
    plain = completion(max_tokens=8, temperature=0)
    steered = completion(max_tokens=8, apply_steering_vectors=overflowing_steering(HIDDEN))
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = list(
            pool.map(lambda body: client.post("/v1/completions", json=body), [plain, steered])
        )
    assert results[0].status_code == 200, results[0].text
    assert strict_json(results[0].text)["usage"]["completion_tokens"] == 8
    assert results[1].status_code == 400
