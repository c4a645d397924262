"""The Celery worker is SIGKILLed in the middle of a completion job and of a harvest job: the
job is run again by a new worker (found by the jobs sweep once its lease ran out) and billed
exactly once."""

import time
import uuid
from datetime import timedelta

import httpx
from django.utils import timezone

from api.jobs.models import CompletionJob, HarvestJob
from infra.lifecycle import ACTIVE, WorkStatus
from metering import windows
from metering.budgets import budget_release_stale
from metering.models import BudgetReservation, ReservationStatus, UsageRecord

from .conftest import ENGINE_MODEL, JOB_LEASE_S, STUB_MODEL, wait_for

JOBS_SWEEP = "api.jobs.tasks.jobs_sweep_task"


def _client(system, account) -> httpx.Client:
    return httpx.Client(
        base_url=system.web_url,
        headers={"Authorization": f"Bearer {account.secret}"},
        timeout=60,
    )


def _replace_worker_and_sweep(system, model, job_id) -> None:
    """Start a new worker, and once the killed worker's lease on the job ran out, send the
    jobs sweep (what beat does every minute) to it."""
    system.worker.start()
    wait_for(
        lambda: model.objects.get(pk=job_id).lease_expires_at < timezone.now(),
        timeout=JOB_LEASE_S + 30,
        what="the killed worker's lease to run out",
    )
    system.send_task(JOBS_SWEEP)


def test_worker_killed_mid_completion_job_reruns_it_and_bills_once(system, account, fault_table):
    http = _client(system, account)
    # The stub upstream holds the first attempt's request, so the worker is killed mid-call.
    system.stub.mode["delay"] = 30
    body = {"model": STUB_MODEL, "prompt": "the capital of france is", "max_tokens": 8}
    response = http.post(
        "/v1/completion-jobs", json=body, headers={"Idempotency-Key": uuid.uuid4().hex}
    )
    assert response.status_code in (200, 201, 202), response.text
    job_id = response.json()["id"]
    wait_for(
        lambda: BudgetReservation.objects.filter(
            key=account.key, status=ReservationStatus.RESERVED
        ).exists(),
        timeout=60,
        what="the worker to hold the job's budget and call the upstream",
    )
    system.worker.kill()
    killed_at = time.monotonic()
    system.stub.mode.pop("delay")

    _replace_worker_and_sweep(system, CompletionJob, job_id)

    def job_succeeded():
        job = CompletionJob.objects.get(pk=job_id)
        assert job.status in ("queued", "running", "succeeded"), job.result_body
        return job if job.status == "succeeded" else None

    job = wait_for(
        job_succeeded,
        timeout=90,
        what="the job to be run again and succeed",
    )
    recovered_at = time.monotonic()
    result = http.get(f"/v1/completion-jobs/{job_id}/result")
    assert result.status_code == 200, result.text
    usage = result.json()["usage"]
    assert job.attempts == 2

    # Billed once: one usage record (the dead attempt wrote none), the windows' `used` is
    # the result's usage.
    records = UsageRecord.objects.filter(key=account.key)
    assert [(r.endpoint, r.status_code) for r in records] == [("completion-jobs", 200)]
    assert (records[0].prompt_tokens, records[0].completion_tokens) == (
        usage["prompt_tokens"],
        usage["completion_tokens"],
    )
    assert account.used_tokens() == usage["total_tokens"]
    # The dead attempt's hold is still reserved (never used); the stale-hold sweep frees it.
    dead_holds = BudgetReservation.objects.filter(
        key=account.key, status=ReservationStatus.RESERVED
    )
    assert dead_holds.count() == 1
    held = dead_holds.get().prompt_tokens + dead_holds.get().output_tokens
    assert budget_release_stale(older_than=timedelta(0)) == 1
    assert account.reserved_tokens() == 0
    assert account.used_tokens() == usage["total_tokens"]
    fault_table.add(
        fault="Celery worker SIGKILLed mid-completion-job",
        client_saw=f"job `running`, then `succeeded` after attempt {job.attempts}; result 200",
        metered=f"{usage['total_tokens']} (1 usage record); dead attempt's hold of {held}"
        " freed by the stale-hold sweep, never used",
        produced=f"{usage['total_tokens']} in the stored result",
        recovery=f"{recovered_at - killed_at:.1f} s to the job's success (lease"
        f" {JOB_LEASE_S} s, then the jobs sweep)",
    )
    http.close()


