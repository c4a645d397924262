"""The one lifecycle of background work (completion and harvest jobs, playground runs, scores,
comparisons and job submissions, and so the grids made of runs): its status vocabulary, the
claim a worker makes (`work_claim`, starting an `Attempt`), the lease it renews
(`Attempt.heartbeat`), giving a row back to be retried later (`Attempt.requeue`) and the sweep
of rows that can no longer finish on their own (`work_sweep`). Takes model classes as
arguments: imports no app's models.

A row moves queued → running → succeeded | failed | cancelled; an ended row whose stored
output was deleted after its retention is expired. Every move is a conditional update on the
status it leaves, so two workers (or a worker and a cancel, or a worker and the sweep) never
both move one row. Where a page or the API words a status otherwise (the harvest API's
"pending" and "done", the Jobs page's "Submitted"), the model says so next to its table.

Each claim starts an attempt (`Attempt`): the row's `attempts` count after it. A worker holds
its row only while the row is running and claimed by no later attempt, and every write of its
worker (heartbeat, progress, outcome, re-queue) and every bill of its work is conditional on
that, so a worker whose row the sweep took back (its lease ran out while it was paused or slow)
and another worker claimed writes and bills nothing: it finds out at its next write, logs it
and stops.

Every table of background work is a `WorkRow` (its columns are the lifecycle's), and every
row failed by the work itself, not by an answer of /v1, carries a code of `WORK_ERRORS`."""

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import connections, models
from django.db.models import F, Q
from django.db.models.sql import UpdateQuery
from django.utils import timezone

from .tasks import task_send

logger = logging.getLogger(__name__)


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

# The codes a row is failed with by its background work itself (its worker, the sweep, the
# task queue), and what each tells a person. A row failed by an answer of /v1 keeps that
# answer's code and message (`api.errors.ERROR_CODES`).
WORK_ERRORS = {
    "worker_lost": "The worker running it stopped before it finished; run it again.",
    "not_started": "No worker picked it up in time; run it again.",
    "not_sent": "No worker sent this job in time; check the jobs below, then submit again.",
    "queue_unreachable": "The task queue could not be reached: nothing was sent, run or billed.",
    "playground_error": "The playground worker could not process the answer; see its log.",
    "not_comparable": "The runs cannot be compared on the same tokens; the message says why.",
}


def work_error(code: str, message: str = "") -> dict:
    """The error fields of a row its background work fails with `code` (a key of
    WORK_ERRORS): `message`, or the table's words for the code."""
    return {"error_code": code, "error_message": message or WORK_ERRORS[code]}


class WorkRow(models.Model):
    """The columns of a table of background work, which this module's functions read and
    write: `status` (WorkStatus), `attempts` (claims so far), `created_at`, `started_at` (the
    last claim), `finished_at` (when it ended: succeeded, failed or cancelled),
    `lease_expires_at` (see `work_sweep`) and, once it failed, `error_code` and
    `error_message` (a person reads the message; an API body is built from both).

    A new work table subclasses it and adds its own columns::

        class Probe(WorkRow):
            user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE)
            results = models.JSONField(null=True, blank=True)

    its worker claims a row with `work_claim(Probe, pk=..., now=...)`, writes through the
    returned `Attempt` (`write`, `heartbeat`, `requeue`), fails a row with
    `attempt.write(status=WorkStatus.FAILED, finished_at=..., **work_error(code))` (or the
    API's code and message), and beat runs `work_sweep(Probe, ...)` for its stuck rows."""

    status = models.CharField(
        max_length=10, choices=WorkStatus.choices, default=WorkStatus.QUEUED, db_index=True
    )
    attempts = models.PositiveSmallIntegerField(default=0)
    created_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    error_code = models.CharField(max_length=64, blank=True)
    error_message = models.TextField(blank=True)

    class Meta:
        abstract = True

    @property
    def is_active(self) -> bool:
        return self.status in ACTIVE

    @property
    def is_finished(self) -> bool:
        """Ended (succeeded, failed, cancelled; or expired since)."""
        return self.status not in ACTIVE


