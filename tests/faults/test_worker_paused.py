"""The Celery worker is paused (SIGSTOP) in the middle of a completion job for longer than the
job's lease: the jobs sweep puts the job back to queued and a second worker claims it and
finishes it. Then the first worker is resumed (SIGCONT) and gets its upstream answer at last:
its attempt is stale, so it bills nothing (its budget hold is released) and stores nothing,
and the job keeps the second attempt's result, billed once (issue 43 item 4)."""

import signal
import threading
import uuid

import httpx
import pytest
from django.utils import timezone

from api.jobs.models import CompletionJob, HarvestJob
from infra.lifecycle import WorkStatus
from metering.models import BudgetReservation, ReservationStatus, UsageRecord

from .conftest import JOB_LEASE_S, STUB_MODEL, Service, wait_for

JOBS_SWEEP = "api.jobs.tasks.jobs_sweep_task"


@pytest.fixture
def second_worker(system):
    """A second Celery worker like the system's; the system's worker is resumed (if a test
    left it paused) and the second one stopped afterwards."""
    worker = Service("worker-second", system.worker.command, system.worker.env, system.log_dir)
    yield worker
    system.worker.process.send_signal(signal.SIGCONT)
    worker.stop()


@pytest.fixture
def upstream_gate(system):
    """The stub upstream holds every completion until the event is set."""
    gate = threading.Event()
    system.stub.mode["gate"] = gate
    yield gate
    gate.set()
    system.stub.mode.pop("gate", None)


def paused_until_taken_over(system, account, second_worker, upstream_gate, model, job_id):
    """Pause the first worker (SIGSTOP) while its attempt holds the budget and waits on the
    upstream; once its lease ran out, the sweep takes the job back and the second worker
    claims it; then open the upstream (the paused worker's answer waits in its socket until
    it is resumed). Returns the first attempt's budget hold."""
    system.worker.process.send_signal(signal.SIGSTOP)
    first_hold = BudgetReservation.objects.get(key=account.key)
    second_worker.start()
    wait_for(
        lambda: model.objects.get(pk=job_id).lease_expires_at < timezone.now(),
        timeout=JOB_LEASE_S + 30,
        what="the paused worker's lease to run out",
    )
    system.send_task(JOBS_SWEEP)
    wait_for(
        lambda: model.objects.get(pk=job_id).attempts == 2,
        timeout=90,
        what="the second worker to claim the job",
    )
    upstream_gate.set()
    return first_hold


def test_worker_paused_past_its_lease_bills_and_stores_nothing_when_resumed(
    system, account, second_worker, upstream_gate, fault_table
):
    http = httpx.Client(
        base_url=system.web_url, headers={"Authorization": f"Bearer {account.secret}"}, timeout=60
    )
    body = {"model": STUB_MODEL, "prompt": "the capital of france is", "max_tokens": 8}
    response = http.post(
        "/v1/completion-jobs", json=body, headers={"Idempotency-Key": uuid.uuid4().hex}
    )
    assert response.status_code in (200, 201, 202), response.text
    job_id = response.json()["id"]
    in_flight = system.stub.in_flight
    wait_for(
        lambda: (
            system.stub.in_flight > in_flight
            and BudgetReservation.objects.filter(
                key=account.key, status=ReservationStatus.RESERVED
            ).exists()
        ),
        timeout=60,
        what="attempt 1 to hold the job's budget and wait on the upstream",
    )
    first_hold = paused_until_taken_over(
        system, account, second_worker, upstream_gate, CompletionJob, job_id
    )

    def job_succeeded():
        job = CompletionJob.objects.get(pk=job_id)
        assert job.status in (WorkStatus.RUNNING, WorkStatus.SUCCEEDED), job.result_body
        return job if job.status == WorkStatus.SUCCEEDED else None

    job = wait_for(job_succeeded, timeout=90, what="the second attempt to finish the job")
    assert job.attempts == 2
    [billed] = UsageRecord.objects.filter(key=account.key)
    result = http.get(f"/v1/completion-jobs/{job_id}/result")
    assert result.status_code == 200, result.text

    system.worker.process.send_signal(signal.SIGCONT)
    resumed_hold = wait_for(
        lambda: (
            (hold := BudgetReservation.objects.get(pk=first_hold.pk)).status
            != ReservationStatus.RESERVED
            and hold
        ),
        timeout=60,
        what="the resumed worker to settle or release its hold",
    )

    # Billed once: the resumed attempt wrote no usage record and released its hold.
    records = UsageRecord.objects.filter(key=account.key)
    assert [record.pk for record in records] == [billed.pk]
    assert resumed_hold.status == ReservationStatus.RELEASED
    usage = result.json()["usage"]
    assert (
        account.used_tokens()
        == usage["total_tokens"]
        == (billed.prompt_tokens + billed.completion_tokens)
    )
    assert account.reserved_tokens() == 0
    # It stored nothing: it found the job another attempt's when it came to store its result.
    wait_for(
        lambda: f"completion job {job_id}: attempt 1 is stale" in system.worker.log_tail(200),
        timeout=60,
        what="the resumed worker to refuse its stale result",
    )
    after = CompletionJob.objects.get(pk=job_id)
    assert (after.status, after.attempts, after.result_body, after.finished_at) == (
        job.status,
        job.attempts,
        job.result_body,
        job.finished_at,
    )
    fault_table.add(
        fault="Celery worker SIGSTOPped mid-completion-job past its lease, SIGCONTed after a"
        " second worker finished the job",
        client_saw="job `running`, then `succeeded` after attempt 2; result 200, unchanged"
        " once the paused worker resumed",
        metered=f"{usage['total_tokens']} (1 usage record); the resumed attempt's hold"
        f" of {first_hold.prompt_tokens + first_hold.output_tokens} released, never billed",
        produced=f"{usage['total_tokens']} in the stored result (attempt 2's); attempt 1's"
        " answer discarded",
        recovery=f"lease {JOB_LEASE_S} s, then the jobs sweep and the second worker",
    )
    http.close()


