"""Jobs asked for on the Jobs page: sent to /v1 by a worker with the user's playground key,
once per form submission, with an Idempotency-Key; the API's refusal kept."""

import datetime as dt
import json
import uuid

import httpx
import pytest
from django.conf import settings
from django.core.files.uploadedfile import SimpleUploadedFile
from django.utils import timezone

from accounts.services.playground_key import playground_key_get_or_create
from acs_client.responses import CompletionJob, HarvestJob
from acs_portal.celery import app as celery_app
from api.request_forms import ModelCapabilities
from infra.lifecycle import WorkStatus
from portal.jobs_forms import CompletionJobForm, HarvestJobForm
from portal.models import JobKind, JobSubmission
from portal.services import (
    job_submission_create,
    job_submission_send,
    job_submissions_fail_stuck,
)

from .conftest import MODEL
from .test_runs import error

COMPLETION = {"model": "smollm2-135m", "prompt": "Hello", "max_tokens": 4}
HARVEST = {
    "model": "smollm2-135m",
    "prompts": ["a", "b"],
    "layers": [7, 15],
    "add_special_tokens": True,
}
JOB_ID = "0b8f5a52-0f4e-4c55-9d8c-1d1f3cf0a001"


@pytest.fixture
def enqueued(monkeypatch):
    sent = []
    monkeypatch.setattr(
        celery_app, "send_task", lambda name, args, countdown=None: sent.append(args[0])
    )
    return sent


def _submission(user, kind, request):
    return job_submission_create(user=user, kind=kind, request=request, submit_token=uuid.uuid4())


def test_a_completion_job_is_sent_with_the_playground_key_and_an_idempotency_key(
    approved_user, gateway, enqueued
):
    submission = _submission(approved_user, JobKind.COMPLETION, COMPLETION)
    job = {"id": JOB_ID, "status": "queued", "created_at": 1_796_580_000}
    answer = CompletionJob(**job, started_at=None, finished_at=None, error=None)
    gateway.handler = lambda request: httpx.Response(202, json=answer.model_dump(mode="json"))
    job_submission_send(submission_id=submission.id)

    [sent] = gateway.requests
    assert sent.method == "POST" and sent.url.path == "/v1/completion-jobs"
    assert sent.headers["idempotency-key"] == str(submission.id)
    _, secret = playground_key_get_or_create(user=approved_user)
    assert sent.headers["authorization"] == f"Bearer {secret}"
    assert json.loads(sent.content) == COMPLETION
    submission.refresh_from_db()
    assert submission.status == WorkStatus.SUCCEEDED
    assert str(submission.job_id) == JOB_ID


def test_a_harvest_is_posted_to_v1_harvest_with_an_idempotency_key(
    approved_user, gateway, enqueued
):
    submission = _submission(approved_user, JobKind.HARVEST, HARVEST)
    answer = HarvestJob(
        job_id=JOB_ID,
        status="pending",
        model="smollm2-135m",
        layers=[7, 15, 22],
        n_prompts=2,
        progress={"prompts_done": 0, "n_prompts": 2},
        created_at=1_796_580_000,
        completed_at=None,
        error=None,
        message=None,
        result=None,
    )
    gateway.handler = lambda request: httpx.Response(202, json=answer.model_dump(mode="json"))
    job_submission_send(submission_id=submission.id)
    [sent] = gateway.requests
    assert sent.url.path == "/v1/harvest"
    assert sent.headers["idempotency-key"] == str(submission.id)
    assert json.loads(sent.content) == HARVEST
    submission.refresh_from_db()
    assert submission.status == WorkStatus.SUCCEEDED
    assert str(submission.job_id) == JOB_ID


def test_the_same_form_submission_makes_one_submission(approved_user, enqueued):
    token = uuid.uuid4()
    first = job_submission_create(
        user=approved_user, kind=JobKind.COMPLETION, request=COMPLETION, submit_token=token
    )
    again = job_submission_create(
        user=approved_user, kind=JobKind.COMPLETION, request=COMPLETION, submit_token=token
    )
    assert again.id == first.id
    assert JobSubmission.objects.count() == 1


def test_the_apis_refusal_is_kept_for_the_page(approved_user, gateway, enqueued):
    submission = _submission(approved_user, JobKind.COMPLETION, COMPLETION)
    gateway.handler = lambda request: error(429, "budget_exceeded")
    job_submission_send(submission_id=submission.id)
    submission.refresh_from_db()
    assert submission.status == WorkStatus.FAILED
    assert submission.error_code == "budget_exceeded"
    assert submission.error_message == "budget_exceeded happened"


def test_a_refusal_that_asks_to_retry_queues_the_submission_again(
    approved_user, gateway, monkeypatch
):
    submission = _submission(approved_user, JobKind.HARVEST, HARVEST)
    sent = []
    monkeypatch.setattr(
        celery_app, "send_task", lambda name, args, countdown=None: sent.append((*args, countdown))
    )
    gateway.handler = lambda request: error(429, "rate_limited", {"retry-after": "2"})
    job_submission_send(submission_id=submission.id)
    assert sent == [(str(submission.id), 2)]
    submission.refresh_from_db()
    assert (submission.status, submission.attempts) == (WorkStatus.QUEUED, 1)


def test_a_refusal_that_asks_to_retry_is_kept_after_the_last_retry(
    approved_user, gateway, enqueued
):
    submission = _submission(approved_user, JobKind.HARVEST, HARVEST)
    JobSubmission.objects.filter(pk=submission.pk).update(
        attempts=settings.PLAYGROUND_RUN_MAX_RETRIES
    )
    gateway.handler = lambda request: error(429, "rate_limited", {"retry-after": "2"})
    job_submission_send(submission_id=submission.id)
    submission.refresh_from_db()
    assert (submission.status, submission.error_code) == (WorkStatus.FAILED, "rate_limited")
    assert enqueued == []


