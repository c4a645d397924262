"""POST /v1/completion-jobs and its status and result endpoints, the worker step (against the
real engine), idempotency under real concurrency, the stuck-job sweep and the 24-hour expiry."""

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
from asgiref.sync import async_to_sync
from django.db import connection
from django.utils import timezone

from accounts.services.keys import api_key_create
from api.admission import admission_counts
from api.completions import CompletionResult
from api.errors import ApiError
from api.jobs import tasks
from api.jobs.models import CompletionJob
from api.jobs.services import completion_jobs
from infra.lifecycle import WorkStatus

BODY = {"model": "smollm2-135m", "prompt": "The capital of France is", "max_tokens": 2}
JOB_RUN = "api.jobs.tasks.completion_job_run_task"

pytestmark = pytest.mark.django_db(transaction=True)


def _submit(api_client, body=BODY, key="job-1", **headers):
    extra = {"HTTP_IDEMPOTENCY_KEY": key} if key is not None else {}
    return api_client.post(
        "/v1/completion-jobs",
        data=json.dumps(body),
        content_type="application/json",
        **extra,
        **headers,
    )


def test_submit_without_idempotency_key_is_refused_naming_the_header(api_client, engine_model):
    response = _submit(api_client, key=None)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_request"
    assert "Idempotency-Key" in response.json()["error"]["message"]
    assert not CompletionJob.objects.exists()


def test_submit_is_validated_like_completions(api_client, engine_model):
    response = _submit(api_client, body={**BODY, "temperatur": 0.5})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_request"
    assert "temperatur" in response.json()["error"]["message"]
    response = _submit(api_client, body={**BODY, "model": "no-such-model"})
    assert response.json()["error"]["code"] == "model_not_found"
    response = _submit(api_client, body={**BODY, "n": 2, "max_tokens": 16_001})
    assert response.status_code == 400
    assert not CompletionJob.objects.exists()


def test_stream_is_not_allowed_in_a_job(api_client, engine_model):
    response = _submit(api_client, body={**BODY, "stream": True})
    assert response.status_code == 400
    assert "stream" in response.json()["error"]["message"]
    assert not CompletionJob.objects.exists()


def test_submit_without_a_key_is_401(client, engine_model):
    response = _submit(client)
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "missing_authorization"


def test_submit_returns_202_and_enqueues_once(api_client, engine_model, sent_tasks):
    response = _submit(api_client)
    assert response.status_code == 202
    body = response.json()
    assert body["object"] == "completion_job"
    assert body["status"] == "queued"
    assert isinstance(body["created_at"], int)
    assert response["X-Request-Id"]
    assert sent_tasks.ids(JOB_RUN) == [body["id"]]


def test_same_key_and_same_body_returns_the_existing_job(api_client, engine_model, sent_tasks):
    first = _submit(api_client)
    reordered = dict(reversed(list(BODY.items())))
    again = _submit(api_client, body=reordered)
    assert again.status_code == 200
    assert again.json()["id"] == first.json()["id"]
    assert CompletionJob.objects.count() == 1
    assert len(sent_tasks.ids(JOB_RUN)) == 1


def test_same_key_with_another_body_is_409(api_client, engine_model):
    _submit(api_client)
    response = _submit(api_client, body={**BODY, "max_tokens": 3})
    assert response.status_code == 409
    assert response.json()["error"]["code"] == "idempotency_key_reused"
    assert response["X-Should-Retry"] == "false"


def test_idempotency_keys_belong_to_a_user_not_a_key(api_client, engine_model, approved_user):
    first = _submit(api_client)
    _, second_secret = api_key_create(user=approved_user, name="second", acting_user=None)
    again = _submit(api_client, HTTP_AUTHORIZATION=f"Bearer {second_secret}")
    assert again.status_code == 200
    assert again.json()["id"] == first.json()["id"]


