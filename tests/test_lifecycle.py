"""One lifecycle for background work (`infra.lifecycle`): every table of it takes its statuses
from WorkStatus, the migrations that brought harvest jobs and job submissions to it map every
old status (and back), the words a person or an API client reads did not change, and the beat
sweeps recover or fail the stuck rows of every table through it."""

import datetime as dt
import importlib
import uuid

import pytest
from django.db import connection
from django.db.migrations.loader import MigrationLoader
from django.utils import timezone

from api.jobs import tasks as jobs_tasks
from api.jobs.models import CompletionJob, HarvestJob
from api.jobs.services import harvests
from infra import lifecycle
from infra.lifecycle import WorkStatus
from metering import windows
from metering.jobs import job_meter, job_reserve
from metering.models import BudgetReservation, ReservationStatus, UsagePeriod, UsageRecord
from playground import tasks as playground_tasks
from playground.models import Run, RunComparison, SteeringScore
from portal import tasks as portal_tasks
from portal.models import JobKind, JobSubmission

WORK_TABLES = (CompletionJob, HarvestJob, Run, SteeringScore, RunComparison, JobSubmission)


def harvest_job(user, key, **fields) -> HarvestJob:
    return HarvestJob.objects.create(
        user=user, key=key, model="m", prompts=["a"], layers=[1], n_prompts=1, **fields
    )


@pytest.mark.parametrize("model", WORK_TABLES, ids=lambda model: model.__name__)
def test_every_background_table_takes_its_statuses_from_work_status(model):
    status = model._meta.get_field("status")
    assert status.choices == WorkStatus.choices
    assert status.default == WorkStatus.QUEUED


@pytest.mark.parametrize("model", WORK_TABLES, ids=lambda model: model.__name__)
def test_every_background_table_is_a_work_row_with_its_columns_and_nothing_of_its_own_for_them(
    model,
):
    """One name for each time (created, started, finished), one way to store an error."""
    assert issubclass(model, lifecycle.WorkRow)
    names = {field.name for field in model._meta.concrete_fields}
    work_row = {field.name for field in lifecycle.WorkRow._meta.fields}
    assert work_row == {
        "status", "attempts", "created_at", "started_at", "finished_at", "lease_expires_at",
        "error_code", "error_message",
    }  # fmt: skip
    assert work_row <= names
    assert not names & {"queued_at", "completed_at", "sent_at", "error"} - (
        {"sent_at"} if model is Run else set()  # a run's turn among its group's runs
    )
    for name in work_row:
        assert model._meta.get_field(name).model is model
        assert (
            model._meta.get_field(name).deconstruct()[1:]
            == (lifecycle.WorkRow._meta.get_field(name).deconstruct()[1:])
        )


def test_a_job_failed_by_the_api_answers_the_error_it_stored_as_code_and_message(
    approved_user, api_key
):
    job = CompletionJob(status=WorkStatus.FAILED, error_code="spend_cap", error_message="Paused.")
    error = {"code": "spend_cap", "message": "Paused.", "type": "rate_limit_error"}
    assert job.answer == (429, {"error": error})
    assert job.error == error
    assert (
        harvest_job(approved_user, api_key, error_code="spend_cap", error_message="Paused.").error
        == error
    )
    assert (
        CompletionJob(status=WorkStatus.SUCCEEDED, result_status=200, result_body={}).error is None
    )


def _migration(app: str, name: str):
    return importlib.import_module(f"{app}.migrations.{name}")


def _models_at(app: str, name: str):
    """The models as they stood at migration `name` of `app` (a model may have moved to
    another app since: JobSubmission did, to the portal)."""
    label = app.rpartition(".")[2]  # api.jobs's label is "jobs"
    return MigrationLoader(connection).project_state((label, name)).apps


@pytest.mark.parametrize(
    ("model", "migration", "renames"),
    [
        (
            HarvestJob,
            ("api.jobs", "0004_work_status"),
            {"pending": "queued", "done": "succeeded", "running": "running", "failed": "failed"},
        ),
        (
            JobSubmission,
            ("playground", "0012_work_status"),
            {"queued": "queued", "sending": "running", "submitted": "succeeded"}
            | {"refused": "failed"},
        ),
    ],
    ids=["harvest jobs", "job submissions"],
)
def test_the_status_migrations_map_every_old_status_and_back(
    approved_user, api_key, model, migration, renames
):
    rows = {}
    for old in renames:
        if model is HarvestJob:
            rows[old] = harvest_job(approved_user, api_key, status=old)
        else:
            rows[old] = JobSubmission.objects.create(
                user=approved_user, kind=JobKind.COMPLETION, request={}, status=old
            )
    module = _migration(*migration)
    apps = _models_at(*migration)

    module.forward(apps, None)
    assert {old: model.objects.get(pk=row.pk).status for old, row in rows.items()} == renames
    assert set(renames.values()) <= set(WorkStatus.values)

    module.backward(apps, None)
    assert {old: model.objects.get(pk=row.pk).status for old, row in rows.items()} == {
        old: old for old in renames
    }