def test_worker_paused_mid_harvest_past_its_lease_bills_and_records_nothing_when_resumed(
    system, account, second_worker, upstream_gate, fault_table
):
    """The same for a harvest (one prompt a batch): paused while its first batch's capture
    waits on the upstream, the first worker is resumed after the second finished the job; it
    writes that batch's shard under its own attempt's name, then its bill is refused."""
    http = httpx.Client(
        base_url=system.web_url, headers={"Authorization": f"Bearer {account.secret}"}, timeout=60
    )
    prompts = ["the capital of france is", "hello paris", "the capital"]
    response = http.post(
        "/v1/harvest", json={"model": STUB_MODEL, "prompts": prompts, "layers": [1]}
    )
    assert response.status_code == 202, response.text
    job_id = response.json()["job_id"]
    wait_for(
        lambda: BudgetReservation.objects.filter(
            key=account.key, status=ReservationStatus.RESERVED
        ).exists(),
        timeout=60,
        what="attempt 1 to hold its first batch's budget and wait on the upstream",
    )
    first_hold = paused_until_taken_over(
        system, account, second_worker, upstream_gate, HarvestJob, job_id
    )

    def harvest_done():
        job = HarvestJob.objects.get(pk=job_id)
        assert job.status in (WorkStatus.RUNNING, WorkStatus.SUCCEEDED), job.error
        return job if job.status == WorkStatus.SUCCEEDED else None

    job = wait_for(harvest_done, timeout=90, what="the second attempt to finish the harvest")
    assert (job.attempts, job.prompts_done) == (2, len(prompts))

    system.worker.process.send_signal(signal.SIGCONT)
    resumed_hold = wait_for(
        lambda: (
            (hold := BudgetReservation.objects.get(pk=first_hold.pk)).status
            != ReservationStatus.RESERVED
            and hold
        ),
        timeout=60,
        what="the resumed worker to settle or release its hold",
    )

    # Each batch billed once, by attempt 2; the resumed attempt's hold was released.
    records = UsageRecord.objects.filter(key=account.key, endpoint="harvest")
    assert sorted(record.request_id.rsplit("-", 1)[1] for record in records) == ["0", "1", "2"]
    assert resumed_hold.status == ReservationStatus.RELEASED
    assert account.used_tokens() == sum(r.prompt_tokens + r.completion_tokens for r in records)
    assert account.reserved_tokens() == 0
    # The job is attempt 2's: its shards, named after it. The resumed attempt's shard file
    # has a name of its own, which no attempt recorded.
    after = HarvestJob.objects.get(pk=job_id)
    assert (after.status, after.shards, after.files) == (job.status, job.shards, job.files)
    assert [shard["name"] for shard in after.shards] == [
        f"shard_{index:05d}-attempt2.safetensors" for index in range(len(prompts))
    ]
    media = system.log_dir / "media" / after.storage_prefix
    wait_for(
        lambda: (media / "shard_00000.safetensors").exists(),
        timeout=30,
        what="the resumed worker's own shard file",
    )
    assert "shard_00000.safetensors" not in after.files
    fault_table.add(
        fault="Celery worker SIGSTOPped mid-harvest past its lease, SIGCONTed after a second"
        " worker finished the job",
        client_saw=f"job `running`, then `done` after attempt 2 ({len(prompts)} shards of"
        " attempt 2), unchanged once the paused worker resumed",
        metered=f"{account.used_tokens()} tokens ({records.count()} usage records, one per"
        " batch); the resumed attempt's batch hold released, never billed",
        produced=f"{len(after.files)} files; the resumed attempt's late shard file unrecorded",
        recovery=f"lease {JOB_LEASE_S} s, then the jobs sweep and the second worker",
    )
    http.close()