def work_claim(model, *, pk, now: datetime, lease: timedelta | None = None) -> "Attempt | None":
    """Move row `pk` of `model` (a WorkRow) from queued to running if it is still queued, and
    return the attempt this claim starts; None when another worker, a cancel or the sweep got
    there first. Counts the attempt and stamps its start; with `lease` the row is held until
    `now + lease`, when the sweep takes it back. One statement: the count comes back from
    the update."""
    fields = {"status": WorkStatus.RUNNING, "attempts": F("attempts") + 1, "started_at": now}
    if lease is not None:
        fields["lease_expires_at"] = now + lease
    queued = model.objects.filter(pk=pk, status=WorkStatus.QUEUED)
    with connections[queued.db].cursor() as cursor:
        cursor.execute(*_update_sql(queued, fields, returning="attempts"))
        row = cursor.fetchone()
    return Attempt(model, pk, row[0]) if row else None


@dataclass(frozen=True)
class Attempt:
    """The `number`th attempt at row `pk` of `model` (its `attempts` count once claimed). It
    holds the row while the row is running with that count: every write its worker makes and
    every bill of its work goes through `rows()`, `write`, `heartbeat`, `requeue` or
    `fence_steps`, which change nothing once a later attempt claimed the row (or it was
    cancelled or failed)."""

    model: type[models.Model]
    pk: object
    number: int

    @classmethod
    def of(cls, row: models.Model) -> "Attempt":
        """The attempt of the worker that claimed `row` and then loaded it."""
        return cls(type(row), row.pk, row.attempts)

    def rows(self, *statuses: str) -> models.QuerySet:
        """The row while this attempt holds it (running, or in `statuses` where given)."""
        return self.model.objects.filter(
            pk=self.pk, status__in=statuses or [WorkStatus.RUNNING], attempts=self.number
        )

    def write(self, **fields) -> bool:
        """Write `fields` (an outcome, progress) while this attempt holds the row; False,
        writing nothing, when it no longer does (logged)."""
        if self.rows().update(**fields):
            return True
        self.refused("its write")
        return False

    def heartbeat(self, *, lease: timedelta, now: datetime, **progress) -> bool:
        """Renew the lease until `now + lease`, writing `progress` (what the worker records as
        it goes) with it; False when this attempt no longer holds the row (cancelled, or
        taken back by the sweep): its worker should stop."""
        if self.rows().update(lease_expires_at=now + lease, **progress):
            return True
        self.refused("its heartbeat")
        return False

    def requeue(self, *, task: str, delay_s: float, lease: timedelta, now: datetime) -> bool:
        """Put the row back to queued and send `task` for it in `delay_s` seconds (what an
        upstream asking to retry then wants); the sweep re-sends it if no worker took it
        `lease` after that. False, sending nothing, when this attempt no longer holds it."""
        requeued = self.rows().update(
            status=WorkStatus.QUEUED, lease_expires_at=now + timedelta(seconds=delay_s) + lease
        )
        if not requeued:
            self.refused("its re-queue")
            return False
        task_send(task, str(self.pk), countdown=delay_s)
        return True

    def fence_steps(self, *statuses: str, **fields):
        """Steps (`metering.sql`) that a bill of this attempt's work runs first, in the bill's
        transaction: whether this attempt holds the row (running, or in `statuses`), writing
        `fields` with it. The row stays locked until the bill commits, so the sweep cannot
        take it back between the check and the bill; False: bill nothing."""
        write = fields or {"status": F("status")}  # changes nothing, and locks the row
        rows = yield [_update_sql(self.rows(*statuses), write, returning="pk")]
        if not rows:
            self.refused("its bill", look=False)
        return bool(rows)

    def refused(self, what: str, *, look: bool = True) -> None:
        """Log that `what` of this attempt was refused; `look`: say why (one query)."""
        name = f"{self.model._meta.verbose_name} {self.pk}"
        current = None
        if look:
            current = self.model.objects.filter(pk=self.pk).values("status", "attempts").first()
        if current is not None and current["attempts"] != self.number:
            logger.warning(
                "%s: attempt %s is stale (attempt %s claimed it since, now %s): %s was refused;"
                " its worker stops",
                name, self.number, current["attempts"], current["status"], what,
            )  # fmt: skip
        elif current is not None:
            logger.info(
                "%s: attempt %s no longer holds it (now %s): %s was refused; its worker stops",
                name, self.number, current["status"], what,
            )  # fmt: skip
        else:
            logger.warning(
                "%s: attempt %s no longer holds it (cancelled, failed, or claimed again): %s"
                " was refused; its worker stops",
                name, self.number, what,
            )  # fmt: skip