def test_the_harvest_api_and_the_jobs_page_keep_their_words(approved_user, api_key):
    job = harvest_job(approved_user, api_key)
    assert (job.status, job.public_status) == ("queued", "pending")
    job.status = WorkStatus.SUCCEEDED
    assert job.public_status == "done"
    for status in (WorkStatus.RUNNING, WorkStatus.FAILED, WorkStatus.CANCELLED):
        job.status = status
        assert job.public_status == status
    labels = {
        status: JobSubmission(kind=JobKind.HARVEST, request={}, status=status).status_label
        for status in ("queued", "running", "succeeded", "failed")
    }
    assert labels == {
        "queued": "Queued",
        "running": "Sending",
        "succeeded": "Submitted",
        "failed": "Refused",
    }


def test_one_sweep_fails_the_stuck_rows_of_every_table(
    approved_user, api_key, settings, monkeypatch
):
    """A row of each table whose worker died long ago (a job after its last attempt) is
    failed as worker_lost by the beat sweeps, and each through `infra.lifecycle`."""
    long_ago = timezone.now() - dt.timedelta(days=1)
    given_up = {"attempts": settings.ACS_JOB_MAX_ATTEMPTS, "lease_expires_at": long_ago}
    user, running = approved_user, {"status": WorkStatus.RUNNING}
    run_a, run_b = (
        Run.objects.create(user=user, request={}, started_at=long_ago, **running) for _ in range(2)
    )
    rows = [
        CompletionJob.objects.create(
            user=user, key=api_key, idempotency_key="k", request_hash="h", request={},
            **running, **given_up,
        ),
        harvest_job(user, api_key, **running, **given_up),
        run_a,
        SteeringScore.objects.create(group=uuid.uuid4(), user=user, created_at=long_ago, **running),
        RunComparison.objects.create(
            user=user, run_a=run_a, run_b=run_b, created_at=long_ago, **running
        ),
        JobSubmission.objects.create(
            user=user, kind=JobKind.COMPLETION, request={}, created_at=long_ago, **running
        ),
    ]  # fmt: skip
    failed_through_lifecycle = []
    error = lifecycle.work_error

    def recorded(code, message=""):
        failed_through_lifecycle.append(code)
        return error(code, message)

    monkeypatch.setattr(lifecycle, "work_error", recorded)
    before = timezone.now()

    jobs_tasks.jobs_sweep_task()
    playground_tasks.runs_sweep_task()
    portal_tasks.job_submissions_sweep_task()

    # The rows above and run_b, the comparison's other run, stuck as long.
    assert sorted(failed_through_lifecycle) == ["not_sent"] + ["worker_lost"] * 6
    for row in rows:
        row.refresh_from_db()
        assert row.status == WorkStatus.FAILED, row
        assert row.finished_at >= before and row.lease_expires_at is None, row
    assert rows[0].error["code"] == rows[1].error["code"] == "worker_lost"
    assert (
        rows[0].error["message"]
        == rows[1].error["message"]
        == (
            f"The worker running this job stopped {settings.ACS_JOB_MAX_ATTEMPTS} times; the job "
            "was given up."
        )
    )
    assert [row.error_code for row in rows[2:5]] == ["worker_lost"] * 3
    assert rows[2].error_message == lifecycle.WORK_ERRORS["worker_lost"]
    assert (rows[5].error_code, rows[5].error_message) == (
        "not_sent", lifecycle.WORK_ERRORS["not_sent"]
    )  # fmt: skip


def test_the_jobs_sweep_requeues_a_job_whose_worker_died_and_resends_it(
    approved_user, api_key, sent_tasks_of_lifecycle
):
    job = harvest_job(
        approved_user,
        api_key,
        status=WorkStatus.RUNNING,
        attempts=1,
        lease_expires_at=timezone.now() - dt.timedelta(seconds=1),
    )
    assert lifecycle.work_claim(HarvestJob, pk=job.pk, now=timezone.now()) is None
    jobs_tasks.jobs_sweep_task()
    job.refresh_from_db()
    assert (job.status, job.attempts) == (WorkStatus.QUEUED, 1)
    assert sent_tasks_of_lifecycle == [("api.jobs.tasks.harvest_job_run_task", str(job.pk))]
    lease = dt.timedelta(minutes=1)
    attempt = lifecycle.work_claim(HarvestJob, pk=job.pk, now=timezone.now(), lease=lease)
    assert attempt == lifecycle.Attempt(HarvestJob, job.pk, 2)
    job.refresh_from_db()
    assert (job.status, job.attempts) == (WorkStatus.RUNNING, 2)
    assert job.lease_expires_at == job.started_at + lease


