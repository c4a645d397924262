"""Harvest jobs are paid like /v1 captures (token windows, activation quota, spend cap),
reserved before each batch and settled after; their files have a size cap per job and a
retention, after which a beat sweep deletes them."""

import json
from datetime import timedelta

import httpx
import pytest
from django.core.files.storage import default_storage
from django.utils import timezone

from accounts.services.service import service_spend_cap_set
from api.errors import ApiError
from api.jobs import tasks
from api.jobs.models import HarvestJob
from api.jobs.services import harvests
from api.jobs.storage import harvest_file_write
from infra.lifecycle import WorkStatus
from metering import windows
from metering.models import UsagePeriod, UsageRecord

pytestmark = pytest.mark.django_db(transaction=True)

PROMPTS = ["The quick brown fox.", "Residual streams.", "Paris"]
LAYERS = [0, 7]


def _submit(api_key, prompts=PROMPTS):
    job, _ = harvests.harvest_job_submit(
        key=api_key, model="smollm2-135m", prompts=prompts, layers=LAYERS, add_special_tokens=True
    )
    return job


def _token_counts(engine_url, prompts=PROMPTS):
    return [
        len(httpx.post(f"{engine_url}/tokenize", json={"prompt": prompt}).json()["tokens"])
        for prompt in prompts
    ]


def _windows(key):
    """The key's month and day windows and its account's month window."""
    return [
        UsagePeriod.objects.get(key=key, period=windows.MONTH.name),
        UsagePeriod.objects.get(key=key, period=windows.DAY.name),
        UsagePeriod.objects.get(key=None, user=key.user, period=windows.MONTH.name),
    ]


def _manifest(job):
    return json.loads(default_storage.open(job.storage_prefix + "manifest.json").read())


def test_harvest_captures_are_charged_to_the_token_windows_and_activation_quota(
    api_key, engine_model, engine_url, redis_client, settings
):
    settings.ACS_HARVEST_BATCH_SIZE = 2
    job = _submit(api_key)
    harvests.harvest_job_execute(job_id=job.pk)
    job.refresh_from_db()
    assert job.status == WorkStatus.SUCCEEDED, job.error

    prompt_tokens = sum(_token_counts(engine_url))
    for window in _windows(api_key):
        # One generated token per capture, as a /v1 capture with max_tokens 1.
        assert window.used_tokens == prompt_tokens + len(PROMPTS)
        assert window.reserved_tokens == 0
        assert window.activation_requests == len(PROMPTS)
    records = UsageRecord.objects.filter(key=api_key, endpoint="harvest")
    assert records.count() == 2  # one per batch
    assert sum(record.prompt_tokens for record in records) == prompt_tokens


def test_a_budget_that_cannot_cover_the_next_batch_fails_the_job_keeping_what_was_written(
    api_client, api_key, engine_model, engine_url, redis_client, settings
):
    settings.ACS_HARVEST_BATCH_SIZE = 1
    counts = _token_counts(engine_url)
    # Room for the first capture, and for the second's prompt but not its generated token.
    api_key.monthly_token_budget = counts[0] + 1 + counts[1]
    api_key.save(update_fields=["monthly_token_budget"])
    job = _submit(api_key)
    harvests.harvest_job_execute(job_id=job.pk)

    job.refresh_from_db()
    assert job.status == WorkStatus.FAILED
    assert job.error["code"] == "budget_exceeded"
    assert job.prompts_done == 1
    key_month = _windows(api_key)[0]
    assert (key_month.used_tokens, key_month.reserved_tokens) == (counts[0] + 1, 0)
    manifest = _manifest(job)
    assert manifest["prompts_captured"] == 1
    assert [shard["tensors"] for shard in manifest["shards"]] == [["prompt_0", "tokens_0"]]
    body = api_client.get(f"/v1/harvest/{job.pk}").json()
    assert body["status"] == "failed"
    assert len(body["result"]["shard_urls"]) == 1


def test_the_activation_quota_refuses_a_batch_it_cannot_cover_whole(
    api_key, engine_model, redis_client, settings
):
    settings.ACS_HARVEST_BATCH_SIZE = 2
    api_key.monthly_activation_quota = 3
    api_key.save(update_fields=["monthly_activation_quota"])
    job = _submit(api_key, prompts=[*PROMPTS, "One more."])
    harvests.harvest_job_execute(job_id=job.pk)

    job.refresh_from_db()
    assert job.status == WorkStatus.FAILED
    assert job.error["code"] == "activation_quota_exceeded"
    assert job.prompts_done == 2
    assert _windows(api_key)[0].activation_requests == 2