@pytest.mark.parametrize(
    ("kind", "request_body"), [(JobKind.COMPLETION, COMPLETION), (JobKind.HARVEST, HARVEST)]
)
def test_a_job_is_resent_when_the_api_could_not_be_reached(
    approved_user, gateway, enqueued, kind, request_body
):
    """The job may have been created before the connection broke: the resend carries the
    same Idempotency-Key, so the API answers that job instead of making a second."""
    submission = _submission(approved_user, kind, request_body)

    def unreachable(request):
        raise httpx.ReadTimeout("no answer", request=request)

    gateway.handler = unreachable
    job_submission_send(submission_id=submission.id)
    submission.refresh_from_db()
    assert submission.status == WorkStatus.QUEUED
    assert enqueued == [str(submission.id)]


def test_a_submission_no_worker_sent_is_refused_by_the_sweep(approved_user, enqueued):
    stuck = _submission(approved_user, JobKind.COMPLETION, COMPLETION)
    JobSubmission.objects.filter(pk=stuck.pk).update(
        created_at=timezone.now() - dt.timedelta(hours=1)
    )
    fresh = _submission(approved_user, JobKind.COMPLETION, COMPLETION)
    assert job_submissions_fail_stuck() == 1
    stuck.refresh_from_db()
    fresh.refresh_from_db()
    assert (stuck.status, stuck.error_code) == (WorkStatus.FAILED, "not_sent")
    assert fresh.status == WorkStatus.QUEUED


# ---------------------------------------------------------------------------------------
# Forms


def _harvest_form(data, files=None):
    fields = {"harvest-model": "smollm2-135m", "harvest-layers": ["7", "15"], **data}
    return HarvestJobForm(
        fields, files or {}, models=[MODEL], capabilities=ModelCapabilities(MODEL)
    )


def test_the_harvest_form_ticks_no_layer_and_names_the_apis_default():
    form = HarvestJobForm(models=[MODEL], capabilities=ModelCapabilities(MODEL))
    assert not form.fields["layers"].initial
    assert len(form.fields["layers"].choices) == 30
    assert "None ticked: the API's default, layers 7, 15, 22" in form.fields["layers"].help_text
    assert "checked" not in str(form["layers"])


def test_the_harvest_body_has_exactly_the_ticked_layers():
    form = _harvest_form({"harvest-prompts": "a", "harvest-layers": ["0", "12", "29"]})
    assert form.is_valid(), form.errors
    assert form.to_request()["layers"] == [0, 12, 29]


def test_no_layer_ticked_leaves_the_layers_to_the_api():
    form = _harvest_form({"harvest-prompts": "a", "harvest-layers": []})
    assert form.is_valid(), form.errors
    assert "layers" not in form.to_request()


def test_pasted_prompts_one_per_line_make_the_harvest_body():
    form = _harvest_form({"harvest-prompts": "first\n\nsecond\n"})
    assert form.is_valid(), form.errors
    assert form.to_request() == {
        "model": "smollm2-135m",
        "prompts": ["first", "second"],
        "layers": [7, 15],
        "add_special_tokens": False,
    }


def test_a_jsonl_file_gives_strings_or_prompt_fields():
    lines = '"plain"\n{"prompt": "from an object"}\n\n'
    upload = SimpleUploadedFile("prompts.jsonl", lines.encode())
    form = _harvest_form({}, {"harvest-prompts_file": upload})
    assert form.is_valid(), form.errors
    assert form.to_request()["prompts"] == ["plain", "from an object"]


@pytest.mark.parametrize(
    ("data", "name", "content", "field", "message"),
    [
        ({}, None, None, "prompts", "Give at least one prompt"),
        ({"harvest-prompts": "a"}, "p.txt", "b", "prompts", "not both"),
        ({}, "p.jsonl", '"ok"\n{broken\n', "prompts_file", "Line 2 is not JSON."),
        ({}, "p.jsonl", '{"text": "x"}\n', "prompts_file", 'an object with a "prompt"'),
        ({}, "p.txt", "x\n" * 4097, "prompts_file", "At most 4,096 prompts"),
        ({"harvest-layers": ["30"], "harvest-prompts": "a"}, None, None, "layers", "30"),
    ],
)
def test_bad_harvest_input_is_a_field_error(data, name, content, field, message):
    files = {"harvest-prompts_file": SimpleUploadedFile(name, content.encode())} if name else {}
    form = _harvest_form(data, files)
    assert not form.is_valid()
    assert message in " ".join(form.errors[field])


def test_a_model_without_activation_capture_cannot_harvest():
    plain = {**MODEL, "capabilities": {**MODEL["capabilities"], "activations": False}}
    form = HarvestJobForm(
        {"harvest-model": "smollm2-135m", "harvest-prompts": "a", "harvest-layers": ["1"]},
        models=[plain],
        capabilities=ModelCapabilities(plain),
    )
    assert not form.is_valid()
    assert "does not support activation capture" in form.errors["model"][0]


def test_the_completion_job_form_has_no_streaming_and_checks_the_output_work_cap():
    form = CompletionJobForm(
        {
            "completion-model": "smollm2-135m",
            "completion-prompt": "a\nb",
            "completion-several_prompts": "on",
            "completion-n": "16",
            "completion-max_tokens": "1001",
        },
        models=[MODEL],
        capabilities=ModelCapabilities(MODEL),
    )
    assert "stream" not in form.fields
    assert not form.is_valid()
    assert "output-work cap" in form.errors["max_tokens"][0]
