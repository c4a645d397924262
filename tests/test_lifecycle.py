"""One lifecycle for background work (`infra.lifecycle`): every table of it takes its statuses
from WorkStatus, the migrations that brought harvest jobs and job submissions to it map every
old status (and back), and the words a person or an API client reads did not change."""

import importlib

import pytest
from django.apps import apps

from api.jobs.models import CompletionJob, HarvestJob
from infra.lifecycle import WorkStatus
from playground.models import JobKind, JobSubmission, Run, RunComparison, SteeringScore

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


def _migration(app: str, name: str):
    return importlib.import_module(f"{app}.migrations.{name}")


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
