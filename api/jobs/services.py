"""Writes for completion jobs and harvest jobs.

Submits run in the web process; `*_execute` functions run in a Celery worker, called by the
thin tasks in `tasks.py`. A worker claims a job with a conditional status update and holds it
for a lease; `jobs_recover_stuck` re-queues (or fails) a job whose lease ran out because its
worker died, so no job stays running forever.
"""

import hashlib
import json
import logging
import uuid
from datetime import timedelta

import numpy as np
from asgiref.sync import async_to_sync
from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import F
from django.utils import timezone

from accounts.models import ApiKey
from accounts.services import harvest_quota_consume
from acs_client.codec import bfloat16_bits_to_float32
from api.completions import completion_run
from api.errors import ApiError
from api.models import LanguageModel

from . import tasks
from .capture import capture_batch
from .models import (
    HARVEST_ACTIVE_STATUSES,
    CompletionJob,
    CompletionJobStatus,
    HarvestJob,
    HarvestJobStatus,
)
from .storage import (
    MANIFEST_NAME,
    STATS_NAME,
    Tensor,
    harvest_file_write,
    manifest_bytes,
    safetensors_bytes,
)

logger = logging.getLogger(__name__)

# Response headers of the completion path that are part of the stored result; the rest
# (request id, content type, length, encoding) belong to the response that serves it.
_STORED_RESULT_HEADERS = ("Retry-After", "X-Should-Retry", "X-Acs-Max-Tokens-Clamped")


class IdempotencyKeyReused(Exception):
    """The Idempotency-Key already names a job with another body."""

    def __init__(self, job: CompletionJob):
        super().__init__(f"Idempotency-Key already used for job {job.pk} with another body.")
        self.job = job


def request_fingerprint(payload: dict) -> str:
    """sha256 of the body's canonical JSON (sorted keys, no whitespace): two bodies that
    decode to the same JSON have the same fingerprint."""
    canonical = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


# ---------------------------------------------------------------------------------------
# Completion jobs


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
    transaction.on_commit(lambda: tasks.completion_job_run.delay(str(job.pk)))
    return job, True


def _claim(model, *, job_id, from_status, to_status, lease: timedelta, now):
    """Move one job from `from_status` to `to_status` if it is still there; the job, or None
    when another worker (or a cancel) got there first."""
    claimed = model.objects.filter(pk=job_id, status=from_status).update(
        status=to_status,
        started_at=now,
        lease_expires_at=now + lease,
        attempts=F("attempts") + 1,
    )
    return model.objects.select_related("key", "key__user").get(pk=job_id) if claimed else None


def completion_job_execute(*, job_id, now=None) -> None:
    """Run a queued job through the same completion path as POST /v1/completions (budgets,
    admission and metering apply) and store its response. A response the contract marks as
    retryable (it has Retry-After) re-queues the job after that delay, up to
    ACS_JOB_MAX_ATTEMPTS attempts in all. Does nothing if the job is not queued."""
    now = now or timezone.now()
    job = _claim(
        CompletionJob,
        job_id=job_id,
        from_status=CompletionJobStatus.QUEUED,
        to_status=CompletionJobStatus.RUNNING,
        lease=timedelta(seconds=settings.ACS_COMPLETION_JOB_LEASE_SECONDS),
        now=now,
    )
    if job is None:
        return
    request_id = f"job-{job.pk.hex[:12]}-{uuid.uuid4().hex[:12]}"
    try:
        result = async_to_sync(completion_run)(
            key=job.key,
            payload=job.request,
            request_id=request_id,
            endpoint="completion-jobs",
            workload=job.workload,
        )
        status, body, headers = result.status, result.body, dict(result.headers)
    except Exception:
        # completion_run answers every failure of the request itself; this is the worker's.
        logger.exception("completion job %s crashed (request %s)", job.pk, request_id)
        error = ApiError(
            500, "internal_error", f"The job failed inside the service; quote {request_id}."
        )
        status, body, headers = error.status, error.body(), error.headers()
    retry_after = headers.get("Retry-After")
    if status >= 400 and retry_after and job.attempts < settings.ACS_JOB_MAX_ATTEMPTS:
        CompletionJob.objects.filter(pk=job.pk, status=CompletionJobStatus.RUNNING).update(
            status=CompletionJobStatus.QUEUED,
            lease_expires_at=timezone.now()
            + timedelta(seconds=int(retry_after) + settings.ACS_COMPLETION_JOB_LEASE_SECONDS),
        )
        tasks.completion_job_run.apply_async((str(job.pk),), countdown=int(retry_after))
        return
    CompletionJob.objects.filter(pk=job.pk, status=CompletionJobStatus.RUNNING).update(
        status=CompletionJobStatus.SUCCEEDED if status < 400 else CompletionJobStatus.FAILED,
        finished_at=timezone.now(),
        lease_expires_at=None,
        result_status=status,
        result_body=body,
        result_headers={k: v for k, v in headers.items() if k in _STORED_RESULT_HEADERS},
    )


