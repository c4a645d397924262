"""Every answer of the live gateway (in front of the stub upstream) is the response model that
its path, method and status refer to in /v1/openapi.json. The document is generated from the
models of `acs_client.responses` and the views build their bodies through the same models;
these tests catch what could still drift: a status the document does not list, a `$ref` to
another model, a field the answer has and the document lacks or the other way round, a
documented answer no test produces."""

import json
from pathlib import Path
from typing import get_args

import httpx
import pytest
from django.utils import timezone

from acs_client import responses
from api import openapi
from api.jobs import tasks
from api.jobs.models import HarvestJob
from api.jobs.storage import MANIFEST_NAME, STATS_NAME
from api.models import ModelStatus
from infra.lifecycle import WorkStatus
from tests.jobs.conftest import media_root, sent_tasks  # noqa: F401 (fixtures)

MISSING_JOB = "00000000-0000-0000-0000-000000000000"
# Answers of the embedded engine recorded for the playground's tests.
RECORDED = Path(__file__).parents[1] / "playground" / "fixtures"


class Answers:
    """Sends the scenario's requests and keeps each answer with the documented path (the
    template, `/v1/harvest/{job_id}`) and method it answers."""

    def __init__(self, http: httpx.Client):
        self.http = http
        self.seen: list[tuple[str, str, httpx.Response]] = []

    def send(self, method: str, template: str, path: str = "", **kwargs) -> httpx.Response:
        response = self.http.request(method, path or template, **kwargs)
        self.seen.append((template, method.lower(), response))
        return response


def documented_model(document: dict, template: str, method: str, response: httpx.Response):
    """The component name and response model the document gives this answer's path, method,
    status and media type (KeyError where it documents none)."""
    answer = document["paths"][template][method]["responses"][str(response.status_code)]
    media_type = response.headers["content-type"].split(";")[0]
    name = answer["content"][media_type]["schema"]["$ref"].rsplit("/", 1)[1]
    model = {openapi.component_name(m): m for m in openapi.RESPONSE_MODELS}[name]
    return name, model


def assert_documented(document: dict, template: str, method: str, response: httpx.Response):
    """The answer validates by the model its path and status refer to (a stream: each
    frame, an error frame by the error envelope); the component is that model's schema; a
    body the gateway writes itself has exactly the fields its schema lists, all required."""
    where = f"{method.upper()} {template} → {response.status_code}"
    name, model = documented_model(document, template, method, response)
    schema = document["components"]["schemas"][name]
    assert set(schema["properties"]) == set(model.model_fields), where
    if response.headers["content-type"].startswith("text/event-stream"):
        frames = [json.loads(line[6:]) for line in response.text.splitlines() if line[6:7] == "{"]
        assert frames, where
        frame_models = [responses.ErrorResponse if "error" in f else model for f in frames]
    else:
        frames, frame_models = [response.json()], [model]
    for frame, frame_model in zip(frames, frame_models, strict=True):
        frame_model.model_validate(frame)
        if issubclass(frame_model, responses.GatewayBody):
            fields = document["components"]["schemas"][openapi.component_name(frame_model)]
            assert set(frame) == set(fields["properties"]) == set(fields["required"]), where


def _models_and_usage(answers: Answers) -> None:
    answers.send("GET", "/v1/models")
    answers.send("GET", "/v1/models/{model_id}", "/v1/models/stub-model")
    assert answers.send("GET", "/v1/models/{model_id}", "/v1/models/nope").status_code == 400
    answers.send("GET", "/v1/models/{model_id}/status", "/v1/models/stub-model/status")
    answers.send("GET", "/v1/usage")
    assert answers.send("GET", "/v1/usage", headers={"Authorization": ""}).status_code == 401


def _completions(answers: Answers, stub) -> None:
    stub.mode["logprob"] = -0.5
    body = {"prompt": "the capital", "max_tokens": 2, "logprobs": 1, "prompt_logprobs": 1}
    plain = answers.send("POST", "/v1/completions", json=body).json()
    assert plain["choices"][0]["logprobs"] and plain["choices"][0]["prompt_logprobs"]
    captured = answers.send(
        "POST", "/v1/completions", json={**body, "output_residual_stream": [3, 1]}
    )
    assert captured.json()["activations"]["residual_stream"]["shape"][0] == 2
    # Prompt logprobs come with a whole answer only.
    streamed = {**body, "prompt_logprobs": None, "stream": True}
    streamed["stream_options"] = {"include_usage": True}
    assert "[DONE]" in answers.send("POST", "/v1/completions", json=streamed).text
    stub.mode["stream_error_after"] = 1
    assert "vllm_oom" in answers.send("POST", "/v1/completions", json=streamed).text
    del stub.mode["stream_error_after"]
    assert answers.send("POST", "/v1/completions", json={**body, "bogus": 1}).status_code == 400
    assert answers.send("POST", "/v1/chat/completions", json={}).status_code == 400


