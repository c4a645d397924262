"""NaN and ±Infinity never reach a response body: steering that overflows the model (the
embedded engine answers 400 non_finite_output) and an upstream that writes NaN anyway (as
Python's json, and so a vLLM server, does) are both a 400 non_finite_output, or its in-band
frame in a stream; the tokens the upstream computed are billed once."""

import math

import pytest

from api.models import LanguageModel
from api.selectors import registry_clear
from metering.models import UsageRecord
from tests.conftest import ENGINE_MODEL_FIELDS
from tests.overflow import overflowing_steering, sse_payloads, strict_json

from .conftest import wait_settled

pytestmark = pytest.mark.django_db(transaction=True)

STUB_BODY = {"model": "stub-model", "prompt": "hello", "max_tokens": 2, "logprobs": 1}
# Greedy (", I'm glad to have"): a sampled end of text (1.4% at the third token, seen) ended the
# completion before the steered position 4 was reached.
ENGINE_BODY = {
    "model": "smollm2-135m",
    "prompt": "Hello there",
    "max_tokens": 6,
    "logprobs": 1,
    "temperature": 0,
}


@pytest.fixture
def engine_model(engine_url, model):
    LanguageModel.objects.create(
        name="smollm2-135m", upstream_urls=[engine_url], **ENGINE_MODEL_FIELDS
    )
    registry_clear()
    yield "smollm2-135m"
    wait_settled()


def usage_record() -> UsageRecord:
    wait_settled()
    return UsageRecord.objects.get()


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_numbers_from_an_upstream_are_a_400_never_invalid_json(client, stub, value):
    stub.mode["logprob"] = value
    response = client.post("/v1/completions", json=STUB_BODY)
    assert response.status_code == 400, response.text
    error = strict_json(response.text)["error"]
    assert error["code"] == "non_finite_output"
    assert "NaN or infinite" in error["message"]
    assert response.headers["x-should-retry"] == "false"
    record = usage_record()
    assert (record.status_code, record.error_code) == (400, "non_finite_output")
    # Billed for what the upstream says it computed: 1 prompt token, 2 generated.
    assert (record.prompt_tokens, record.completion_tokens) == (1, 2)


def test_non_finite_numbers_in_an_upstream_stream_end_it_with_an_error_frame(client, stub):
    stub.mode["logprob"] = math.nan
    response = client.post("/v1/completions", json={**STUB_BODY, "stream": True})
    assert response.status_code == 200
    payloads = sse_payloads(response.text)
    assert [payload["error"]["code"] for payload in payloads] == ["non_finite_output"]
    record = usage_record()
    # The request log shows how the stream ended, not the 200 it opened with.
    assert (record.status_code, record.error_code) == (400, "non_finite_output")
    assert record.completion_tokens == 0  # the client received none


def test_overflowing_steering_through_the_gateway_is_a_400_billed_for_its_work(
    client, engine_model
):
    steering = overflowing_steering(576, position_indices=[4])
    response = client.post(
        "/v1/completions", json={**ENGINE_BODY, "apply_steering_vectors": steering}, timeout=120
    )
    assert response.status_code == 400, response.text
    error = strict_json(response.text)["error"]
    assert error["code"] == "non_finite_output"
    assert "steering" in error["message"]
    record = usage_record()
    assert (record.status_code, record.error_code) == (400, "non_finite_output")
    # Two prompt tokens, and the three tokens generated before the logits overflowed.
    assert (record.prompt_tokens, record.completion_tokens) == (2, 3)


def test_overflowing_steering_through_the_gateway_ends_a_stream_with_an_error_frame(
    client, engine_model
):
    steering = overflowing_steering(576, position_indices=[4])
    body = {**ENGINE_BODY, "stream": True, "apply_steering_vectors": steering}
    response = client.post("/v1/completions", json=body, timeout=120)
    assert response.status_code == 200
    payloads = sse_payloads(response.text)
    assert "[DONE]" not in payloads
    received = sum(
        len(choice["logprobs"]["tokens"]) for frame in payloads[:-1] for choice in frame["choices"]
    )
    assert received == 3
    assert payloads[-1]["error"]["code"] == "non_finite_output"
    record = usage_record()
    # The request log shows how the stream ended, not the 200 it opened with.
    assert (record.status_code, record.error_code) == (400, "non_finite_output")
    assert (record.prompt_tokens, record.completion_tokens) == (2, 3)
