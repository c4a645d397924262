"""A job's worker whose attempt went stale (issue 43 item 4): it waited on the upstream past its
lease, the jobs sweep put the job back to queued and a second worker claimed it and finished
it. The first worker's writes and bills are fenced by its attempt (`infra.lifecycle.Attempt`):
when its answer arrives at last it bills nothing (its budget hold is released) and stores
nothing, and the job keeps the second attempt's result, billed once.

Against the stub upstream behind an `UpstreamGate` that holds the first attempt's request
until the second attempt has finished: the order is set by events, not by timing. The first
attempt runs in a thread, as a worker process of its own would."""

import threading
from datetime import timedelta

import pytest
from django.core.files.storage import default_storage
from django.db import connections
from django.utils import timezone

from acs_client.protocol import PROBE_HEADER
from api import upstream
from api.jobs.services import completion_jobs, harvests
from api.models import LanguageModel
from api.selectors import registry_clear
from infra.lifecycle import WorkStatus
from metering import windows
from metering.models import BudgetReservation, ReservationStatus, UsagePeriod, UsageRecord
from testsupport.gate import Request, UpstreamGate
from testsupport.stub import StubUpstream

pytestmark = pytest.mark.django_db(transaction=True)

MODEL = "fence-stub"


@pytest.fixture(scope="module")
def stub_server():
    stub = StubUpstream().start()
    yield stub
    stub.stop()


@pytest.fixture
def gate(stub_server, redis_client):
    stub_server.reset()
    upstream.circuit_trust_clear()
    gate = UpstreamGate(stub_server.url)
    gate.start()
    yield gate
    gate.stop()


@pytest.fixture
def stub_model(gate):
    LanguageModel.objects.update_or_create(
        name=MODEL,
        defaults={
            "upstream_urls": [gate.url],
            "activation_upstream_urls": [gate.url],
            "max_model_len": 64,
            "n_layers": 4,
            "hidden_size": 8,
            "vocab_size": 1000,
            "supports_activations": True,
            "is_default": False,
        },
    )
    registry_clear()
    yield MODEL
    registry_clear()


def nth_completion(n: int):
    """A hold predicate: the `n`th completion request (1-based; capture probes aside) and no
    other."""
    seen = 0
    lock = threading.Lock()

    def matches(request: Request) -> bool:
        nonlocal seen
        if request.path != "/v1/completions" or PROBE_HEADER.lower() in request.headers:
            return False
        with lock:
            seen += 1
            return seen == n

    return matches


class Worker:
    """`work()` in a thread of its own (with its own database connection), as the worker
    process whose attempt goes stale."""

    def __init__(self, work):
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(work,), daemon=True)
        self.thread.start()

    def _run(self, work) -> None:
        try:
            work()
        except BaseException as error:  # re-raised in the test thread
            self.error = error
        finally:
            connections.close_all()

    def join(self) -> None:
        self.thread.join(timeout=60)
        assert not self.thread.is_alive(), "the stale worker did not finish"
        if self.error is not None:
            raise self.error


def _after_lease(seconds: int):
    return timezone.now() + timedelta(seconds=seconds + 1)


