"""NaN and ±Infinity never reach a response body: an upstream that writes NaN anyway (as
Python's json does) is a 400 non_finite_output, or its in-band frame in a stream, the tokens
the upstream computed billed once; steering that would overflow the model is refused before
any upstream work."""

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
    # Its prompt was prefilled: billed as the same request without streaming is.
    assert record.prompt_tokens == 1


@pytest.mark.parametrize("stream", [False, True])
def test_overflowing_steering_is_refused_before_the_engine_runs(client, engine_model, stream):
    """Its logits would be NaN (the engine answers non_finite_output; vLLM-Lens keeps NaN in
    its KV cache): the gateway refuses values × scale beyond 1e6, nothing billed."""
    body = {**ENGINE_BODY, "stream": stream, "apply_steering_vectors": overflowing_steering(576)}
    response = client.post("/v1/completions", json=body, timeout=120)
    assert response.status_code == 400, response.text
    error = strict_json(response.text)["error"]
    assert error["code"] == "invalid_request"
    assert "overflows the residual stream" in error["message"]
    record = usage_record()
    assert (record.status_code, record.prompt_tokens, record.completion_tokens) == (400, 0, 0)