def test_a_failed_batch_is_not_charged_and_gives_its_activation_requests_back(
    api_key, engine_model, engine_url, redis_client, settings, monkeypatch
):
    settings.ACS_HARVEST_BATCH_SIZE = 1
    job = _submit(api_key)
    real_capture = harvests.capture_batch

    async def second_batch_fails(*args, **kwargs):
        if kwargs["first_index"] == 1:
            raise ApiError("capture_incomplete", "lost", should_retry=False)
        return await real_capture(*args, **kwargs)

    monkeypatch.setattr(harvests, "capture_batch", second_batch_fails)
    harvests.harvest_job_execute(job_id=job.pk)

    job.refresh_from_db()
    assert job.status == WorkStatus.FAILED
    assert job.error["code"] == "capture_incomplete"
    first = _token_counts(engine_url)[0]
    for window in _windows(api_key):
        assert (window.used_tokens, window.reserved_tokens) == (first + 1, 0)
        assert window.activation_requests == 1


@pytest.mark.parametrize(
    ("failure", "code"),
    [
        (ApiError("capture_incomplete", "lost", should_retry=False), "capture_incomplete"),
        (RuntimeError("a bug"), "internal_error"),
    ],
)
def test_a_late_failure_keeps_and_bills_the_batches_that_ran_and_says_what_failed(
    api_client, api_key, engine_model, engine_url, redis_client, settings, monkeypatch,
    failure, code,
):  # fmt: skip
    """The third of three batches fails for good: the job fails with its code and keeps the
    two batches it paid for (they used to be thrown away, the quota slot given back)."""
    settings.ACS_HARVEST_BATCH_SIZE = 1
    job = _submit(api_key)
    real_capture = harvests.capture_batch

    async def third_batch_fails(*args, **kwargs):
        if kwargs["first_index"] == 2:
            raise failure
        return await real_capture(*args, **kwargs)

    monkeypatch.setattr(harvests, "capture_batch", third_batch_fails)
    harvests.harvest_job_execute(job_id=job.pk)

    job.refresh_from_db()
    assert job.status == WorkStatus.FAILED
    assert job.error["code"] == code
    assert job.prompts_done == 2
    assert _manifest(job)["prompts_captured"] == 2
    counts = _token_counts(engine_url)
    key_month = _windows(api_key)[0]
    assert (key_month.used_tokens, key_month.reserved_tokens) == (counts[0] + counts[1] + 2, 0)
    assert key_month.harvest_jobs == 1  # the job kept files: its quota slot stays spent
    assert UsageRecord.objects.filter(key=api_key, endpoint="harvest").count() == 2
    body = api_client.get(f"/v1/harvest/{job.pk}").json()
    assert (body["status"], body["error"]["code"]) == ("failed", code)
    assert len(body["result"]["shard_urls"]) == 2


def test_a_paused_service_refuses_harvest_submits_and_fails_a_pending_job_with_spend_cap(
    api_client, api_key, engine_model, redis_client, staff_user, monkeypatch
):
    job = _submit(api_key)
    service_spend_cap_set(paused=True, acting_user=staff_user, reason="over budget")

    response = api_client.post(
        "/v1/harvest",
        data=json.dumps({"model": "smollm2-135m", "prompts": ["Hello."]}),
        content_type="application/json",
    )
    assert response.status_code == 429
    assert response.json()["error"]["code"] == "spend_cap"
    assert response["Retry-After"] == "3600"

    captured = []

    async def capture(*args, **kwargs):
        captured.append(kwargs["first_index"])
        return []

    monkeypatch.setattr(harvests, "capture_batch", capture)
    harvests.harvest_job_execute(job_id=job.pk)
    job.refresh_from_db()
    assert job.status == WorkStatus.FAILED
    assert job.error["code"] == "spend_cap"
    assert captured == []
    assert HarvestJob.objects.count() == 1


def test_a_harvest_over_the_size_cap_is_413_at_submit(
    api_client, engine_model, engine_url, settings
):
    tokens = _token_counts(engine_url, ["Hello there."])[0]
    settings.ACS_HARVEST_MAX_JOB_BYTES = tokens * 30 * 576 * 2 - 1
    response = api_client.post(
        "/v1/harvest",
        data=json.dumps({"model": "smollm2-135m", "prompts": ["Hello there."], "layers": "all"}),
        content_type="application/json",
    )
    assert response.status_code == 413
    error = response.json()["error"]
    assert error["code"] == "request_too_large"
    assert str(settings.ACS_HARVEST_MAX_JOB_BYTES) in error["message"]
    assert not HarvestJob.objects.exists()


