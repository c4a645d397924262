"""Each typed method of `AcsClient` against the live gateway and the stub upstream, as Ada (an
approved researcher with a key) uses it: typed results equal the raw JSON the gateway serves,
errors carry the API's code and status, and the polling helpers wait and show progress."""

import datetime as dt
import json

import httpx
import numpy as np
import pytest

from acs_client.client import AcsApiError, AcsClient, AsyncAcsClient, steering_vector
from acs_client.codec import decode, encode_vector
from acs_client.results import Completion, Model
from api.jobs import tasks
from tests.gateway.conftest import wait_settled

pytestmark = pytest.mark.django_db(transaction=True)

JOB_RUN = "api.jobs.tasks.completion_job_run_task"


@pytest.fixture
def ada(gateway_url, api_secret, model):
    """Ada's client, on the live gateway whose default model is the stub's."""
    return AcsClient(base_url=gateway_url, api_key=api_secret)


@pytest.fixture
def raw(gateway_url, api_secret):
    """The same key through plain httpx: the JSON the typed results must mirror."""
    with httpx.Client(
        base_url=gateway_url, headers={"Authorization": f"Bearer {api_secret}"}, timeout=30
    ) as http:
        yield http


def test_models_mirror_the_model_list_with_capabilities(ada, raw):
    [model] = ada.models()
    [wire] = raw.get("/v1/models").json()["data"]
    assert (model.id, model.status, model.default) == ("stub-model", "live", True)
    assert model.raw == wire
    assert model.capabilities.n_layers == wire["capabilities"]["n_layers"] == 4
    assert model.capabilities.hidden_size == 8
    assert model.capabilities.activations is True
    assert model.capabilities.max_steering_vectors == wire["capabilities"]["max_steering_vectors"]
    assert ada.model("stub-model") == model


def test_fields_a_newer_server_adds_stay_in_raw_and_break_nothing(ada, raw):
    wire = raw.get("/v1/models/stub-model").json()
    newer = {**wire, "region": "eu", "capabilities": {**wire["capabilities"], "max_lora": 0}}
    model = Model.from_wire(newer)
    assert model.raw == newer
    assert model.model_dump(mode="json") == wire == ada.model("stub-model").raw


def test_an_unknown_model_raises_its_code_status_and_request_id(ada):
    with pytest.raises(AcsApiError) as caught:
        ada.model("no-such-model")
    assert (caught.value.status, caught.value.code) == (400, "model_not_found")
    assert caught.value.request_id
    assert caught.value.should_retry is False


def test_model_status_says_warm_when_the_upstream_has_it_loaded(ada, stub):
    status = ada.model_status("stub-model")
    assert (status.id, status.warm) == ("stub-model", True)
    stub.mode["healthy"] = False
    assert ada.model_status("stub-model").warm is False


def test_completion_has_typed_choices_logprobs_and_usage(ada, stub):
    stub.mode["logprob"] = -0.5
    body = {"model": "stub-model", "prompt": "Hello there", "max_tokens": 8}
    # Keyword fields are merged into the body and win over it.
    result = ada.completions(body, max_tokens=3, logprobs=2, temperature=0)
    assert stub.requests[-1]["max_tokens"] == 3
    assert stub.requests[-1]["logprobs"] == 2
    assert result.text == " tok tok tok" == result.body["choices"][0]["text"]
    [choice] = result.choices
    assert (choice.index, choice.finish_reason) == (0, "length")
    assert choice.logprobs.tokens == result.body["choices"][0]["logprobs"]["tokens"]
    assert choice.logprobs.token_logprobs == [-0.5] * 3
    assert choice.logprobs.text_offset == [0, 4, 8]
    usage = result.usage
    assert usage.completion_tokens == 3
    assert usage.prompt_tokens == stub.count("Hello there")
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert result.request_id
    assert result.residual_stream() is None


def test_stream_completions_asks_for_a_stream_and_yields_its_frames(ada, stub):
    with ada.stream_completions(
        model="stub-model", prompt="Hi", max_tokens=2, stream_options={"include_usage": True}
    ) as stream:
        frames = list(stream)
    assert stub.requests[-1]["stream"] is True
    assert stream.done
    assert "".join(c["text"] for frame in frames for c in frame["choices"]) == " tok tok"
    assert frames[-1]["usage"]["completion_tokens"] == 2


