"""Celery tasks of the Jobs page: thin, ids in; the work is in `services`."""

from celery import shared_task

from .services import JOB_SUBMISSION_SEND_TASK, job_submission_send, job_submissions_fail_stuck


# Registered under the name it had when submissions were the playground's, so that tasks
# queued before a deploy still find it.
@shared_task(name=JOB_SUBMISSION_SEND_TASK, acks_late=True)
def job_submission_send_task(submission_id: str) -> None:
    """Send one job asked for on the Jobs page to /v1 (re-sent by the service when the API
    asks to retry)."""
    job_submission_send(submission_id=submission_id)


@shared_task
def job_submissions_sweep_task() -> int:
    """Refuse job submissions stuck in queued or sending (see `job_submissions_fail_stuck`).
    Returns how many."""
    return job_submissions_fail_stuck()
