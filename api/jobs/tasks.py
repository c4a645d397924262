"""Thin Celery tasks: ids in, call a service. Messages are acknowledged after the task ends
(acks_late), so a worker killed mid-job leaves its message to be delivered again; the
periodic `jobs_sweep_task` catches whatever that misses."""

from celery import shared_task

from .services import completion_jobs, harvests


@shared_task(acks_late=True, ignore_result=True)
def completion_job_run_task(job_id: str) -> None:
    completion_jobs.completion_job_execute(job_id=job_id)


@shared_task(acks_late=True, ignore_result=True)
def harvest_job_run_task(job_id: str) -> None:
    harvests.harvest_job_execute(job_id=job_id)


@shared_task(ignore_result=True)
def jobs_sweep_task() -> None:
    """Recover jobs whose worker died, delete completion jobs past their retention and the
    files of harvest jobs past theirs."""
    completion_jobs.completion_jobs_recover_stuck()
    harvests.harvest_jobs_recover_stuck()
    completion_jobs.completion_jobs_expire()
    harvests.harvest_jobs_expire()