def test_steering_vector_is_sent_as_the_codec_object_the_gateway_accepts(ada, stub):
    row = np.linspace(-1, 1, 8, dtype=np.float32)
    entry = steering_vector(row, layers=[1, 2], scale=2.5, positions=[0])
    ada.completions(model="stub-model", prompt="Hi", max_tokens=1, apply_steering_vectors=[entry])
    [sent] = json.loads(stub.requests[-1]["vllm_xargs"]["apply_steering_vectors"])
    assert (sent["layer_indices"], sent["scale"], sent["position_indices"]) == ([1, 2], 2.5, [0])
    # Each layer gets the row, rounded to bfloat16 (the top 16 bits of the float32 value), at
    # its one position: the gateway sends a 2-D vector with positions as the 3-D it means.
    rounded = (row.view(np.uint32) + 0x7FFF + ((row.view(np.uint32) >> 16) & 1)) >> 16
    expected = (rounded.astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(decode(sent["activations"]), np.stack([[expected], [expected]]))


def test_a_steering_vector_of_the_wrong_hidden_size_is_refused_before_any_model_work(ada, stub):
    entry = steering_vector(np.ones(5), layers=[1])
    with pytest.raises(AcsApiError) as caught:
        ada.completions(
            model="stub-model", prompt="Hi", max_tokens=1, apply_steering_vectors=[entry]
        )
    assert (caught.value.status, caught.value.code) == (400, "invalid_request")
    assert "hidden size 5" in caught.value.message
    assert stub.requests == []


def test_residual_stream_decodes_the_capture_of_the_response():
    values = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)  # exact in bfloat16
    body = {"choices": [], "activations": {"residual_stream": encode_vector(values)}}
    np.testing.assert_array_equal(Completion(body=body).residual_stream(), values)


def test_usage_windows_mirror_the_usage_endpoint(ada, raw, api_key):
    ada.completions(model="stub-model", prompt="Hello there", max_tokens=2)
    wait_settled()
    usage = ada.usage()
    wire = raw.get("/v1/usage").json()
    assert (usage.key_prefix, usage.key_name) == (api_key.prefix, "first key")
    assert [w.name for w in usage.windows] == [w["name"] for w in wire["windows"]]
    for window, entry in zip(usage.windows, wire["windows"], strict=True):
        assert (window.used, window.limit, window.remaining) == (
            entry["used"],
            entry["limit"],
            entry["remaining"],
        )
        assert window.resets_at == dt.datetime.fromisoformat(entry["resets_at"])
        assert window.resets_at.tzinfo is not None


def test_completion_job_is_submitted_polled_and_its_result_read(ada, stub, sent_tasks, capsys):
    job = ada.submit_completion_job(model="stub-model", prompt="Hello", max_tokens=2)
    assert job.status == "queued" and not job.ended
    assert ada.completion_job(job.id).status == "queued"
    assert ada.completion_job_result(job.id) is None
    # The result endpoint asks to come back in 2 s: a shorter timeout gives up at once.
    with pytest.raises(TimeoutError):
        ada.wait_for_job(job.id, timeout=0.5, progress=False)

    assert sent_tasks.ids(JOB_RUN) == [job.id]
    tasks.completion_job_run_task.apply((job.id,)).get()
    result = ada.wait_for_job(job.id, progress=True)
    assert result.text == " tok tok"
    assert result.usage.completion_tokens == 2
    finished = ada.completion_job(job.id)
    assert finished.status == "succeeded" and finished.ended
    assert finished.finished_at >= finished.created_at
    bar = capsys.readouterr().err
    assert f"completion job {job.id[:8]}" in bar and "succeeded" in bar


