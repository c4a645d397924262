"""Runs: creating them (once per form submission), failing them, and the sweep of the
runs that can no longer finish. Their execution is `run_execution`'s."""

import datetime as dt
import uuid

import kombu.exceptions
from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from accounts.models import User
from accounts.services.playground_key import playground_key_get_or_create
from infra.database import written_through_reconnects
from infra.lifecycle import ACTIVE, Attempt, WorkStatus, work_sweep
from infra.once import created_once
from infra.tasks import TaskQueueUnreachable, task_send, task_send_on_commit
from playground.models import Run, RunKind, SteeringVector, sent_scale
from playground.runs import streams
from playground.tokens import with_token_ids

# The task that executes a run (`tasks.py`), enqueued by name.
RUN_EXECUTE_TASK = "playground.tasks.run_execute_task"


def run_create(
    *,
    user: User,
    request: dict,
    kind: str = RunKind.COMPLETION,
    group: uuid.UUID | None = None,
    vector: SteeringVector | None = None,
    meta: dict | None = None,
    submit_token: uuid.UUID | None = None,
) -> Run:
    """Store a queued run and enqueue its execution once the transaction commits.

    With a `submit_token` (of the form that asked for it), a second call with the same
    token returns the run the first one created (see `submitted_once`)."""
    return submitted_once(
        user=user,
        submit_token=submit_token,
        create=lambda: run_enqueue(
            user=user,
            request=request,
            kind=kind,
            group=group,
            vector=vector,
            meta=meta,
            submit_token=submit_token,
        ),
        existing=lambda run: run,
    )


def run_enqueue(*, user, request, kind, group, vector, meta, submit_token) -> Run:
    """`run_create` without its `submitted_once`: for the callers (`vectors`) that create
    several runs of one form submission inside their own `submitted_once`. Every run asks
    for its tokens' ids (`tokens.with_token_ids`); its `scale` is its request's (`sent_scale`)."""
    with transaction.atomic():
        playground_key_get_or_create(user=user)
        run = Run.objects.create(
            user=user,
            kind=kind,
            group=group,
            scale=sent_scale(request),
            vector=vector,
            request=with_token_ids(request),
            meta=meta or {},
            submit_token=submit_token,
            sent_at=timezone.now() if group is None else None,
        )
        if group is None:
            task_send_on_commit(
                RUN_EXECUTE_TASK,
                str(run.id),
                unsent=lambda error: runs_fail_unsent(run=run, error=error),
            )
        else:
            transaction.on_commit(lambda: group_runs_dispatch(group=group))
    return run


def group_runs_cancel(*, group, now) -> int:
    """Cancel the runs of `group` no worker has taken yet (never sent, so never billed); runs
    already being sent finish. Returns how many were cancelled. Run inside the caller's
    transaction, after it marked its grid, evaluation or Patchscope cancelled."""
    return Run.objects.filter(group=group, status=WorkStatus.QUEUED).update(
        status=WorkStatus.CANCELLED, finished_at=now
    )


def group_runs_dispatch(*, group) -> int:
    """Send the next queued runs of `group` to the workers, in the order they were queued,
    so that at most PLAYGROUND_GROUP_RUNS_IN_FLIGHT of them are sent and unfinished: each
    group's share of the first-in-first-out queue. Called when a group's runs are queued and
    whenever one finishes; the sweep calls it for groups that stalled. If the broker cannot
    be reached, the group's queued runs fail as never sent and TaskQueueUnreachable is
    raised. Returns how many runs it sent."""
    with transaction.atomic():
        # The group's first run, locked: dispatches of one group happen one after another.
        first = Run.objects.select_for_update().filter(group=group).order_by("created_at", "id")
        if first.first() is None:
            return 0
        active = Run.objects.filter(group=group, status__in=ACTIVE)
        free = settings.PLAYGROUND_GROUP_RUNS_IN_FLIGHT - active.exclude(sent_at=None).count()
        waiting = active.filter(status=WorkStatus.QUEUED, sent_at=None).order_by("created_at", "id")
        ids = [str(run_id) for run_id in waiting.values_list("pk", flat=True)[: max(free, 0)]]
        Run.objects.filter(pk__in=ids).update(sent_at=timezone.now())
    for run_id in ids:
        try:
            task_send(RUN_EXECUTE_TASK, run_id)
        except kombu.exceptions.OperationalError as cause:
            error = TaskQueueUnreachable()
            runs_fail_unsent(run=Run.objects.get(pk=run_id), error=error)
            raise error from cause
    return len(ids)


