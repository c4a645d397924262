"""A completion job whose answer is non-finite, or whose result the database cannot hold,
fails once with a readable message and is billed once: the worker step against the real
engine, through the same completion path as /v1, on PostgreSQL. (It used to stay `running`,
be run again by the sweep and billed each time, then end as `worker_lost`.)"""

import json
from datetime import timedelta

import pytest
from django.utils import timezone

from api.jobs.models import CompletionJob
from api.jobs.services import completion_jobs
from infra.lifecycle import WorkStatus
from metering.models import UsageRecord
from tests.overflow import overflowing_steering

pytestmark = pytest.mark.django_db(transaction=True)

NUL_TOKEN = 190  # decodes to "\x00", which PostgreSQL's JSON cannot hold


def run_job(api_client, body: dict) -> CompletionJob:
    """Submit `body` as a job, run its worker step, then let the sweep look at it much later."""
    submitted = api_client.post(
        "/v1/completion-jobs",
        data=json.dumps(body),
        content_type="application/json",
        HTTP_IDEMPOTENCY_KEY="results-1",
    )
    assert submitted.status_code == 202, submitted.content
    job_id = submitted.json()["id"]
    completion_jobs.completion_job_execute(job_id=job_id)
    assert (
        completion_jobs.completion_jobs_recover_stuck(now=timezone.now() + timedelta(hours=1)) == 0
    )
    return CompletionJob.objects.get(pk=job_id)


def assert_failed_once_and_billed_once(api_client, job: CompletionJob, code: str) -> dict:
    assert (job.status, job.attempts) == (WorkStatus.FAILED, 1)
    status = api_client.get(f"/v1/completion-jobs/{job.pk}").json()
    assert status["status"] == "failed" and status["error"]["code"] == code
    result = api_client.get(f"/v1/completion-jobs/{job.pk}/result")
    assert result.status_code == job.answer[0]
    assert result.json()["error"]["code"] == code
    assert UsageRecord.objects.filter(endpoint="completion-jobs").count() == 1
    return status["error"]


def test_a_job_whose_steering_would_overflow_is_refused_at_submission(
    api_client, engine_model, redis_client
):
    body = {
        "model": "smollm2-135m",
        "prompt": "Hello there",
        "max_tokens": 6,
        "apply_steering_vectors": overflowing_steering(576),
    }
    refused = api_client.post(
        "/v1/completion-jobs",
        data=json.dumps(body),
        content_type="application/json",
        HTTP_IDEMPOTENCY_KEY="results-1",
    )
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "invalid_request"
    assert "overflows the residual stream" in refused.json()["error"]["message"]
    assert not CompletionJob.objects.exists()
    assert not UsageRecord.objects.exists()


def test_a_job_whose_result_the_database_refuses_fails_once_billed_once(
    api_client, engine_model, redis_client
):
    body = {"model": "smollm2-135m", "prompt": [81, NUL_TOKEN, 82], "max_tokens": 2, "echo": True}
    job = run_job(api_client, body)
    error = assert_failed_once_and_billed_once(api_client, job, "result_unstorable")
    record = UsageRecord.objects.get()
    assert "could not be stored" in error["message"] and record.request_id in error["message"]
    assert (record.prompt_tokens, record.completion_tokens) == (3, 2)