def _worker_lost_error(attempts: int) -> dict:
    return ApiError(
        500,
        "worker_lost",
        f"The worker running this job stopped {attempts} times; the job was given up.",
    ).body()


def _jobs_recover(model, *, waiting, lease_seconds, task, fail_fields, requeue_fields, now):
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
        elif still_stuck.update(status=waiting, lease_expires_at=next_lease, **requeue_fields):
            touched += 1
            task.delay(str(job.pk))
    unclaimed = model.objects.filter(status=waiting, lease_expires_at__lt=now)
    for job_id in unclaimed.values_list("pk", flat=True):
        if unclaimed.filter(pk=job_id).update(lease_expires_at=next_lease):
            touched += 1
            task.delay(str(job_id))
    return touched


def completion_jobs_recover_stuck(*, now=None) -> int:
    """Re-queue (or fail, after ACS_JOB_MAX_ATTEMPTS attempts) completion jobs whose worker
    died, and re-send queued jobs no worker took within a lease; see `_jobs_recover`."""
    now = now or timezone.now()
    return _jobs_recover(
        CompletionJob,
        waiting=CompletionJobStatus.QUEUED,
        lease_seconds=settings.ACS_COMPLETION_JOB_LEASE_SECONDS,
        task=tasks.completion_job_run,
        fail_fields=lambda attempts: {
            "status": CompletionJobStatus.FAILED,
            "finished_at": now,
            "result_status": 500,
            "result_body": _worker_lost_error(attempts),
        },
        requeue_fields={},
        now=now,
    )


def completion_jobs_expire(*, now=None) -> int:
    """Delete jobs (request and result) that ended more than ACS_COMPLETION_JOB_RETENTION
    seconds ago; returns how many."""
    now = now or timezone.now()
    cutoff = now - timedelta(seconds=settings.ACS_COMPLETION_JOB_RETENTION_SECONDS)
    deleted, _ = CompletionJob.objects.filter(finished_at__lt=cutoff).delete()
    return deleted


# ---------------------------------------------------------------------------------------
# Harvest jobs


class HarvestLimitReached(Exception):
    """The key already runs as many harvest jobs as it may."""


class HarvestNotCancellable(Exception):
    """The job already ended."""


def harvest_job_submit(
    *, key: ApiKey, model: str, prompts: list[str], layers: list[int], add_special_tokens: bool
) -> HarvestJob:
    """Create a pending harvest job for validated input and count it against the key's
    monthly harvest quota. Raises `HarvestLimitReached` when the key already has
    ACS_HARVEST_MAX_ACTIVE_JOBS_PER_KEY pending or running jobs (checked under a lock on the
    key, so concurrent submits cannot overshoot), `BudgetExceeded` (harvest_quota_exceeded)
    when the quota is spent; neither consumes quota."""
    with transaction.atomic():
        ApiKey.objects.select_for_update().filter(pk=key.pk).first()
        active = HarvestJob.objects.filter(key=key, status__in=HARVEST_ACTIVE_STATUSES).count()
        if active >= settings.ACS_HARVEST_MAX_ACTIVE_JOBS_PER_KEY:
            raise HarvestLimitReached(
                f"This key already has {active} harvest jobs pending or running; "
                f"at most {settings.ACS_HARVEST_MAX_ACTIVE_JOBS_PER_KEY} may be."
            )
        harvest_quota_consume(key=key)
        job = HarvestJob.objects.create(
            user_id=key.user_id,
            key=key,
            model=model,
            prompts=prompts,
            layers=layers,
            add_special_tokens=add_special_tokens,
            n_prompts=len(prompts),
            lease_expires_at=timezone.now()
            + timedelta(seconds=settings.ACS_HARVEST_JOB_LEASE_SECONDS),
        )
        transaction.on_commit(lambda: tasks.harvest_job_run.delay(str(job.pk)))
    return job