def test_twenty_concurrent_submits_with_one_key_create_exactly_one_job(api_key, sent_tasks):
    start = threading.Barrier(20)

    def submit(_):
        try:
            start.wait()
            job, created = completion_jobs.completion_job_submit(
                key=api_key, idempotency_key="race", payload=dict(BODY)
            )
            return str(job.pk), created
        finally:
            connection.close()

    with ThreadPoolExecutor(max_workers=20) as pool:
        outcomes = list(pool.map(submit, range(20)))

    assert CompletionJob.objects.count() == 1
    assert {job_id for job_id, _ in outcomes} == {str(CompletionJob.objects.get().pk)}
    assert sum(created for _, created in outcomes) == 1
    assert len(sent_tasks.ids(JOB_RUN)) == 1


def test_result_is_202_with_retry_after_until_done_then_the_completion(
    api_client, engine_model, redis_client
):
    job_id = _submit(api_client).json()["id"]
    pending = api_client.get(f"/v1/completion-jobs/{job_id}/result")
    assert pending.status_code == 202
    assert int(pending["Retry-After"]) > 0
    assert pending.json()["status"] == "queued"

    tasks.completion_job_run_task.apply((job_id,)).get()

    status = api_client.get(f"/v1/completion-jobs/{job_id}").json()
    assert status["status"] == "succeeded"
    assert status["started_at"] and status["finished_at"]
    assert status["error"] is None
    result = api_client.get(f"/v1/completion-jobs/{job_id}/result")
    assert result.status_code == 200
    completion = result.json()
    assert completion["object"] == "text_completion"
    assert completion["usage"]["completion_tokens"] == 2
    assert len(completion["choices"]) == 1
    # The worker's short-lived event loop released the job's admission slot before ending.
    key_id = CompletionJob.objects.get(pk=job_id).key_id
    assert async_to_sync(admission_counts)(key_id) == {"running": 0, "waiting": 0}


def test_a_failed_job_returns_the_error_with_its_status(
    api_client, engine_model, api_key, redis_client
):
    job_id = _submit(api_client).json()["id"]
    api_key.monthly_token_budget = 1
    api_key.save(update_fields=["monthly_token_budget"])

    completion_jobs.completion_job_execute(job_id=job_id)

    status = api_client.get(f"/v1/completion-jobs/{job_id}").json()
    assert status["status"] == "failed"
    assert status["error"]["code"] == "budget_exceeded"
    result = api_client.get(f"/v1/completion-jobs/{job_id}/result")
    assert result.status_code == 429
    assert result.json()["error"]["code"] == "budget_exceeded"


def test_a_job_is_claimed_once(api_key, monkeypatch, sent_tasks):
    job, _ = completion_jobs.completion_job_submit(
        key=api_key, idempotency_key="once", payload=BODY
    )
    calls = []

    async def fake_run(**kwargs):
        calls.append(kwargs["payload"])
        return CompletionResult(200, {"object": "text_completion", "choices": []})

    monkeypatch.setattr(completion_jobs, "completion_run", fake_run)
    completion_jobs.completion_job_execute(job_id=job.pk)
    completion_jobs.completion_job_execute(job_id=job.pk)
    assert calls == [BODY]
    job.refresh_from_db()
    assert (job.status, job.attempts) == (WorkStatus.SUCCEEDED, 1)


def test_a_retryable_failure_requeues_the_job_after_retry_after(api_key, monkeypatch, sent_tasks):
    job, _ = completion_jobs.completion_job_submit(
        key=api_key, idempotency_key="retry", payload=BODY
    )

    async def saturated(**kwargs):
        error = ApiError("queue_full", "Too many requests waiting.", retry_after=7)
        return CompletionResult(429, error.body(), error.headers())

    monkeypatch.setattr(completion_jobs, "completion_run", saturated)
    completion_jobs.completion_job_execute(job_id=job.pk)
    job.refresh_from_db()
    assert job.status == WorkStatus.QUEUED
    assert (JOB_RUN, str(job.pk), 7) in sent_tasks
    for _ in range(2):
        completion_jobs.completion_job_execute(job_id=job.pk)
    job.refresh_from_db()
    assert job.status == WorkStatus.FAILED
    assert job.error["code"] == "queue_full"