def test_the_worker_stops_a_job_before_its_files_pass_the_size_cap(
    api_key, engine_model, engine_url, redis_client, settings
):
    settings.ACS_HARVEST_BATCH_SIZE = 1
    first = _token_counts(engine_url)[0]
    # Room for the first shard only (its header aside, which the estimate leaves out).
    settings.ACS_HARVEST_MAX_JOB_BYTES = first * (len(LAYERS) * 576 * 2 + 4) + 1024
    job = _submit(api_key)
    harvests.harvest_job_execute(job_id=job.pk)

    job.refresh_from_db()
    assert job.status == WorkStatus.FAILED
    assert job.error["code"] == "request_too_large"
    assert job.prompts_done == 1
    written = sum(
        default_storage.size(job.storage_prefix + name)
        for name in job.files
        if name.startswith("shard_")
    )
    assert 0 < written <= settings.ACS_HARVEST_MAX_JOB_BYTES
    assert _windows(api_key)[0].activation_requests == 1


def _ended_job(api_key, *, ended_ago):
    job = _submit(api_key)
    for name in ("shard_00000.safetensors", "stats.safetensors", "manifest.json"):
        harvest_file_write(job.storage_prefix, name, b"{}")
    HarvestJob.objects.filter(pk=job.pk).update(
        status=WorkStatus.SUCCEEDED,
        finished_at=timezone.now() - ended_ago,
        files=["shard_00000.safetensors", "stats.safetensors", "manifest.json"],
    )
    return job


def test_the_beat_sweep_deletes_the_files_of_jobs_past_their_retention(
    api_client, api_key, settings
):
    retention = timedelta(seconds=settings.ACS_HARVEST_RETENTION_SECONDS)
    assert retention == timedelta(days=7)
    old = _ended_job(api_key, ended_ago=retention + timedelta(minutes=1))
    recent = _ended_job(api_key, ended_ago=retention - timedelta(minutes=1))
    old_links = api_client.get(f"/v1/harvest/{old.pk}").json()["result"]

    tasks.jobs_sweep_task()

    assert not default_storage.exists(old.storage_prefix + "manifest.json")
    assert default_storage.exists(recent.storage_prefix + "manifest.json")
    body = api_client.get(f"/v1/harvest/{old.pk}").json()
    assert body["status"] == "expired"
    assert "deleted 7 days after it ended" in body["message"]
    assert body["result"] is None
    download = api_client.get(old_links["manifest_url"])
    assert download.status_code == 404
    assert "deleted" in download.json()["error"]["message"]
    assert api_client.get(f"/v1/harvest/{recent.pk}").json()["status"] == "done"


def test_a_job_that_ends_without_files_gives_its_harvest_quota_back(
    api_key, engine_model, redis_client, monkeypatch
):
    def harvest_jobs_counted():
        return _windows(api_key)[0].harvest_jobs

    cancelled = _submit(api_key)
    failing = _submit(api_key)
    assert harvest_jobs_counted() == 2

    harvests.harvest_job_cancel(job=cancelled)
    assert harvest_jobs_counted() == 1

    async def upstream_lost(*args, **kwargs):
        raise ApiError("capture_incomplete", "lost", should_retry=False)

    monkeypatch.setattr(harvests, "capture_batch", upstream_lost)
    harvests.harvest_job_execute(job_id=failing.pk)
    assert HarvestJob.objects.get(pk=failing.pk).status == WorkStatus.FAILED
    assert harvest_jobs_counted() == 0


class WorkerKilled(BaseException):
    """Stands for SIGKILL: nothing in the worker catches it."""


def test_a_harvest_rerun_after_its_worker_died_charges_each_batch_once(
    api_key, engine_model, engine_url, redis_client, settings, monkeypatch
):
    from metering.budgets import budget_release_stale

    settings.ACS_HARVEST_BATCH_SIZE = 1
    real_capture_batch = harvests.capture_batch
    calls = []

    async def capture_then_die_on_the_second_batch(*args, **kwargs):
        calls.append(kwargs["first_index"])
        if len(calls) == 2:
            raise WorkerKilled
        return await real_capture_batch(*args, **kwargs)

    monkeypatch.setattr(harvests, "capture_batch", capture_then_die_on_the_second_batch)
    job = _submit(api_key)
    with pytest.raises(WorkerKilled):
        harvests.harvest_job_execute(job_id=job.pk)
    budget_release_stale(older_than=timedelta(0))
    later = timezone.now() + timedelta(seconds=settings.ACS_HARVEST_JOB_LEASE_SECONDS + 1)
    assert harvests.harvest_jobs_recover_stuck(now=later) == 1
    harvests.harvest_job_execute(job_id=job.pk)
    job.refresh_from_db()
    assert job.status == WorkStatus.SUCCEEDED, job.error

    assert calls == [0, 1, 1, 2]  # the second attempt resumed after the shard written
    prompt_tokens = sum(_token_counts(engine_url))
    for window in _windows(api_key):
        assert window.used_tokens == prompt_tokens + len(PROMPTS)
        assert window.reserved_tokens == 0
    records = UsageRecord.objects.filter(key=api_key, endpoint="harvest")
    assert records.count() == len(PROMPTS)  # one per batch