def harvest_job_cancel(*, job: HarvestJob, now=None) -> HarvestJob:
    """Cancel a pending or running job (a running worker stops before its next batch), or
    raise `HarvestNotCancellable`."""
    now = now or timezone.now()
    cancelled = HarvestJob.objects.filter(pk=job.pk, status__in=HARVEST_ACTIVE_STATUSES).update(
        status=HarvestJobStatus.CANCELLED, completed_at=now, lease_expires_at=None
    )
    job.refresh_from_db()
    if not cancelled:
        raise HarvestNotCancellable(
            f"The job is {job.status}; only pending or running jobs can be cancelled."
        )
    return job


class _HarvestStopped(Exception):
    """The job left `running` (cancelled, or failed by the sweep) while a worker ran it."""


def harvest_job_execute(*, job_id, now=None) -> None:
    """Capture every prompt of a pending job through the model's activation upstream, a batch
    of ACS_HARVEST_BATCH_SIZE prompts at a time, writing one safetensors shard per batch,
    then `stats.safetensors`, then `manifest.json` last. Checks for cancellation and renews
    its lease between batches. A retryable upstream error (Retry-After) puts the job back to
    pending after that delay, up to ACS_JOB_MAX_ATTEMPTS attempts; any other error fails it
    with a message. Does nothing if the job is not pending."""
    now = now or timezone.now()
    job = _claim(
        HarvestJob,
        job_id=job_id,
        from_status=HarvestJobStatus.PENDING,
        to_status=HarvestJobStatus.RUNNING,
        lease=timedelta(seconds=settings.ACS_HARVEST_JOB_LEASE_SECONDS),
        now=now,
    )
    if job is None:
        return
    try:
        files = _harvest(job)
    except _HarvestStopped:
        return
    except ApiError as error:
        if (
            error.should_retry
            and error.retry_after
            and job.attempts < settings.ACS_JOB_MAX_ATTEMPTS
        ):
            if HarvestJob.objects.filter(pk=job.pk, status=HarvestJobStatus.RUNNING).update(
                status=HarvestJobStatus.PENDING,
                prompts_done=0,
                lease_expires_at=timezone.now()
                + timedelta(seconds=error.retry_after + settings.ACS_HARVEST_JOB_LEASE_SECONDS),
            ):
                tasks.harvest_job_run.apply_async((str(job.pk),), countdown=error.retry_after)
            return
        _harvest_fail(job, error)
        return
    except Exception:
        logger.exception("harvest job %s crashed", job.pk)
        _harvest_fail(
            job,
            ApiError(
                500, "internal_error", f"The harvest failed inside the service (job {job.pk})."
            ),
        )
        return
    HarvestJob.objects.filter(pk=job.pk, status=HarvestJobStatus.RUNNING).update(
        status=HarvestJobStatus.DONE,
        prompts_done=job.n_prompts,
        completed_at=timezone.now(),
        lease_expires_at=None,
        files=files,
    )


def _harvest_fail(job: HarvestJob, error: ApiError) -> None:
    HarvestJob.objects.filter(pk=job.pk, status=HarvestJobStatus.RUNNING).update(
        status=HarvestJobStatus.FAILED,
        completed_at=timezone.now(),
        lease_expires_at=None,
        error=error.body()["error"],
    )


def _harvest_heartbeat(job: HarvestJob, *, prompts_done: int) -> None:
    """Record progress and renew the lease, or raise _HarvestStopped if the job was
    cancelled meanwhile."""
    renewed = HarvestJob.objects.filter(pk=job.pk, status=HarvestJobStatus.RUNNING).update(
        prompts_done=prompts_done,
        lease_expires_at=timezone.now() + timedelta(seconds=settings.ACS_HARVEST_JOB_LEASE_SECONDS),
    )
    if not renewed:
        raise _HarvestStopped


