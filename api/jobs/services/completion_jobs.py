"""Completion jobs: submitted in the web process, run by a worker through the same completion
path as POST /v1/completions, recovered and expired by the jobs sweep."""

import logging
import uuid
from datetime import timedelta

from asgiref.sync import async_to_sync
from django.conf import settings
from django.db import DataError, IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from accounts.models import ApiKey
from api.auth import key_recheck
from api.completions import completion_run
from api.errors import ApiError, result_unstorable, worker_lost
from infra.database import written_through_reconnects
from infra.lifecycle import Attempt, Resend, WorkStatus, work_claim, work_sweep
from infra.tasks import task_send
from metering.models import UsageRecord

from ..models import CompletionJob
from .idempotency import IdempotencyKeyReused, request_fingerprint

logger = logging.getLogger(__name__)

# Response headers of the completion path that are part of the stored result; the rest
# (request id, content type, length, encoding) belong to the response that serves it.
_STORED_RESULT_HEADERS = ("Retry-After", "X-Should-Retry", "X-Acs-Max-Tokens-Clamped")

# The task that runs a job (`api.jobs.tasks`), enqueued by name.
COMPLETION_JOB_RUN_TASK = "api.jobs.tasks.completion_job_run_task"


def completion_job_submit(
    *, key: ApiKey, idempotency_key: str, payload: dict, workload: str = ""
) -> tuple[CompletionJob, bool]:
    """Create the job for an already validated completion body, or return the job this user
    created earlier with the same Idempotency-Key and body: `(job, created)`. Raises
    `IdempotencyKeyReused` when the key names a job with another body. Concurrent submits
    with one key create exactly one job (a unique constraint decides)."""
    fingerprint = request_fingerprint(payload)
    try:
        with transaction.atomic():
            job = CompletionJob.objects.create(
                user_id=key.user_id,
                key=key,
                idempotency_key=idempotency_key,
                request_hash=fingerprint,
                request=payload,
                workload=workload,
                lease_expires_at=timezone.now()
                + timedelta(seconds=settings.ACS_COMPLETION_JOB_LEASE_SECONDS),
            )
    except IntegrityError:
        job = CompletionJob.objects.get(user_id=key.user_id, idempotency_key=idempotency_key)
        if job.request_hash != fingerprint:
            raise IdempotencyKeyReused(job) from None
        return job, False
    transaction.on_commit(lambda: task_send(COMPLETION_JOB_RUN_TASK, str(job.pk)))
    return job, True


def completion_job_execute(*, job_id, now=None) -> None:
    """Run a queued job through the same completion path as POST /v1/completions (budgets,
    admission and metering apply) and store its response. A key revoked or paused, or an
    account suspended, since the job was submitted fails it with the error the API would
    answer now, before any upstream work. A response the contract marks as
    retryable (it has Retry-After) re-queues the job after that delay, up to
    ACS_JOB_MAX_ATTEMPTS attempts in all. A result the database cannot store fails the job
    with result_unstorable (it ran and was billed once). Does nothing if the job is not
    queued.

    The claim's attempt fences what the worker writes and bills (`infra.lifecycle`): when
    the sweep took the job back meanwhile (its lease ran out while the worker waited, for
    admission or the upstream) and another worker claimed it, this attempt's completion is
    not billed (its hold is released) and its result not stored."""
    now = now or timezone.now()
    lease = timedelta(seconds=settings.ACS_COMPLETION_JOB_LEASE_SECONDS)
    attempt = work_claim(CompletionJob, pk=job_id, now=now, lease=lease)
    if attempt is None:
        return
    job = CompletionJob.objects.select_related("key", "key__user").get(pk=job_id)
    billed = _attempt_billed(job, attempt)
    if billed is not None:
        # An earlier attempt's completion ran and was billed, and its result was lost with
        # its worker: running it again would bill it twice.
        error = result_unstorable(
            RuntimeError("the worker that ran it stopped before storing it"), request_id=billed
        )
        _completion_job_stored(attempt, status=error.status, body=error.body(), headers={})
        return
    request_id = f"{_request_id_prefix(job)}{uuid.uuid4().hex[:12]}"
    try:
        result = async_to_sync(completion_run)(
            key=key_recheck(job.key_id),
            payload=job.request,
            request_id=request_id,
            endpoint="completion-jobs",
            workload=job.workload,
            fence=attempt.fence_steps,
        )
        status, body, headers = result.status, result.body, dict(result.headers)
    except ApiError as refusal:
        # From key_recheck: completion_run answers its own errors as a result.
        status, body, headers = refusal.status, refusal.body(), refusal.headers()
    except Exception:
        # completion_run answers every failure of the request itself; this is the worker's.
        logger.exception("completion job %s crashed (request %s)", job.pk, request_id)
        error = ApiError(
            "internal_error", f"The job failed inside the service; quote {request_id}."
        )
        status, body, headers = error.status, error.body(), error.headers()
    retry_after = headers.get("Retry-After")
    if status >= 400 and retry_after and attempt.number < settings.ACS_JOB_MAX_ATTEMPTS:
        written_through_reconnects(
            lambda: attempt.requeue(
                task=COMPLETION_JOB_RUN_TASK,
                delay_s=int(retry_after),
                lease=timedelta(seconds=settings.ACS_COMPLETION_JOB_LEASE_SECONDS),
                now=timezone.now(),
            )
        )
        return
    try:
        _completion_job_stored(attempt, status=status, body=body, headers=headers)
    except DataError as refused:
        # Run again, the job would be billed again and refused again: it fails, once.
        logger.warning("completion job %s: result not stored: %s", job.pk, refused)
        error = result_unstorable(refused, request_id=request_id)
        _completion_job_stored(
            attempt, status=error.status, body=error.body(), headers=error.headers()
        )


