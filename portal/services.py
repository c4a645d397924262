"""Jobs asked for on the Jobs page: a completion or harvest job stored as a submission and
sent to /v1 by a Celery worker with the user's playground key."""

import datetime as dt
import uuid

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from accounts.models import User
from accounts.services.playground_key import playground_key_get_or_create, worker_secret
from acs_client.client import AcsApiError, AcsClient
from infra.lifecycle import Attempt, WorkStatus, work_claim, work_sweep
from infra.once import created_once
from infra.tasks import TaskQueueUnreachable, task_send_on_commit
from portal.models import JobKind, JobSubmission

# The task that sends a job submission (`tasks.py`), enqueued by name: the name it was
# registered under while submissions were the playground's, kept for tasks already queued.
JOB_SUBMISSION_SEND_TASK = "playground.tasks.job_submission_send_task"


def job_submission_create(
    *, user: User, kind: str, request: dict, submit_token: uuid.UUID | None = None
) -> JobSubmission:
    """Store a queued submission of a completion or harvest job and enqueue its sending once
    the transaction commits. The same `submit_token` again returns the first submission (a
    unique constraint decides between concurrent posts)."""

    def create() -> JobSubmission:
        with transaction.atomic():
            playground_key_get_or_create(user=user)
            submission = JobSubmission.objects.create(
                user=user, kind=kind, request=request, submit_token=submit_token
            )
            task_send_on_commit(
                JOB_SUBMISSION_SEND_TASK,
                str(submission.id),
                unsent=lambda error: job_submission_refuse_unsent(
                    submission=submission, error=error
                ),
            )
        return submission

    return created_once(JobSubmission, user=user, submit_token=submit_token, create=create)


def job_submission_refuse_unsent(*, submission: JobSubmission, error: TaskQueueUnreachable):
    """Refuse a queued submission whose task the queue could not take (see
    `task_send_on_commit`). Its submit token is cleared, so that the same form posted again
    (once the queue is back) submits anew instead of finding this one."""
    JobSubmission.objects.filter(pk=submission.pk, status=WorkStatus.QUEUED).update(
        status=WorkStatus.FAILED,
        error_code=error.code,
        error_message=str(error),
        submit_token=None,
        finished_at=timezone.now(),
    )


def job_submission_send(*, submission_id) -> JobSubmission | None:
    """Claim a queued submission and send it to /v1 with the user's playground key, a
    completion job or a harvest with the submission's id as its Idempotency-Key (so a resend
    never makes a second job). Keeps the API's job id, or its error. An answer that asks to
    retry within `PLAYGROUND_RUN_MAX_RETRY_DELAY` (or an API that could not be reached) puts
    the submission back to queued and sends it again after that delay (`Attempt.requeue`),
    for at most `PLAYGROUND_RUN_MAX_RETRIES` retries. Returns None if the submission could
    not be claimed. Its writes are fenced by the claim's attempt (`infra.lifecycle`): once
    the sweep refused it, they change nothing."""
    attempt = work_claim(JobSubmission, pk=submission_id, now=timezone.now())
    if attempt is None:
        return None
    submission = JobSubmission.objects.select_related("user").get(pk=submission_id)
    client = AcsClient(base_url=settings.GATEWAY_URL, api_key=worker_secret(submission.user))
    try:
        if submission.kind == JobKind.COMPLETION:
            job_id = client.submit_completion_job(
                submission.request, idempotency_key=str(submission.id)
            ).id
        else:
            job_id = client.submit_harvest(
                submission.request, idempotency_key=str(submission.id)
            ).job_id
    except AcsApiError as error:
        countdown = error.retry_in(at_most=settings.PLAYGROUND_RUN_MAX_RETRY_DELAY)
        if countdown is not None and attempt.number <= settings.PLAYGROUND_RUN_MAX_RETRIES:
            attempt.requeue(
                task=JOB_SUBMISSION_SEND_TASK,
                delay_s=countdown,
                lease=dt.timedelta(seconds=settings.PLAYGROUND_RUN_STUCK_SECONDS),
                now=timezone.now(),
            )
            submission.refresh_from_db()
            return submission
        return _job_submission_refuse(attempt, submission, code=error.code, message=error.message)
    attempt.write(status=WorkStatus.SUCCEEDED, job_id=job_id, finished_at=timezone.now())
    submission.refresh_from_db()
    return submission


def _job_submission_refuse(
    attempt: Attempt, submission: JobSubmission, *, code: str, message: str
) -> JobSubmission:
    attempt.write(
        status=WorkStatus.FAILED,
        error_code=code,
        error_message=message,
        finished_at=timezone.now(),
    )
    submission.refresh_from_db()
    return submission


def job_submissions_fail_stuck(*, now=None) -> int:
    """Refuse submissions still queued or sending after `PLAYGROUND_RUN_STUCK_SECONDS` (no
    worker took them, or their worker died mid-send), so the Jobs page stops waiting for
    them. Returns how many. Run by beat (`tasks.job_submissions_sweep_task`); see `work_sweep`."""
    now = now or timezone.now()
    too_old = Q(created_at__lt=now - dt.timedelta(seconds=settings.PLAYGROUND_RUN_STUCK_SECONDS))
    return work_sweep(
        JobSubmission,
        running_lost=too_old,
        queued_lost=too_old,
        # Either way, all the Jobs page can say is that the job was not sent.
        failed_as="not_sent",
        now=now,
    )