def _harvest(job: HarvestJob) -> list[str]:
    """Write the job's files; returns their names, the manifest last."""
    language_model = LanguageModel.objects.filter(name=job.model).first()
    if language_model is None or not language_model.supports_activations:
        raise ApiError(
            503,
            "activation_engine_unconfigured",
            f"Model {job.model!r} no longer offers activation capture.",
        )
    stats = ActivationStats(n_layers=len(job.layers), hidden_size=language_model.hidden_size)
    batch_size = settings.ACS_HARVEST_BATCH_SIZE
    shards = []
    for shard_index, start in enumerate(range(0, job.n_prompts, batch_size)):
        _harvest_heartbeat(job, prompts_done=start)
        batch = job.prompts[start : start + batch_size]
        captures = async_to_sync(capture_batch)(
            language_model,
            prompts=batch,
            layers=job.layers,
            add_special_tokens=job.add_special_tokens,
            first_index=start,
        )
        tensors = {}
        for index, (tokens, bits) in enumerate(captures, start=start):
            tensors[f"prompt_{index}"] = Tensor.bfloat16(bits)
            tensors[f"tokens_{index}"] = Tensor.from_array(np.asarray(tokens, dtype=np.int32))
            stats.add(bits)
        name = f"shard_{shard_index:05d}.safetensors"
        harvest_file_write(job.storage_prefix, name, safetensors_bytes(tensors))
        shards.append({"name": name, "tensors": list(tensors)})
    _harvest_heartbeat(job, prompts_done=job.n_prompts)
    harvest_file_write(job.storage_prefix, STATS_NAME, stats.safetensors())
    manifest = {
        "job_id": str(job.pk),
        "model": job.model,
        "layers": job.layers,
        "hidden_size": language_model.hidden_size,
        "dtype": "bfloat16",
        "n_prompts": job.n_prompts,
        "add_special_tokens": job.add_special_tokens,
        "shards": shards,
        "stats": {"name": STATS_NAME, "tensors": list(ActivationStats.TENSORS)},
    }
    harvest_file_write(job.storage_prefix, MANIFEST_NAME, manifest_bytes(manifest))
    return [*(shard["name"] for shard in shards), STATS_NAME, MANIFEST_NAME]


class ActivationStats:
    """Running per-layer statistics over all positions but the first (the first token's
    residual stream is an outlier in most models): mean and std per hidden unit, and the
    mean L2 norm of the activation vectors."""

    TENSORS = ("mean", "std", "norm_mean", "positions")

    def __init__(self, *, n_layers: int, hidden_size: int):
        self.sum = np.zeros((n_layers, hidden_size), dtype=np.float64)
        self.sum_squares = np.zeros((n_layers, hidden_size), dtype=np.float64)
        self.norm_sum = np.zeros(n_layers, dtype=np.float64)
        self.positions = 0

    def add(self, bits: np.ndarray) -> None:
        """Add one capture given as bfloat16 bit patterns [layers, tokens, hidden]."""
        values = bfloat16_bits_to_float32(bits[:, 1:, :]).astype(np.float64)
        self.sum += values.sum(axis=1)
        self.sum_squares += np.square(values).sum(axis=1)
        self.norm_sum += np.linalg.norm(values, axis=2).sum(axis=1)
        self.positions += values.shape[1]

    def safetensors(self) -> bytes:
        count = max(self.positions, 1)
        mean = self.sum / count
        variance = np.maximum(self.sum_squares / count - np.square(mean), 0.0)
        return safetensors_bytes(
            {
                "mean": Tensor.from_array(mean.astype(np.float32)),
                "std": Tensor.from_array(np.sqrt(variance).astype(np.float32)),
                "norm_mean": Tensor.from_array((self.norm_sum / count).astype(np.float32)),
                "positions": Tensor.from_array(np.asarray([self.positions], dtype=np.int64)),
            }
        )


def harvest_jobs_recover_stuck(*, now=None) -> int:
    """Put harvest jobs whose worker died back to pending (from the first prompt) or fail
    them after ACS_JOB_MAX_ATTEMPTS attempts, and re-send pending jobs no worker took
    within a lease; see `_jobs_recover`."""
    now = now or timezone.now()
    return _jobs_recover(
        HarvestJob,
        waiting=HarvestJobStatus.PENDING,
        lease_seconds=settings.ACS_HARVEST_JOB_LEASE_SECONDS,
        task=tasks.harvest_job_run,
        fail_fields=lambda attempts: {
            "status": HarvestJobStatus.FAILED,
            "completed_at": now,
            "error": _worker_lost_error(attempts)["error"],
        },
        requeue_fields={"prompts_done": 0},
        now=now,
    )