def test_the_sweep_requeues_a_job_stuck_running_then_fails_it(api_key, settings, sent_tasks):
    job, _ = completion_jobs.completion_job_submit(
        key=api_key, idempotency_key="stuck", payload=BODY
    )
    now = timezone.now()
    CompletionJob.objects.filter(pk=job.pk).update(
        status=WorkStatus.RUNNING, attempts=1, started_at=now, lease_expires_at=now
    )
    assert completion_jobs.completion_jobs_recover_stuck(now=now - timedelta(seconds=1)) == 0
    assert completion_jobs.completion_jobs_recover_stuck(now=now + timedelta(seconds=1)) == 1
    job.refresh_from_db()
    assert job.status == WorkStatus.QUEUED
    assert sent_tasks.ids(JOB_RUN).count(str(job.pk)) == 2

    CompletionJob.objects.filter(pk=job.pk).update(
        status=WorkStatus.RUNNING,
        attempts=settings.ACS_JOB_MAX_ATTEMPTS,
        lease_expires_at=now,
    )
    completion_jobs.completion_jobs_recover_stuck(now=now + timedelta(seconds=1))
    job.refresh_from_db()
    assert job.status == WorkStatus.FAILED
    assert job.error["code"] == "worker_lost"
    assert job.finished_at is not None


def test_a_queued_job_no_worker_took_is_resent_once_per_lease(api_key, settings, sent_tasks):
    job, _ = completion_jobs.completion_job_submit(
        key=api_key, idempotency_key="lost", payload=BODY
    )
    lease = timedelta(seconds=settings.ACS_COMPLETION_JOB_LEASE_SECONDS)
    later = job.created_at + lease + timedelta(seconds=1)
    assert completion_jobs.completion_jobs_recover_stuck(now=job.created_at + lease / 2) == 0
    assert completion_jobs.completion_jobs_recover_stuck(now=later) == 1
    assert completion_jobs.completion_jobs_recover_stuck(now=later + timedelta(minutes=1)) == 0
    assert sent_tasks.ids(JOB_RUN) == [str(job.pk)] * 2


def test_jobs_are_deleted_24_hours_after_they_end(api_client, api_key, engine_model, sent_tasks):
    job_id = _submit(api_client).json()["id"]
    ended = timezone.now()
    CompletionJob.objects.filter(pk=job_id).update(
        status=WorkStatus.SUCCEEDED, finished_at=ended, result_status=200, result_body={}
    )
    assert completion_jobs.completion_jobs_expire(now=ended + timedelta(hours=23, minutes=59)) == 0
    assert api_client.get(f"/v1/completion-jobs/{job_id}").status_code == 200
    assert completion_jobs.completion_jobs_expire(now=ended + timedelta(hours=24, seconds=1)) == 1
    for path in (f"/v1/completion-jobs/{job_id}", f"/v1/completion-jobs/{job_id}/result"):
        response = api_client.get(path)
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "not_found"


def test_another_users_job_is_404(api_client, client, engine_model, other_user):
    job_id = _submit(api_client).json()["id"]
    _, other_secret = api_key_create(user=other_user, name="eve", acting_user=None)
    for path in (f"/v1/completion-jobs/{job_id}", f"/v1/completion-jobs/{job_id}/result"):
        response = client.get(path, HTTP_AUTHORIZATION=f"Bearer {other_secret}")
        assert response.status_code == 404
    assert api_client.get("/v1/completion-jobs/not-a-uuid").status_code == 404


def test_the_beat_sweep_task_expires_and_recovers_jobs(api_key, sent_tasks, settings):
    assert settings.CELERY_BEAT_SCHEDULE["jobs-sweep"]["task"] == tasks.jobs_sweep_task.name
    ended, _ = completion_jobs.completion_job_submit(
        key=api_key, idempotency_key="old", payload=BODY
    )
    stuck, _ = completion_jobs.completion_job_submit(
        key=api_key, idempotency_key="stuck", payload=BODY
    )
    long_ago = timezone.now() - timedelta(days=2)
    CompletionJob.objects.filter(pk=ended.pk).update(
        status=WorkStatus.SUCCEEDED, finished_at=long_ago
    )
    CompletionJob.objects.filter(pk=stuck.pk).update(
        status=WorkStatus.RUNNING, attempts=1, lease_expires_at=long_ago
    )
    tasks.jobs_sweep_task()
    assert not CompletionJob.objects.filter(pk=ended.pk).exists()
    assert CompletionJob.objects.get(pk=stuck.pk).status == WorkStatus.QUEUED