def test_worker_killed_mid_harvest_reruns_it_and_bills_each_batch_once(
    system, engine_ready, account, fault_table
):
    http = _client(system, account)
    prompts = [f"Prompt number {index} reads the residual stream." for index in range(4)]
    response = http.post(
        "/v1/harvest", json={"model": ENGINE_MODEL, "prompts": prompts, "layers": [1, 2]}
    )
    assert response.status_code == 202, response.text
    job_id = response.json()["job_id"]
    # One prompt per batch (ACS_HARVEST_BATCH_SIZE=1): killed after its first shard.

    def first_shard_written():
        job = HarvestJob.objects.get(pk=job_id)
        assert job.status in ACTIVE, job.error
        return job.prompts_done >= 1

    wait_for(
        first_shard_written,
        timeout=120,
        what="the harvest to write its first shard",
        interval=0.05,
    )
    system.worker.kill()
    killed_at, killed_at_wall = time.monotonic(), time.time()
    killed_job = HarvestJob.objects.get(pk=job_id)
    done_when_killed = killed_job.prompts_done
    assert done_when_killed < len(prompts)
    # The shards the dead attempt wrote, as they were: the next attempt resumes after them.
    media = system.log_dir / "media" / killed_job.storage_prefix
    written = {shard["name"]: (media / shard["name"]).read_bytes() for shard in killed_job.shards}
    assert len(written) == done_when_killed

    _replace_worker_and_sweep(system, HarvestJob, job_id)

    def harvest_done():
        job = HarvestJob.objects.get(pk=job_id)
        assert job.status in (*ACTIVE, WorkStatus.SUCCEEDED), job.error
        return job if job.status == WorkStatus.SUCCEEDED else None

    job = wait_for(
        harvest_done,
        timeout=120,
        what="the harvest to be run again and finish",
    )
    recovered_at = time.monotonic()
    assert job.attempts == 2
    assert job.prompts_done == len(prompts)
    assert job.files[-1] == "manifest.json"
    # Resumed: the dead attempt's shards were kept, not captured and written again (a
    # rewrite replaces the file, so it would carry a later time).
    for name, content in written.items():
        assert (media / name).read_bytes() == content
        assert (media / name).stat().st_mtime < killed_at_wall
    detail = http.get(f"/v1/harvest/{job_id}").json()
    assert detail["status"] == "done"
    # Counted once against the monthly harvest quota, although it ran twice.
    month = account.windows()["key_" + windows.MONTH.name]
    assert month.harvest_jobs == 1
    # Each batch billed once: the batch the dead attempt was capturing had only a hold (the
    # sweep frees it), and those it had paid for are not charged again by the re-run.
    budget_release_stale(older_than=timedelta(0))
    prompt_tokens = sum(
        len(httpx.post(f"{system.engine_url}/tokenize", json={"prompt": p}).json()["tokens"])
        for p in prompts
    )
    produced = prompt_tokens + len(prompts)  # one generated token per capture
    records = UsageRecord.objects.filter(key=account.key, endpoint="harvest")
    assert records.count() == len(prompts)  # one per batch of one prompt
    assert account.used_tokens() == produced
    assert account.reserved_tokens() == 0
    assert account.windows()["key_" + windows.MONTH.name].activation_requests == len(prompts)
    fault_table.add(
        fault="Celery worker SIGKILLed mid-harvest",
        client_saw=f"job `running` ({done_when_killed}/{len(prompts)} prompts), then"
        f" `done` after attempt {job.attempts}, which resumed after the"
        f" {done_when_killed} shard(s) written",
        metered=f"{account.used_tokens()} tokens ({records.count()} usage records, one per"
        f" batch), {len(prompts)} activation requests, 1 harvest job of the quota",
        produced=f"{produced} ({len(prompts)} prompts captured + 1 token each),"
        f" {len(job.files)} files",
        recovery=f"{recovered_at - killed_at:.1f} s to `done` (lease {JOB_LEASE_S} s,"
        " then the jobs sweep)",
    )
    http.close()