def _completion_jobs(answers: Answers, stub) -> None:
    body = {"prompt": "hello", "max_tokens": 2}
    once = {"Idempotency-Key": "schemas-1"}
    job_id = answers.send("POST", "/v1/completion-jobs", json=body, headers=once).json()["id"]
    assert answers.send("POST", "/v1/completion-jobs", json=body, headers=once).status_code == 200
    reused = answers.send(
        "POST", "/v1/completion-jobs", json={**body, "max_tokens": 3}, headers=once
    )
    assert reused.status_code == 409
    job, result = "/v1/completion-jobs/{job_id}", "/v1/completion-jobs/{job_id}/result"
    answers.send("GET", job, f"/v1/completion-jobs/{job_id}")
    assert answers.send("GET", result, f"/v1/completion-jobs/{job_id}/result").status_code == 202
    tasks.completion_job_run_task.apply((job_id,)).get()
    assert answers.send("GET", result, f"/v1/completion-jobs/{job_id}/result").status_code == 200
    assert answers.send("GET", job, f"/v1/completion-jobs/{job_id}").json()["finished_at"]
    assert answers.send("GET", job, f"/v1/completion-jobs/{MISSING_JOB}").status_code == 404

    stub.mode.update(status=400, error={"code": "bad_prompt", "message": "no"})
    failing = {"Idempotency-Key": "schemas-2"}
    failed_id = answers.send("POST", "/v1/completion-jobs", json=body, headers=failing).json()["id"]
    tasks.completion_job_run_task.apply((failed_id,)).get()
    assert answers.send("GET", job, f"/v1/completion-jobs/{failed_id}").json()["error"]
    assert answers.send("GET", result, f"/v1/completion-jobs/{failed_id}/result").status_code == 400


def _harvests(answers: Answers) -> None:
    body = {"model": "stub-model", "prompts": ["hello there", "the capital"], "layers": [1, 3]}
    once = {"Idempotency-Key": "schemas-h"}
    job_id = answers.send("POST", "/v1/harvest", json=body, headers=once).json()["job_id"]
    assert answers.send("POST", "/v1/harvest", json=body, headers=once).status_code == 200
    reused = answers.send("POST", "/v1/harvest", json={**body, "layers": [1]}, headers=once)
    assert reused.status_code == 409
    job = "/v1/harvest/{job_id}"
    answers.send("GET", job, f"/v1/harvest/{job_id}")
    assert answers.send("DELETE", job, f"/v1/harvest/{job_id}").json()["status"] == "cancelled"
    assert answers.send("DELETE", job, f"/v1/harvest/{job_id}").status_code == 409
    HarvestJob.objects.filter(pk=job_id).update(status=WorkStatus.EXPIRED)
    assert answers.send("GET", job, f"/v1/harvest/{job_id}").json()["message"]
    assert answers.send("GET", job, f"/v1/harvest/{MISSING_JOB}").status_code == 404

    done_id = answers.send("POST", "/v1/harvest", json=body).json()["job_id"]
    HarvestJob.objects.filter(pk=done_id).update(
        status=WorkStatus.SUCCEEDED,
        prompts_done=2,
        finished_at=timezone.now(),
        files=["shard-00000.safetensors", STATS_NAME, MANIFEST_NAME],
    )
    assert answers.send("GET", job, f"/v1/harvest/{done_id}").json()["result"]["shard_urls"]


@pytest.mark.django_db(transaction=True)
def test_every_v1_answer_is_the_model_its_path_and_status_document(client, stub, gateway_url):
    document = httpx.get(f"{gateway_url}/v1/openapi.json").json()
    answers = Answers(client)
    _models_and_usage(answers)
    _completions(answers, stub)
    _completion_jobs(answers, stub)
    _harvests(answers)
    for template, method, response in answers.seen:
        assert_documented(document, template, method, response)
    documented = {
        (path, method, status)
        for path, operations in document["paths"].items()
        for method, operation in operations.items()
        for status, answer in operation["responses"].items()
        if status.startswith("2") and "content" in answer
    }
    produced = {
        (path, method, str(response.status_code)) for path, method, response in answers.seen
    }
    assert documented - produced == set(), "documented answers no test produced"


@pytest.mark.django_db(transaction=True)
def test_the_model_status_answer_has_exactly_its_documented_fields(client, gateway_url):
    document = httpx.get(f"{gateway_url}/v1/openapi.json").json()
    documented = document["paths"]["/v1/models/{model_id}/status"]["get"]["responses"]["200"]
    schema_ref = documented["content"]["application/json"]["schema"]["$ref"]
    schemas = document["components"]["schemas"]
    schema = schemas[schema_ref.rsplit("/", 1)[1]]
    body = client.get("/v1/models/stub-model/status").json()
    assert set(body) == set(schema["properties"]) == set(schema["required"])
    assert set(body) == {"id", "object", "status", "warm", "upstreams"}
    assert set(body["upstreams"][0]) == set(schemas["UpstreamHealth"]["properties"])


def test_the_wire_states_are_the_database_states():
    def states(model) -> set[str]:
        return set(get_args(model.model_fields["status"].annotation))

    assert states(responses.ModelStatus) == states(responses.ModelCard) == set(ModelStatus.values)
    # A completion job is never cancelled, nor expired (it is deleted instead).
    assert states(responses.CompletionJob) == set(WorkStatus.values) - {"cancelled", "expired"}
    # The harvest API keeps its words for queued and succeeded (HarvestJob.public_status).
    public = {HarvestJob(status=status).public_status for status in WorkStatus.values}
    assert states(responses.HarvestJob) == public
    assert public == {"pending", "running", "done", "failed", "cancelled", "expired"}


def test_recorded_engine_answers_are_completion_responses_and_keep_what_vllm_adds():
    for name in ("capture.json", "completion_logprobs.json", "full_vocab_trimmed.json"):
        responses.CompletionResponse.model_validate_json((RECORDED / name).read_text())
    stream = (RECORDED / "stream.txt").read_text().splitlines()
    for frame in [line[6:] for line in stream if line[6:7] == "{"]:
        responses.CompletionStreamChunk.model_validate_json(frame)
    vllm_fields = {"system_fingerprint": None, "service_tier": None, "kv_transfer_params": None}
    capture = json.loads((RECORDED / "capture.json").read_text())
    relayed = responses.CompletionResponse.model_validate({**capture, **vllm_fields})
    assert relayed.model_extra == vllm_fields