def test_a_completion_job_attempt_taken_over_neither_bills_nor_stores_its_result(
    api_key, stub_model, gate, settings, sent_tasks, caplog
):
    body = {"model": stub_model, "prompt": "the capital of france is", "max_tokens": 3}
    job, _ = completion_jobs.completion_job_submit(
        key=api_key, idempotency_key="fenced", payload=body
    )
    with gate.hold(nth_completion(1)):
        first = Worker(lambda: completion_jobs.completion_job_execute(job_id=job.pk))
        assert gate.holding.wait(30), "attempt 1 never reached the upstream"
        # Attempt 1 waits on the upstream past its lease: the sweep takes the job back and a
        # second worker claims it and runs it to the end.
        lease = settings.ACS_COMPLETION_JOB_LEASE_SECONDS
        assert completion_jobs.completion_jobs_recover_stuck(now=_after_lease(lease)) == 1
        completion_jobs.completion_job_execute(job_id=job.pk)
        job.refresh_from_db()
        assert (job.status, job.attempts, job.result_status) == (WorkStatus.SUCCEEDED, 2, 200)
        stored = (job.result_body, job.finished_at)
        [billed] = UsageRecord.objects.filter(key=api_key)
    # Attempt 1's answer arrives now.
    first.join()

    job.refresh_from_db()
    assert (job.status, job.attempts) == (WorkStatus.SUCCEEDED, 2)
    assert (job.result_body, job.finished_at) == stored
    # Billed once, by attempt 2: attempt 1's hold was released, not settled.
    records = UsageRecord.objects.filter(key=api_key)
    assert [record.pk for record in records] == [billed.pk]
    holds = BudgetReservation.objects.filter(key=api_key).order_by("pk")
    assert [hold.status for hold in holds] == [
        ReservationStatus.RELEASED,
        ReservationStatus.SETTLED,
    ]
    day = UsagePeriod.objects.get(key=api_key, period=windows.DAY.name)
    assert (day.used_tokens, day.reserved_tokens) == (
        billed.prompt_tokens + billed.completion_tokens,
        0,
    )
    assert "attempt 1 is stale" in caplog.text or "attempt 1 no longer holds it" in caplog.text


def test_a_harvest_attempt_taken_over_neither_bills_nor_records_its_batch(
    api_key, stub_model, gate, settings, sent_tasks
):
    settings.ACS_HARVEST_BATCH_SIZE = 1
    prompts = ["the capital of france is", "hello paris"]
    job, _ = harvests.harvest_job_submit(
        key=api_key, model=stub_model, prompts=prompts, layers=[1], add_special_tokens=True
    )
    # Attempt 1 captures and records batch 0, then waits on batch 1's capture past its lease.
    with gate.hold(nth_completion(2)):
        first = Worker(lambda: harvests.harvest_job_execute(job_id=job.pk))
        assert gate.holding.wait(30), "attempt 1 never reached its second batch"
        lease = settings.ACS_HARVEST_JOB_LEASE_SECONDS
        assert harvests.harvest_jobs_recover_stuck(now=_after_lease(lease)) == 1
        # Attempt 2 resumes after the shard attempt 1 recorded, and finishes.
        harvests.harvest_job_execute(job_id=job.pk)
        job.refresh_from_db()
        assert (job.status, job.attempts) == (WorkStatus.SUCCEEDED, 2), job.error
        finished = (job.shards, job.files, job.prompts_done, job.finished_at)
    first.join()

    # Each batch billed once: batch 0 by attempt 1, batch 1 by attempt 2 only.
    records = UsageRecord.objects.filter(key=api_key, endpoint="harvest")
    assert sorted(record.request_id[-2:] for record in records) == ["-0", "-1"]
    month = UsagePeriod.objects.get(key=api_key, period=windows.MONTH.name)
    assert (month.activation_requests, month.reserved_tokens) == (len(prompts), 0)
    assert month.used_tokens == sum(r.prompt_tokens + r.completion_tokens for r in records)
    assert (
        BudgetReservation.objects.filter(key=api_key, status=ReservationStatus.RELEASED).count()
        == 1
    )
    job.refresh_from_db()
    assert (job.status, job.attempts) == (WorkStatus.SUCCEEDED, 2)
    assert (job.shards, job.files, job.prompts_done, job.finished_at) == finished
    assert [shard["name"] for shard in job.shards] == [
        "shard_00000.safetensors",
        "shard_00001-attempt2.safetensors",
    ]
    # Attempt 1 wrote its batch-1 shard under its own name before its bill was refused: a
    # file no attempt recorded, which replaced none of the job's.
    assert default_storage.exists(job.storage_prefix + "shard_00001.safetensors")
    assert "shard_00001.safetensors" not in job.files
