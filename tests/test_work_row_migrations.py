"""The migrations that put every table of background work on one row (`infra.lifecycle.WorkRow`)
run forward and back on the real PostgreSQL test database with rows of every status in every
table they change, and keep them: renamed columns keep their values, a job's stored error
becomes its code and message (and back to the object or envelope it was), and a patching
grid's runs failed as "cancelled" become CANCELLED (and back)."""

import datetime as dt
import uuid

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.utils import timezone

from infra.lifecycle import WorkStatus

BEFORE = [("jobs", "0004_work_status"), ("playground", "0012_work_status")]
AFTER = [("jobs", "0008_remove_harvestjob_error"), ("playground", "0015_work_row_data")]
TABLES = [
    ("jobs", "CompletionJob"),
    ("jobs", "HarvestJob"),
    ("playground", "Run"),
    ("playground", "SteeringScore"),
    ("playground", "RunComparison"),
    ("playground", "JobSubmission"),
]
CANCELLED_MESSAGE = "Cancelled with its patching grid before it was sent."


def migrate(targets):
    """Migrate the database to `targets`; the apps (historical models) of that state."""
    executor = MigrationExecutor(connection)
    executor.migrate(targets)
    executor.loader.build_graph()
    return executor.loader.project_state(targets).apps


def snapshot(apps) -> dict:
    """Every row of every table, by table and primary key, as its column values."""
    return {
        name: {row["id"]: row for row in apps.get_model(app, name).objects.values()}
        for app, name in TABLES
    }


def old_rows(apps, user, key) -> None:
    """A row of every status in every table, with an error where one was stored then."""
    at = timezone.now().replace(microsecond=0) - dt.timedelta(hours=1)
    later = at + dt.timedelta(minutes=1)
    CompletionJob, HarvestJob, Run, SteeringScore, RunComparison, JobSubmission = (
        apps.get_model(app, name) for app, name in TABLES
    )
    spent = {"code": "budget_exceeded", "message": "No budget left.", "type": "rate_limit_error"}
    runs = []
    for status in WorkStatus.values:
        ended = status not in (WorkStatus.QUEUED, WorkStatus.RUNNING)
        failed = status == WorkStatus.FAILED
        times = {"started_at": at if status != WorkStatus.QUEUED else None}
        CompletionJob.objects.create(
            user_id=user.pk, key_id=key.pk, idempotency_key=status, request_hash="h",
            request={"prompt": "a"}, status=status, attempts=1, created_at=at,
            finished_at=later if ended else None, **times,
            result_status=429 if failed else (200 if ended else None),
            result_body={"error": spent} if failed else ({"choices": []} if ended else None),
            result_headers={"X-Should-Retry": "false"} if failed else {},
        )  # fmt: skip
        HarvestJob.objects.create(
            user_id=user.pk, key_id=key.pk, model="m", prompts=["a"], layers=[1], n_prompts=1,
            status=status, created_at=at, completed_at=later if ended else None,
            error=spent if failed else None, **times,
        )  # fmt: skip
        # No run was cancelled but a grid's, as failed (below): the reverse makes every
        # cancelled run one of those.
        run_status = WorkStatus.FAILED if status == WorkStatus.CANCELLED else status
        run = Run.objects.create(
            user_id=user.pk, request={"prompt": "a"}, status=run_status, queued_at=at,
            finished_at=later if ended else None,
            error_code="invalid_request" if run_status == WorkStatus.FAILED else "",
            error_message="Bad prompt." if run_status == WorkStatus.FAILED else "", **times,
        )  # fmt: skip
        runs.append(run)
        SteeringScore.objects.create(
            group=uuid.uuid4(), user_id=user.pk, status=status, created_at=at,
            finished_at=later if ended else None,
            error_code="not_comparable" if failed else "",
            error_message="No baseline." if failed else "",
        )  # fmt: skip
        RunComparison.objects.create(
            user_id=user.pk, run_a=run, run_b=runs[0], status=status, created_at=at,
            finished_at=later if ended else None,
            error_code="worker_lost" if failed else "",
            error_message="Did not finish." if failed else "",
        )  # fmt: skip
        JobSubmission.objects.create(
            user_id=user.pk, kind="completion", request={"prompt": "a"}, status=status,
            attempts=1, created_at=at, sent_at=later if ended else None,
            error_code="spend_cap" if failed else "", error_message="Paused." if failed else "",
        )  # fmt: skip
    # A patching grid's run cancelled before it was sent, as the grid's cancel stored it.
    Run.objects.create(
        user_id=user.pk, kind="patched", request={"prompt": [1]}, status=WorkStatus.FAILED,
        queued_at=at, finished_at=later, error_code="cancelled", error_message=CANCELLED_MESSAGE,
    )  # fmt: skip


@pytest.mark.django_db(transaction=True)
def test_the_work_row_migrations_keep_every_row_forward_and_back(approved_user, api_key):
    try:
        old_apps = migrate(BEFORE)
        old_rows(old_apps, approved_user, api_key)
        before = snapshot(old_apps)
        assert all(len(rows) >= len(WorkStatus.values) for rows in before.values())

        after = snapshot(migrate(AFTER))

        assert {name: set(rows) for name, rows in after.items()} == {
            name: set(rows) for name, rows in before.items()
        }
        for name, rows in after.items():
            for pk, row in rows.items():
                old = before[name][pk]
                assert row["status"] == old["status"] or (
                    old["error_code"] == "cancelled" and row["status"] == WorkStatus.CANCELLED
                ), row
                assert row["created_at"] == old.get("created_at", old.get("queued_at"))
                assert row["finished_at"] == old.get(
                    "finished_at", old.get("completed_at", old.get("sent_at"))
                )
        spent = ("budget_exceeded", "No budget left.")
        for pk, job in after["CompletionJob"].items():
            if job["status"] == WorkStatus.FAILED:
                assert (job["error_code"], job["error_message"]) == spent
                assert (job["result_status"], job["result_body"]) == (None, None)
                assert job["result_headers"] == {"X-Should-Retry": "false"}
            else:
                assert job["result_body"] == before["CompletionJob"][pk]["result_body"]
                assert job["error_code"] == ""
        for job in after["HarvestJob"].values():
            failed = job["status"] == WorkStatus.FAILED
            assert (job["error_code"], job["error_message"]) == (spent if failed else ("", ""))
            assert "error" not in job and "completed_at" not in job
        cancelled = [run for run in after["Run"].values() if run["kind"] == "patched"]
        assert [(run["status"], run["error_code"]) for run in cancelled] == [
            (WorkStatus.CANCELLED, "")
        ]
        failed_run = next(run for run in after["Run"].values() if run["error_code"])
        assert (failed_run["error_code"], failed_run["error_message"]) == (
            "invalid_request", "Bad prompt."
        )  # fmt: skip
        for name in ("SteeringScore", "RunComparison"):
            for scoring in after[name].values():
                claimed = scoring["status"] != WorkStatus.QUEUED
                assert scoring["attempts"] == int(claimed)

        assert snapshot(migrate(BEFORE)) == before
    finally:
        migrate(AFTER)
