"""Jobs re-check their key and account when they start and before each harvest batch: a key
revoked or paused, or an account suspended, after the job was submitted fails the job with
the code the API would answer, before any upstream work is done or billed."""

import json

import pytest
from asgiref.sync import sync_to_async

from accounts.services.keys import api_key_disable, api_key_revoke
from accounts.services.users import user_suspend
from api.jobs.models import CompletionJob, HarvestJob
from api.jobs.services import completion_jobs, harvests
from infra.lifecycle import WorkStatus
from metering.models import UsagePeriod, UsageRecord

pytestmark = pytest.mark.django_db(transaction=True)

BODY = {"model": "smollm2-135m", "prompt": "The capital of France is", "max_tokens": 2}
PROMPTS = ["The quick brown fox.", "Residual streams.", "Paris"]


def _revoke(key):
    api_key_revoke(key=key, acting_user=key.user)


def _disable(key):
    api_key_disable(key=key, acting_user=key.user)


def _suspend(key):
    user_suspend(user=key.user, acting_user=None)


ACCESS_LOSSES = [
    pytest.param(_revoke, "key_revoked", id="revoked"),
    pytest.param(_disable, "key_disabled", id="disabled"),
    pytest.param(_suspend, "account_suspended", id="suspended"),
]


def _nothing_billed(key):
    assert not UsageRecord.objects.filter(key=key).exists()
    for window in UsagePeriod.objects.filter(key=key):
        assert (window.used_tokens, window.reserved_tokens) == (0, 0)


@pytest.mark.parametrize(("lose_access", "code"), ACCESS_LOSSES)
def test_a_completion_job_whose_access_ended_after_submit_fails_with_the_apis_code(
    api_client, api_key, engine_model, redis_client, lose_access, code
):
    response = api_client.post(
        "/v1/completion-jobs",
        data=json.dumps(BODY),
        content_type="application/json",
        HTTP_IDEMPOTENCY_KEY="revoked-later",
    )
    assert response.status_code == 202
    lose_access(api_key)

    completion_jobs.completion_job_execute(job_id=response.json()["id"])

    job = CompletionJob.objects.get(pk=response.json()["id"])
    assert job.status == WorkStatus.FAILED
    assert job.answer[0] == 401
    assert job.error["code"] == code
    assert job.result_headers == {"X-Should-Retry": "false"}
    _nothing_billed(api_key)


@pytest.mark.parametrize(("lose_access", "code"), ACCESS_LOSSES)
def test_a_harvest_job_whose_access_ended_after_submit_does_not_start(
    api_key, engine_model, redis_client, monkeypatch, lose_access, code
):
    job, _ = harvests.harvest_job_submit(
        key=api_key, model="smollm2-135m", prompts=PROMPTS, layers=[0], add_special_tokens=True
    )
    lose_access(api_key)
    captured = []

    async def capture(*args, **kwargs):
        captured.append(kwargs["first_index"])
        return []

    monkeypatch.setattr(harvests, "capture_batch", capture)

    harvests.harvest_job_execute(job_id=job.pk)

    job.refresh_from_db()
    assert job.status == WorkStatus.FAILED
    assert job.error["code"] == code
    assert captured == []
    _nothing_billed(api_key)


def test_a_harvest_job_stops_before_its_next_batch_once_its_key_is_revoked(
    api_key, engine_model, redis_client, settings, monkeypatch
):
    settings.ACS_HARVEST_BATCH_SIZE = 1
    job, _ = harvests.harvest_job_submit(
        key=api_key, model="smollm2-135m", prompts=PROMPTS, layers=[0], add_special_tokens=True
    )
    real_capture = harvests.capture_batch
    batches = []

    async def capture_then_revoke(*args, **kwargs):
        batches.append(kwargs["first_index"])
        captures = await real_capture(*args, **kwargs)
        await sync_to_async(_revoke)(api_key)
        return captures

    monkeypatch.setattr(harvests, "capture_batch", capture_then_revoke)
    harvests.harvest_job_execute(job_id=job.pk)

    job.refresh_from_db()
    assert batches == [0]
    assert job.status == WorkStatus.FAILED
    assert job.error["code"] == "key_revoked"
    assert job.prompts_done == 1
    assert HarvestJob.objects.get(pk=job.pk).error["message"] == (
        "This API key has been revoked; create a new one."
    )