def groups_dispatch_stalled() -> int:
    """`group_runs_dispatch` for every group with runs waiting for their turn (a worker that
    died between a run's end and the next dispatch leaves one so). Run by the sweep."""
    groups = (
        Run.objects.filter(status=WorkStatus.QUEUED, sent_at=None)
        .exclude(group=None)
        .values_list("group", flat=True)
        .distinct()
    )
    return sum(group_runs_dispatch(group=group) for group in groups)


def runs_fail_unsent(*, run: Run, error: TaskQueueUnreachable) -> None:
    """Fail `run`, and the runs of its group still queued, as never sent: the task queue
    could not be reached for it, and the sends of the group's other runs, later hooks of the
    same commit, are not run after that. No stream is ended: a run never sent has none, and
    its page reads the status. Their submit token is cleared, so that the same form posted
    again (once the queue is back) queues anew instead of finding these."""
    unsent = Q(pk=run.pk) if run.group is None else Q(group=run.group)
    Run.objects.filter(unsent, status=WorkStatus.QUEUED).update(
        status=WorkStatus.FAILED,
        error_code=error.code,
        error_message=str(error),
        submit_token=None,
        finished_at=timezone.now(),
    )


def submitted_once(*, user: User, submit_token: uuid.UUID | None, create, existing):
    """`create()`, unless the form submission `submit_token` already created its runs: then
    `existing(first run of that submission)`. `create` stores the token on the first run it
    creates, in its own transaction; the unique (user, submit_token) constraint makes a
    concurrent duplicate fail there and roll back whole, so one submission creates once."""
    return created_once(Run, user=user, submit_token=submit_token, create=create, existing=existing)


def run_fail(
    *, run: Run, code: str, message: str, request_id: str = "", attempt: Attempt | None = None
) -> Run:
    """Mark the run failed with a message a person can read (through a connection
    PostgreSQL ended, or a database back within a minute), end its stream, and send its
    group's next run. With `attempt` (its worker's claim) only while that attempt holds the
    run: a stale worker's failure changes nothing, and the run is returned as it is."""
    rows = Run.objects.filter(pk=run.pk) if attempt is None else attempt.rows()
    failed = written_through_reconnects(
        lambda: rows.update(
            status=WorkStatus.FAILED,
            error_code=code,
            error_message=message,
            request_id=request_id,
            finished_at=timezone.now(),
        )
    )
    if attempt is not None and not failed:
        attempt.refused("its failure")
        run.refresh_from_db()
        return run
    return _run_failed(run)


def _run_failed(run: Run) -> Run:
    """End the stream of a run just failed, with its stored error, and send its group's next
    run."""
    run.refresh_from_db()
    error = {"code": run.error_code, "message": run.error_message}
    streams.publish(run.id, {"type": "end", "status": WorkStatus.FAILED, "error": error})
    if run.group is not None:
        group_runs_dispatch(group=run.group)
    return run


def runs_fail_stuck(*, now=None) -> int:
    """Fail runs that can no longer finish: running past the API's 14-minute request limit
    (their worker died; a redelivered task cannot claim a running run) or still queued as
    long after they were sent (no worker took them; a group's runs waiting for their turn are
    not sent yet). Each ends its stream and sends its group's next run. Returns how many were
    failed. Run by beat every minute; see `work_sweep`."""
    now = now or timezone.now()
    cutoff = now - dt.timedelta(seconds=settings.PLAYGROUND_RUN_STUCK_SECONDS)
    return work_sweep(
        Run,
        running_lost=Q(started_at__lt=cutoff),
        queued_lost=Q(sent_at__lt=cutoff),
        ended=_run_failed,
        now=now,
    )
