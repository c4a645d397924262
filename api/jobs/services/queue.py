"""Claiming and recovering jobs of either kind: a worker claims a job with a conditional
status update and holds it for a lease; `jobs_recover` re-queues (or fails) a job whose
lease ran out because its worker died, so no job stays running forever."""

from datetime import timedelta

from django.conf import settings
from django.db.models import F

from api.errors import ApiError
from infra.tasks import task_send


def job_claim(model, *, job_id, from_status, to_status, lease: timedelta, now):
    """Move one job from `from_status` to `to_status` if it is still there; the job, or None
    when another worker (or a cancel) got there first."""
    claimed = model.objects.filter(pk=job_id, status=from_status).update(
        status=to_status,
        started_at=now,
        lease_expires_at=now + lease,
        attempts=F("attempts") + 1,
    )
    return model.objects.select_related("key", "key__user").get(pk=job_id) if claimed else None


def worker_lost_error(attempts: int) -> dict:
    """The error body of a job given up after its worker died `attempts` times."""
    return ApiError(
        "worker_lost",
        f"The worker running this job stopped {attempts} times; the job was given up.",
    ).body()


def jobs_recover(model, *, waiting, lease_seconds, task, fail_fields, now):
    """The sweep for one job model. A running job whose lease passed lost its worker: it is
    put back to `waiting` and re-sent, or failed with `fail_fields(attempts)` once it used
    ACS_JOB_MAX_ATTEMPTS attempts. A waiting job past its lease (its message was lost, or the
    queue is long) is re-sent, at most once per lease; the conditional claim makes duplicate
    messages harmless. Returns the number of jobs touched."""
    touched = 0
    next_lease = now + timedelta(seconds=lease_seconds)
    # "running" is the running status of both job models.
    stuck = model.objects.filter(status="running", lease_expires_at__lt=now)
    for job in stuck.only("pk", "attempts"):
        still_stuck = stuck.filter(pk=job.pk)
        if job.attempts >= settings.ACS_JOB_MAX_ATTEMPTS:
            touched += still_stuck.update(lease_expires_at=None, **fail_fields(job.attempts))
        elif still_stuck.update(status=waiting, lease_expires_at=next_lease):
            touched += 1
            task_send(task, str(job.pk))
    unclaimed = model.objects.filter(status=waiting, lease_expires_at__lt=now)
    for job_id in unclaimed.values_list("pk", flat=True):
        if unclaimed.filter(pk=job_id).update(lease_expires_at=next_lease):
            touched += 1
            task_send(task, str(job_id))
    return touched