def _update_sql(rows: models.QuerySet, fields: dict, *, returning: str) -> tuple[str, list]:
    """The UPDATE `rows.update(**fields)` runs, returning the column of field `returning` of
    each row it changed (an update Django's ORM runs only for a row count), for a cursor or
    a metering step."""
    query = rows.query.chain(UpdateQuery)
    query.add_update_values(fields)
    compiler = query.get_compiler(rows.db)
    meta = rows.model._meta
    compiler.returning_fields = [meta.pk if returning == "pk" else meta.get_field(returning)]
    sql, params = compiler.as_sql()
    return sql, list(params)


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
    now: datetime,
    resend: Resend | None = None,
    failed_as: str | None = None,
    message: Callable[[models.Model, str], str] | None = None,
    ended: Callable[[models.Model], object] | None = None,
) -> int:
    """Recover or fail the rows of `model` (a WorkRow) that can no longer finish on their
    own; returns how many it touched. Run by beat.

    A running row matching `running_lost` lost its worker. With `resend` it goes back to
    queued and its task is sent again, until it has used ACS_JOB_MAX_ATTEMPTS attempts;
    otherwise, or then, it fails as `worker_lost`. A queued row matching `queued_lost` was
    never taken by a worker: with `resend` its task is sent again (at most once per lease;
    the conditional claim makes a duplicate message harmless), otherwise it fails as
    `not_started`. `failed_as` replaces both codes where a table tells them apart no
    further. A failed row gets FAILED, the code, `message(row, code)` (by default the code's
    words in WORK_ERRORS) and `now` as its end, and holds no lease; `ended(row)` then runs
    for it. Every write is conditional on the row still matching, so a row that moved
    meanwhile is left alone."""

    def fail(rows: models.QuerySet, row: models.Model, code: str) -> int:
        code = failed_as or code
        error = work_error(code, message(row, code) if message else "")
        if not rows.update(
            status=WorkStatus.FAILED, finished_at=now, lease_expires_at=None, **error
        ):
            return 0
        if ended is not None:
            ended(row)
        return 1

    touched = 0
    lost = model.objects.filter(running_lost, status=WorkStatus.RUNNING)
    for row in lost:
        still_lost = lost.filter(pk=row.pk)
        if resend is None or row.attempts >= settings.ACS_JOB_MAX_ATTEMPTS:
            touched += fail(still_lost, row, "worker_lost")
        elif still_lost.update(status=WorkStatus.QUEUED, lease_expires_at=now + resend.lease):
            touched += 1
            task_send(resend.task, str(row.pk))
    unclaimed = model.objects.filter(queued_lost, status=WorkStatus.QUEUED)
    for row in unclaimed:
        still_unclaimed = unclaimed.filter(pk=row.pk)
        if resend is None:
            touched += fail(still_unclaimed, row, "not_started")
        elif still_unclaimed.update(lease_expires_at=now + resend.lease):
            touched += 1
            task_send(resend.task, str(row.pk))
    return touched