def test_completion_job_idempotency_key_returns_the_same_job_or_a_conflict(ada, sent_tasks):
    body = {"model": "stub-model", "prompt": "Hello", "max_tokens": 2}
    first = ada.submit_completion_job(body, idempotency_key="ada-1")
    assert ada.submit_completion_job(body, idempotency_key="ada-1").id == first.id
    with pytest.raises(AcsApiError) as caught:
        ada.submit_completion_job(body, idempotency_key="ada-1", max_tokens=3)
    assert (caught.value.status, caught.value.code) == (409, "idempotency_key_reused")
    # Without a key each submit is a new job.
    assert ada.submit_completion_job(body).id != ada.submit_completion_job(body).id


def test_a_failed_completion_job_raises_its_stored_error(ada, stub, sent_tasks):
    job = ada.submit_completion_job(model="stub-model", prompt="Hello", max_tokens=2)
    stub.mode.update(status=400, error={"code": "bad_prompt", "message": "no"})
    tasks.completion_job_run_task.apply((job.id,)).get()
    with pytest.raises(AcsApiError) as caught:
        ada.wait_for_job(job.id, progress=False)
    assert caught.value.status == 400
    failed = ada.completion_job(job.id)
    assert failed.status == "failed"
    assert (failed.error.code, failed.error.message) == (caught.value.code, caught.value.message)


def test_harvest_is_submitted_read_and_cancelled(ada, sent_tasks, capsys):
    job = ada.submit_harvest(model="stub-model", prompts=["Hello there.", "Again."], layers=[1, 3])
    assert (job.status, job.model, job.n_prompts, job.layers) == (
        "pending",
        "stub-model",
        2,
        [1, 3],
    )
    read = ada.harvest(job.job_id)
    assert (read.layers, read.prompts_done, read.files) == ([1, 3], 0, None)
    assert read.created_at.tzinfo is not None
    with pytest.raises(ValueError, match="no files"):
        ada.download_harvest(read, "unused")

    cancelled = ada.cancel_harvest(job.job_id)
    assert cancelled.status == "cancelled" and cancelled.ended
    assert ada.wait_for_harvest(job.job_id, progress=True).status == "cancelled"
    assert f"harvest {job.job_id[:8]}" in capsys.readouterr().err
    with pytest.raises(AcsApiError) as caught:
        ada.cancel_harvest(job.job_id)
    assert (caught.value.status, caught.value.code) == (409, "harvest_not_cancellable")


def test_another_users_or_an_unknown_job_is_not_found(ada):
    with pytest.raises(AcsApiError) as caught:
        ada.harvest("00000000-0000-0000-0000-000000000000")
    assert (caught.value.status, caught.value.code) == (404, "not_found")
    with pytest.raises(AcsApiError) as caught:
        ada.completion_job("00000000-0000-0000-0000-000000000000")
    assert caught.value.code == "not_found"


async def test_async_client_has_the_same_typed_operations(
    gateway_url, api_secret, model, sent_tasks
):
    client = AsyncAcsClient(base_url=gateway_url, api_key=api_secret)
    [listed] = await client.models()
    assert listed == await client.model("stub-model")
    assert (await client.model_status("stub-model")).warm is True
    result = await client.completions(model="stub-model", prompt="Hello", max_tokens=2)
    assert result.usage.completion_tokens == 2
    job = await client.submit_completion_job(model="stub-model", prompt="Hello", max_tokens=2)
    assert (await client.completion_job(job.id)).status == "queued"
    assert await client.completion_job_result(job.id) is None
    harvest = await client.submit_harvest(model="stub-model", prompts=["Hello there."])
    assert (await client.harvest(harvest.job_id)).layers == [1, 2, 3]
    assert (await client.cancel_harvest(harvest.job_id)).status == "cancelled"
    assert (await client.usage()).windows[0].name == "key_monthly"


@pytest.mark.parametrize(
    ("should_retry", "retry_after", "expected"),
    [(True, 2.0, 2.0), (True, 30.0, None), (False, 2.0, None), (True, None, 1)],
)
def test_an_error_says_when_to_send_again_within_the_wait_a_caller_accepts(
    should_retry, retry_after, expected
):
    error = AcsApiError(
        status=503, code="upstream_unavailable", message="m", retry_after=retry_after,
        should_retry=should_retry,
    )  # fmt: skip
    assert error.retry_in(at_most=10) == expected
