"""Runs: creating them (once per form submission), failing them, and the sweep of the
runs that can no longer finish. Their execution is `run_execution`'s."""

import datetime as dt
import uuid

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from accounts.models import User
from acs_portal.celery import TaskQueueUnreachable, task_send_on_commit

from .. import streams
from ..models import Run, RunKind, RunStatus, SteeringVector
from .keys import playground_key_get_or_create

# The task that executes a run (`tasks.py`), enqueued by name.
RUN_EXECUTE_TASK = "playground.tasks.run_execute_task"


def run_create(
    *,
    user: User,
    request: dict,
    kind: str = RunKind.COMPLETION,
    group: uuid.UUID | None = None,
    scale: float | None = None,
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
            scale=scale,
            vector=vector,
            meta=meta,
            submit_token=submit_token,
        ),
        existing=lambda run: run,
    )


def run_enqueue(*, user, request, kind, group, scale, vector, meta, submit_token) -> Run:
    """`run_create` without its `submitted_once`: for the callers (`vectors`) that create
    several runs of one form submission inside their own `submitted_once`."""
    with transaction.atomic():
        playground_key_get_or_create(user=user)
        run = Run.objects.create(
            user=user,
            kind=kind,
            group=group,
            scale=scale,
            vector=vector,
            request=request,
            meta=meta or {},
            submit_token=submit_token,
        )
        task_send_on_commit(
            RUN_EXECUTE_TASK,
            str(run.id),
            unsent=lambda error: runs_fail_unsent(run=run, error=error),
        )
    return run


def runs_fail_unsent(*, run: Run, error: TaskQueueUnreachable) -> None:
    """Fail `run`, and the runs of its group still queued, as never sent: the task queue
    could not be reached for it, and the sends of the group's other runs, later hooks of the
    same commit, are not run after that. No stream is ended: a run never sent has none, and
    its page reads the status. Their submit token is cleared, so that the same form posted
    again (once the queue is back) queues anew instead of finding these."""
    unsent = Q(pk=run.pk) if run.group is None else Q(group=run.group)
    Run.objects.filter(unsent, status=RunStatus.QUEUED).update(
        status=RunStatus.FAILED,
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

    def previous() -> Run | None:
        if submit_token is None:
            return None
        return Run.objects.filter(user=user, submit_token=submit_token).first()

    if (run := previous()) is not None:
        return existing(run)
    try:
        return create()
    except IntegrityError:
        if (run := previous()) is None:
            raise
        return existing(run)


def run_fail(*, run: Run, code: str, message: str, request_id: str = "") -> Run:
    """Mark the run failed with a message a person can read, and end its stream."""
    Run.objects.filter(pk=run.pk).update(
        status=RunStatus.FAILED,
        error_code=code,
        error_message=message,
        request_id=request_id,
        finished_at=timezone.now(),
    )
    streams.publish(
        run.id,
        {"type": "end", "status": RunStatus.FAILED, "error": {"code": code, "message": message}},
    )
    run.refresh_from_db()
    return run


def runs_fail_stuck(*, now=None) -> int:
    """Fail runs that can no longer finish: running past the API's 14-minute request limit
    (their worker died; a redelivered task cannot claim a running run) or still queued after
    as long (no worker took them). Returns how many were failed. Run by beat every minute."""
    cutoff = (now or timezone.now()) - dt.timedelta(seconds=settings.PLAYGROUND_RUN_STUCK_SECONDS)
    stuck = Run.objects.filter(
        Q(status=RunStatus.RUNNING, started_at__lt=cutoff)
        | Q(status=RunStatus.QUEUED, queued_at__lt=cutoff)
    )
    failed = 0
    for run in stuck:
        was_running = run.status == RunStatus.RUNNING
        # Conditional, so a run that finished meanwhile is left alone.
        if Run.objects.filter(pk=run.pk, status=run.status).update(status=RunStatus.FAILED):
            run_fail(
                run=run,
                code="worker_lost" if was_running else "not_started",
                message=(
                    "The worker running this request stopped before it finished; re-run it."
                    if was_running
                    else "No worker picked this run up in time; re-run it."
                ),
            )
            failed += 1
    return failed