def _request_id_prefix(job: CompletionJob) -> str:
    """What the request ids of every attempt of `job` start with (its usage records')."""
    return f"job-{job.pk.hex[:12]}-"


def _attempt_billed(job: CompletionJob, attempt: Attempt) -> str | None:
    """The request id of an earlier attempt of `job` that was answered and billed, if any
    (an attempt bills only while it holds the job, so a billed one held it before this)."""
    if attempt.number <= 1:
        return None
    billed = UsageRecord.objects.filter(
        key_id=job.key_id, request_id__startswith=_request_id_prefix(job), status_code__lt=400
    )
    return billed.values_list("request_id", flat=True).first()


def _completion_job_stored(attempt: Attempt, *, status: int, body: dict, headers: dict) -> None:
    """`_completion_job_finish`, through a connection PostgreSQL ended or a database that is
    back within a minute: the work it stores ran, and was billed, once."""
    written_through_reconnects(
        lambda: _completion_job_finish(attempt, status=status, body=body, headers=headers)
    )


def _completion_job_finish(attempt: Attempt, *, status: int, body: dict, headers: dict) -> None:
    """Store the job's outcome while `attempt` holds it (DataError when the database cannot
    hold `body`): a completion as it is, an error envelope as its code and message. A stale
    attempt stores nothing."""
    if status < 400:
        outcome = {"status": WorkStatus.SUCCEEDED, "result_status": status, "result_body": body}
    else:
        error = body["error"]
        outcome = {
            "status": WorkStatus.FAILED,
            "error_code": error["code"],
            "error_message": error["message"],
        }
    with transaction.atomic():
        attempt.write(
            finished_at=timezone.now(),
            lease_expires_at=None,
            result_headers={k: v for k, v in headers.items() if k in _STORED_RESULT_HEADERS},
            **outcome,
        )


def completion_jobs_recover_stuck(*, now=None) -> int:
    """Re-queue (or fail, after ACS_JOB_MAX_ATTEMPTS attempts) completion jobs whose worker
    died, and re-send queued jobs no worker took within a lease; see `work_sweep`."""
    now = now or timezone.now()
    return work_sweep(
        CompletionJob,
        running_lost=Q(lease_expires_at__lt=now),
        queued_lost=Q(lease_expires_at__lt=now),
        message=lambda job, _code: worker_lost(job.attempts).message,
        resend=Resend(
            COMPLETION_JOB_RUN_TASK, timedelta(seconds=settings.ACS_COMPLETION_JOB_LEASE_SECONDS)
        ),
        now=now,
    )


def completion_jobs_expire(*, now=None) -> int:
    """Delete jobs (request and result) that ended more than ACS_COMPLETION_JOB_RETENTION
    seconds ago; returns how many."""
    now = now or timezone.now()
    cutoff = now - timedelta(seconds=settings.ACS_COMPLETION_JOB_RETENTION_SECONDS)
    deleted, _ = CompletionJob.objects.filter(finished_at__lt=cutoff).delete()
    return deleted
