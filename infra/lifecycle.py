"""The one lifecycle of background work (completion and harvest jobs, playground runs, scores,
comparisons and job submissions, and so the grids made of runs): its status vocabulary, the
claim a worker makes (`work_claim`), the lease it renews (`work_heartbeat`), giving a row back
to be retried later (`work_requeue`) and the sweep of rows that can no longer finish on their
own (`work_sweep`). Takes model classes as arguments: imports no app's models.

A row moves queued → running → succeeded | failed | cancelled; an ended row whose stored
output was deleted after its retention is expired. Every move is a conditional update on the
status it leaves, so two workers (or a worker and a cancel, or a worker and the sweep) never
both move one row. Where a page or the API words a status otherwise (the harvest API's
"pending" and "done", the Jobs page's "Submitted"), the model says so next to its table."""

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import models
from django.db.models import F, Q

from .tasks import task_send


class WorkStatus(models.TextChoices):
    QUEUED = "queued", "Queued"
    RUNNING = "running", "Running"
    SUCCEEDED = "succeeded", "Succeeded"
    FAILED = "failed", "Failed"
    CANCELLED = "cancelled", "Cancelled"
    # Ended, and its stored output deleted after its retention.
    EXPIRED = "expired", "Expired"


ACTIVE = (WorkStatus.QUEUED, WorkStatus.RUNNING)
# Ended with its output still stored: an expired row has ended too, and has nothing left.
ENDED = (WorkStatus.SUCCEEDED, WorkStatus.FAILED, WorkStatus.CANCELLED)


def work_claim(model, *, pk, now: datetime, lease: timedelta | None = None) -> bool:
    """Move row `pk` of `model` from queued to running if it is still queued; whether it did
    (False: another worker, a cancel or the sweep got there first). Counts the attempt and
    stamps its start where the table keeps them (`attempts`, `started_at`); with `lease` the
    row is held until `now + lease` (`lease_expires_at`), when the sweep takes it back."""
    fields = {"status": WorkStatus.RUNNING}
    kept = {field.name for field in model._meta.concrete_fields}
    if "attempts" in kept:
        fields["attempts"] = F("attempts") + 1
    if "started_at" in kept:
        fields["started_at"] = now
    if lease is not None:
        fields["lease_expires_at"] = now + lease
    return bool(model.objects.filter(pk=pk, status=WorkStatus.QUEUED).update(**fields))


def work_heartbeat(model, *, pk, lease: timedelta, now: datetime, **progress) -> bool:
    """Renew the lease of running row `pk` until `now + lease`, writing `progress` (what the
    worker records as it goes) with it; False when the row is no longer running (cancelled,
    or taken back by the sweep): its worker should stop."""
    renewed = model.objects.filter(pk=pk, status=WorkStatus.RUNNING).update(
        lease_expires_at=now + lease, **progress
    )
    return bool(renewed)


def work_requeue(model, *, pk, task: str, delay_s: int, lease: timedelta, now: datetime) -> bool:
    """Put running row `pk` back to queued and send `task` for it in `delay_s` seconds (what
    an upstream asking to retry then wants); the sweep re-sends it if no worker took it
    `lease` after that. False, sending nothing, when the row is no longer running."""
    requeued = model.objects.filter(pk=pk, status=WorkStatus.RUNNING).update(
        status=WorkStatus.QUEUED, lease_expires_at=now + timedelta(seconds=delay_s) + lease
    )
    if requeued:
        task_send(task, str(pk), countdown=delay_s)
    return bool(requeued)


@dataclass(frozen=True)
class Resend:
    """How the sweep gives a leased row back to the workers: its task `task` (sent with the
    row's id) and the lease a re-sent row waits for a worker before it is sent again."""

    task: str
    lease: timedelta


def work_sweep(
    model,
    *,
    running_lost: Q,
    queued_lost: Q,
    failed: Callable[[models.Model, str], dict],
    now: datetime,
    resend: Resend | None = None,
    ended: Callable[[models.Model], object] | None = None,
) -> int:
    """Recover or fail the rows of `model` that can no longer finish on their own; returns how
    many it touched. Run by beat.

    A running row matching `running_lost` lost its worker. With `resend` it goes back to
    queued and its task is sent again, until it has used ACS_JOB_MAX_ATTEMPTS attempts;
    otherwise, or then, it fails as `worker_lost`. A queued row matching `queued_lost` was
    never taken by a worker: with `resend` its task is sent again (at most once per lease;
    the conditional claim makes a duplicate message harmless), otherwise it fails as
    `not_started`. Failing sets FAILED and the fields `failed(row, code)` returns (the
    table's error and finished time); `ended(row)` then runs for each row failed. Every
    write is conditional on the row still matching, so a row that moved meanwhile is left
    alone."""
    touched = 0
    lost = model.objects.filter(running_lost, status=WorkStatus.RUNNING)
    for row in lost:
        still_lost = lost.filter(pk=row.pk)
        if resend is None or row.attempts >= settings.ACS_JOB_MAX_ATTEMPTS:
            touched += _failed(still_lost, row, "worker_lost", failed, ended, resend)
        elif still_lost.update(status=WorkStatus.QUEUED, lease_expires_at=now + resend.lease):
            touched += 1
            task_send(resend.task, str(row.pk))
    unclaimed = model.objects.filter(queued_lost, status=WorkStatus.QUEUED)
    for row in unclaimed:
        still_unclaimed = unclaimed.filter(pk=row.pk)
        if resend is None:
            touched += _failed(still_unclaimed, row, "not_started", failed, ended, resend)
        elif still_unclaimed.update(lease_expires_at=now + resend.lease):
            touched += 1
            task_send(resend.task, str(row.pk))
    return touched


def _failed(rows, row, code: str, failed, ended, resend) -> int:
    fields = failed(row, code)
    if resend is not None:
        # Nothing holds a failed row any more.
        fields["lease_expires_at"] = None
    if not rows.update(status=WorkStatus.FAILED, **fields):
        return 0
    if ended is not None:
        ended(row)
    return 1