@pytest.fixture
def sent_tasks_of_lifecycle(monkeypatch):
    sent = []
    monkeypatch.setattr(
        lifecycle, "task_send", lambda name, *args, countdown=None: sent.append((name, *args))
    )
    return sent


def test_a_heartbeat_renews_a_running_lease_and_tells_a_cancelled_worker_to_stop(
    approved_user, api_key, sent_tasks_of_lifecycle
):
    now, lease = timezone.now(), dt.timedelta(minutes=1)
    job = harvest_job(approved_user, api_key)
    attempt = lifecycle.work_claim(HarvestJob, pk=job.pk, now=now)
    assert attempt.heartbeat(lease=lease, now=now, prompts_done=1)
    job.refresh_from_db()
    assert (job.lease_expires_at, job.prompts_done) == (now + lease, 1)

    assert attempt.requeue(task="t", delay_s=30, lease=lease, now=now)
    job.refresh_from_db()
    assert job.status == WorkStatus.QUEUED
    assert job.lease_expires_at == now + dt.timedelta(seconds=30) + lease
    assert sent_tasks_of_lifecycle == [("t", str(job.pk))]

    attempt = lifecycle.work_claim(HarvestJob, pk=job.pk, now=now)
    HarvestJob.objects.filter(pk=job.pk).update(status=WorkStatus.CANCELLED)
    assert not attempt.heartbeat(lease=lease, now=now)
    assert not attempt.requeue(task="t", delay_s=30, lease=lease, now=now)
    assert len(sent_tasks_of_lifecycle) == 1


def test_a_stale_attempt_writes_and_bills_nothing_and_the_attempt_holding_the_row_does(
    approved_user, api_key, sent_tasks_of_lifecycle
):
    """Attempt 1 claims a job; its lease runs out, the sweep puts the job back to queued and
    attempt 2 claims it. Attempt 1's heartbeat, result write, re-queue and bill are refused;
    attempt 2's go through: one result, billed once."""
    now, lease = timezone.now(), dt.timedelta(minutes=10)
    job = harvest_job(approved_user, api_key)
    first = lifecycle.work_claim(HarvestJob, pk=job.pk, now=now, lease=lease)
    assert harvests.harvest_jobs_recover_stuck(now=now + lease + dt.timedelta(seconds=1)) == 1
    second = lifecycle.work_claim(HarvestJob, pk=job.pk, now=timezone.now(), lease=lease)
    assert (first.number, second.number) == (1, 2)

    def bill(attempt) -> bool:
        hold = job_reserve(key=api_key, prompt_tokens=3, max_tokens=1, completions=1)
        return job_meter(
            hold=hold,
            key=api_key,
            request_id=f"attempt-{attempt.number}",
            endpoint="harvest",
            model="m",
            completions=1,
            prompt_tokens=3,
            completion_tokens=1,
            latency_ms=1.0,
            activation_layers=[1],
            fence=lambda: attempt.fence_steps(prompts_done=1),
        )

    assert not first.heartbeat(lease=lease, now=timezone.now(), prompts_done=1)
    assert not bill(first)
    assert not first.write(status=WorkStatus.SUCCEEDED, files=["stale"])
    assert not first.requeue(task="t", delay_s=1, lease=lease, now=timezone.now())
    job.refresh_from_db()
    assert (job.status, job.attempts, job.prompts_done, job.files) == ("running", 2, 0, [])

    assert second.heartbeat(lease=lease, now=timezone.now())
    assert bill(second)
    assert second.write(status=WorkStatus.SUCCEEDED, files=["result"])
    job.refresh_from_db()
    assert (job.status, job.prompts_done, job.files) == (WorkStatus.SUCCEEDED, 1, ["result"])
    assert [r.request_id for r in UsageRecord.objects.filter(key=api_key)] == ["attempt-2"]
    holds = BudgetReservation.objects.filter(key=api_key).order_by("pk")
    assert [hold.status for hold in holds] == [
        ReservationStatus.RELEASED,
        ReservationStatus.SETTLED,
    ]
    month = UsagePeriod.objects.get(key=api_key, period=windows.MONTH.name)
    assert (month.used_tokens, month.reserved_tokens, month.activation_requests) == (4, 0, 1)
    # Only the sweep's re-send went out: attempt 1's re-queue sent nothing.
    assert sent_tasks_of_lifecycle == [("api.jobs.tasks.harvest_job_run_task", str(job.pk))]
