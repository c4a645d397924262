"""Celery tasks of the Jobs page: thin, ids in; the work is in `services`."""

from celery import shared_task
from django.conf import settings

from .services import (
    JOB_SUBMISSION_SEND_TASK,
    SubmissionRetry,
    job_submission_send,
    job_submissions_fail_stuck,
)


# Registered under the name it had when submissions were the playground's, so that tasks
# queued before a deploy still find it.
@shared_task(
    name=JOB_SUBMISSION_SEND_TASK,
    bind=True,
    max_retries=settings.PLAYGROUND_RUN_MAX_RETRIES,
    acks_late=True,
)
def job_submission_send_task(self, submission_id: str) -> None:
    """Send one job asked for on the Jobs page to /v1; retried only when the API asks to."""
    try:
        job_submission_send(
            submission_id=submission_id, final_attempt=self.request.retries >= self.max_retries
        )
    except SubmissionRetry as retry:
        raise self.retry(countdown=retry.countdown) from None


@shared_task
def job_submissions_sweep_task() -> int:
    """Refuse job submissions stuck in queued or sending (see `job_submissions_fail_stuck`).
    Returns how many."""
    return job_submissions_fail_stuck()
