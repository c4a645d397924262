"""Writes for completion jobs and harvest jobs.

Submits run in the web process; `*_execute` functions run in a Celery worker, called by the
thin tasks in `tasks.py`. A worker claims a job with a conditional status update and holds it
for a lease; `jobs_recover_stuck` re-queues (or fails) a job whose lease ran out because its
worker died, so no job stays running forever.
"""

import hashlib
import json
import logging
import time
import uuid
from datetime import timedelta

import numpy as np
from asgiref.sync import async_to_sync
from django.conf import settings
from django.db import DataError, IntegrityError, transaction
from django.db.models import Case, F, When
from django.utils import timezone

from accounts.models import ApiKey, BudgetReservation, UsageRecord
from accounts.periods import month_start
from acs_client.codec import bfloat16_bits_to_float32
from acs_client.downloads import capture_metadata, file_metadata
from acs_portal.celery import task_send
from api.auth import key_recheck
from api.completions import completion_run
from api.errors import ApiError, metering_refusal, result_unstorable
from api.models import LanguageModel
from api.tokenizer import token_strings
from api.upstream import tenant_of
from metering.budgets import (
    BudgetExceeded,
    budget_activations_refund_steps,
    budget_reserve,
    budget_settle_steps,
    harvest_quota_consume,
    harvest_quota_refund,
)
from metering.sql import run_steps
from metering.usage import usage_records_steps

from .capture import CAPTURE_MAX_TOKENS, Capture, capture_batch, tokenize_batch
from .models import (
    HARVEST_ACTIVE_STATUSES,
    HARVEST_ENDED_STATUSES,
    CompletionJob,
    CompletionJobStatus,
    HarvestJob,
    HarvestJobStatus,
)
from .storage import (
    MANIFEST_NAME,
    STATS_NAME,
    Tensor,
    harvest_bytes_estimate,
    harvest_file_write,
    harvest_files_delete,
    harvest_shard_captures,
    manifest_bytes,
    safetensors_bytes,
)

logger = logging.getLogger(__name__)

# Response headers of the completion path that are part of the stored result; the rest
# (request id, content type, length, encoding) belong to the response that serves it.
_STORED_RESULT_HEADERS = ("Retry-After", "X-Should-Retry", "X-Acs-Max-Tokens-Clamped")

# The tasks that run a job (`tasks.py`), enqueued by name.
COMPLETION_JOB_RUN_TASK = "api.jobs.tasks.completion_job_run_task"
HARVEST_JOB_RUN_TASK = "api.jobs.tasks.harvest_job_run_task"


class IdempotencyKeyReused(Exception):
    """The Idempotency-Key already names a job (completion or harvest) with another body."""

    def __init__(self, job: CompletionJob | HarvestJob):
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
    transaction.on_commit(lambda: task_send(COMPLETION_JOB_RUN_TASK, str(job.pk)))
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
    admission and metering apply) and store its response. A key revoked or paused, or an
    account suspended, since the job was submitted fails it with the error the API would
    answer now, before any upstream work. A response the contract marks as
    retryable (it has Retry-After) re-queues the job after that delay, up to
    ACS_JOB_MAX_ATTEMPTS attempts in all. A result the database cannot store fails the job
    with result_unstorable (it ran and was billed once). Does nothing if the job is not
    queued."""
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
            key=key_recheck(job.key_id),
            payload=job.request,
            request_id=request_id,
            endpoint="completion-jobs",
            workload=job.workload,
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
    if status >= 400 and retry_after and job.attempts < settings.ACS_JOB_MAX_ATTEMPTS:
        CompletionJob.objects.filter(pk=job.pk, status=CompletionJobStatus.RUNNING).update(
            status=CompletionJobStatus.QUEUED,
            lease_expires_at=timezone.now()
            + timedelta(seconds=int(retry_after) + settings.ACS_COMPLETION_JOB_LEASE_SECONDS),
        )
        task_send(COMPLETION_JOB_RUN_TASK, str(job.pk), countdown=int(retry_after))
        return
    try:
        _completion_job_finish(job, status=status, body=body, headers=headers)
    except DataError as refused:
        # Run again, the job would be billed again and refused again: it fails, once.
        logger.warning("completion job %s: result not stored: %s", job.pk, refused)
        error = result_unstorable(refused, request_id=request_id)
        _completion_job_finish(job, status=error.status, body=error.body(), headers=error.headers())


def _completion_job_finish(job: CompletionJob, *, status: int, body: dict, headers: dict) -> None:
    """Store a running job's outcome (DataError when the database cannot hold `body`)."""
    with transaction.atomic():
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
        "worker_lost",
        f"The worker running this job stopped {attempts} times; the job was given up.",
    ).body()


def _jobs_recover(model, *, waiting, lease_seconds, task, fail_fields, now):
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


def completion_jobs_recover_stuck(*, now=None) -> int:
    """Re-queue (or fail, after ACS_JOB_MAX_ATTEMPTS attempts) completion jobs whose worker
    died, and re-send queued jobs no worker took within a lease; see `_jobs_recover`."""
    now = now or timezone.now()
    return _jobs_recover(
        CompletionJob,
        waiting=CompletionJobStatus.QUEUED,
        lease_seconds=settings.ACS_COMPLETION_JOB_LEASE_SECONDS,
        task=COMPLETION_JOB_RUN_TASK,
        fail_fields=lambda attempts: {
            "status": CompletionJobStatus.FAILED,
            "finished_at": now,
            "result_status": 500,
            "result_body": _worker_lost_error(attempts),
        },
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
    *,
    key: ApiKey,
    model: str,
    prompts: list[str],
    layers: list[int],
    add_special_tokens: bool,
    idempotency_key: str = "",
) -> tuple[HarvestJob, bool]:
    """Create a pending harvest job for validated input and count it against the key's
    monthly harvest quota: `(job, True)`. With an `idempotency_key` this user already
    submitted the same request under, `(that job, False)`, consuming nothing; under another
    request, `IdempotencyKeyReused` (concurrent submits with one key create exactly one
    job: a unique constraint decides). Raises `HarvestLimitReached` when the key already has
    ACS_HARVEST_MAX_ACTIVE_JOBS_PER_KEY pending or running jobs (checked under a lock on the
    key, so concurrent submits cannot overshoot), `BudgetExceeded` (harvest_quota_exceeded)
    when the quota is spent; neither consumes quota."""
    fingerprint = request_fingerprint(
        {
            "model": model,
            "prompts": prompts,
            "layers": layers,
            "add_special_tokens": add_special_tokens,
        }
    )
    try:
        with transaction.atomic():
            ApiKey.objects.select_for_update().filter(pk=key.pk).first()
            if idempotency_key and (
                earlier := _harvest_job_named(key.user_id, idempotency_key, fingerprint)
            ):
                return earlier, False
            active = HarvestJob.objects.filter(key=key, status__in=HARVEST_ACTIVE_STATUSES)
            if (count := active.count()) >= settings.ACS_HARVEST_MAX_ACTIVE_JOBS_PER_KEY:
                raise HarvestLimitReached(
                    f"This key already has {count} harvest jobs pending or running; "
                    f"at most {settings.ACS_HARVEST_MAX_ACTIVE_JOBS_PER_KEY} may be."
                )
            harvest_quota_consume(key=key)
            job = HarvestJob.objects.create(
                user_id=key.user_id,
                key=key,
                idempotency_key=idempotency_key,
                request_hash=fingerprint,
                model=model,
                prompts=prompts,
                layers=layers,
                add_special_tokens=add_special_tokens,
                n_prompts=len(prompts),
                lease_expires_at=timezone.now()
                + timedelta(seconds=settings.ACS_HARVEST_JOB_LEASE_SECONDS),
            )
            transaction.on_commit(lambda: task_send(HARVEST_JOB_RUN_TASK, str(job.pk)))
    except IntegrityError:
        if not idempotency_key:
            raise
        # Another key of the user created the job with this Idempotency-Key meanwhile.
        return _harvest_job_named(key.user_id, idempotency_key, fingerprint), False
    return job, True


def _harvest_job_named(user_id, idempotency_key: str, fingerprint: str) -> HarvestJob | None:
    """The user's job submitted with `idempotency_key`, or None; `IdempotencyKeyReused` when
    its request was another."""
    job = HarvestJob.objects.filter(user_id=user_id, idempotency_key=idempotency_key).first()
    if job is not None and job.request_hash != fingerprint:
        raise IdempotencyKeyReused(job)
    return job


def harvest_job_cancel(*, job: HarvestJob, now=None) -> HarvestJob:
    """Cancel a pending or running job (a running worker stops before its next batch and
    keeps the batches it wrote as the job's files) and give its harvest-quota slot back, or
    raise `HarvestNotCancellable`."""
    now = now or timezone.now()
    # A running job keeps its worker's lease until the worker stops (`_harvest_continue`):
    # until then it may still add the batches it wrote (`HarvestJob.is_stopping`).
    cancelled = HarvestJob.objects.filter(pk=job.pk, status__in=HARVEST_ACTIVE_STATUSES).update(
        status=HarvestJobStatus.CANCELLED,
        completed_at=now,
        lease_expires_at=Case(
            When(status=HarvestJobStatus.RUNNING, then=F("lease_expires_at")), default=None
        ),
    )
    job.refresh_from_db()
    if not cancelled:
        raise HarvestNotCancellable(
            f"The job is {job.status}; only pending or running jobs can be cancelled."
        )
    _harvest_quota_give_back(job)
    return job


def _harvest_quota_give_back(job: HarvestJob) -> None:
    """A job that ended without files (cancelled, or failed before it had any to keep) does
    not count against the harvest quota; its captures were paid batch by batch."""
    harvest_quota_refund(key_id=job.key_id, month=month_start(job.created_at))


class _HarvestStopped(Exception):
    """The job left `running` (cancelled, or failed by the sweep) while a worker ran it."""


class _HarvestRefused(Exception):
    """A budget, quota, spend-cap or size limit refused the next batch: the job fails with
    `error` and keeps the batches already written (`files`, `prompts_done`)."""

    def __init__(self, error: ApiError):
        super().__init__(error.message)
        self.error = error
        self.files: list[str] = []
        self.prompts_done = 0


def harvest_job_execute(*, job_id, now=None) -> None:
    """Capture every prompt of a pending job through the model's activation upstream, a batch
    of ACS_HARVEST_BATCH_SIZE prompts at a time, writing one safetensors shard per batch,
    then `stats.safetensors`, then `manifest.json` last. Does nothing if the job is not
    pending.

    Before each batch the worker checks for cancellation and renews its lease, re-checks the
    key and its account (a key revoked or paused, or an account suspended, fails the job
    with the API's code), and pays for the batch like /v1 captures (`_batch_capture`). A
    budget, quota or spend-cap refusal, or a batch that would take the job's files past
    ACS_HARVEST_MAX_JOB_BYTES, fails the job with that code and keeps what was written (with
    its stats and a manifest) for download: a paused service fails a harvest rather than
    holding its job slot for the hour the pause lasts at least. A retryable upstream error
    (Retry-After) puts the job back to pending after that delay, up to ACS_JOB_MAX_ATTEMPTS
    attempts; any other error fails it with a message. Every attempt resumes after the last
    shard an earlier one recorded (`HarvestJob.shards`), and a batch an earlier attempt paid
    for but had not recorded is captured again at no second charge."""
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
    except _HarvestRefused as refused:
        _harvest_fail(job, refused.error, prompts_done=refused.prompts_done, files=refused.files)
        return
    except ApiError as error:
        if (
            error.should_retry
            and error.retry_after
            and job.attempts < settings.ACS_JOB_MAX_ATTEMPTS
        ):
            if HarvestJob.objects.filter(pk=job.pk, status=HarvestJobStatus.RUNNING).update(
                status=HarvestJobStatus.PENDING,
                lease_expires_at=timezone.now()
                + timedelta(seconds=error.retry_after + settings.ACS_HARVEST_JOB_LEASE_SECONDS),
            ):
                task_send(HARVEST_JOB_RUN_TASK, str(job.pk), countdown=error.retry_after)
            return
        _harvest_fail(job, error)
        return
    except Exception:
        logger.exception("harvest job %s crashed", job.pk)
        _harvest_fail(
            job,
            ApiError("internal_error", f"The harvest failed inside the service (job {job.pk})."),
        )
        return
    HarvestJob.objects.filter(pk=job.pk, status=HarvestJobStatus.RUNNING).update(
        status=HarvestJobStatus.DONE,
        prompts_done=job.n_prompts,
        completed_at=timezone.now(),
        lease_expires_at=None,
        files=files,
    )


def _harvest_fail(job: HarvestJob, error: ApiError, **kept) -> None:
    """Fail a running job with `error`; `kept` may set the `files` and `prompts_done` of
    the output it keeps. A job that keeps no files gives its harvest-quota slot back."""
    failed = HarvestJob.objects.filter(pk=job.pk, status=HarvestJobStatus.RUNNING).update(
        status=HarvestJobStatus.FAILED,
        completed_at=timezone.now(),
        lease_expires_at=None,
        error=error.body()["error"],
        **kept,
    )
    if failed and not kept.get("files"):
        _harvest_quota_give_back(job)


def _harvest_heartbeat(job: HarvestJob, output: "_HarvestOutput") -> None:
    """Record the shards written (the progress a later attempt resumes from) and renew the
    lease, or raise _HarvestStopped if the job was cancelled meanwhile."""
    renewed = HarvestJob.objects.filter(pk=job.pk, status=HarvestJobStatus.RUNNING).update(
        prompts_done=output.prompts_written,
        shards=output.shards,
        lease_expires_at=timezone.now() + timedelta(seconds=settings.ACS_HARVEST_JOB_LEASE_SECONDS),
    )
    if not renewed:
        raise _HarvestStopped


def _harvest(job: HarvestJob) -> list[str]:
    """Write the job's files; returns their names, the manifest last."""
    language_model = LanguageModel.objects.filter(name=job.model).first()
    if language_model is None or not language_model.supports_activations:
        raise ApiError(
            "activation_engine_unconfigured",
            f"Model {job.model!r} no longer offers activation capture.",
        )
    output = _HarvestOutput(job, hidden_size=language_model.hidden_size)
    batch_size = settings.ACS_HARVEST_BATCH_SIZE
    for start in range(output.prompts_written, job.n_prompts, batch_size):
        _harvest_continue(job, output)
        key = key_recheck(job.key_id)
        token_lists = async_to_sync(tokenize_batch)(
            language_model,
            prompts=job.prompts[start : start + batch_size],
            layers=job.layers,
            add_special_tokens=job.add_special_tokens,
            first_index=start,
        )
        try:
            output.check_room(token_lists, first_index=start)
            captures = _batch_capture(
                job, key=key, model=language_model, token_lists=token_lists, first_index=start
            )
        except _HarvestRefused as refused:
            refused.prompts_done = output.prompts_written
            refused.files = output.finish() if output.shards else []
            raise
        output.add_shard(
            captures,
            first_index=start,
            token_strings=async_to_sync(token_strings)(language_model, token_lists),
        )
    _harvest_continue(job, output)
    return output.finish()


def _harvest_continue(job: HarvestJob, output: "_HarvestOutput") -> None:
    """`_harvest_heartbeat`; when the job was cancelled meanwhile, first keep the batches it
    wrote (with their stats and a manifest) as the cancelled job's files."""
    try:
        _harvest_heartbeat(job, output)
    except _HarvestStopped:
        kept = {}
        if output.shards:
            kept = {"files": output.finish(), "prompts_done": output.prompts_written}
        HarvestJob.objects.filter(pk=job.pk, status=HarvestJobStatus.CANCELLED).update(
            lease_expires_at=None, **kept
        )
        raise


def _batch_capture(job, *, key, model, token_lists, first_index) -> list[Capture]:
    """Capture one tokenized batch, paid for like the same captures sent to /v1/completions:
    its worst case (its prompt tokens, one generated token and one activation request per
    prompt) is reserved against every budget window first (raising _HarvestRefused with the
    API's code when they cannot cover it), then settled to the upstream's usage, with a usage
    record; a batch that fails is settled to nothing and its activation requests given back."""
    started = time.perf_counter()
    request_id = batch_request_id(job, first_index)
    if _batch_paid(job, key=key, request_id=request_id):
        # An earlier attempt paid for this batch before its worker died: the new attempt
        # captures it again for its files, at no second charge.
        return async_to_sync(capture_batch)(
            model,
            token_lists=token_lists,
            layers=job.layers,
            first_index=first_index,
            tenant=tenant_of(job.user_id),
        )
    try:
        hold = budget_reserve(
            key=key,
            prompt_tokens=sum(len(tokens) for tokens in token_lists),
            max_tokens=CAPTURE_MAX_TOKENS,
            completions=len(token_lists),
            activation=len(token_lists),
        )
    except BudgetExceeded as exceeded:
        raise _HarvestRefused(metering_refusal(exceeded)) from None
    try:
        captures = async_to_sync(capture_batch)(
            model,
            token_lists=token_lists,
            layers=job.layers,
            first_index=first_index,
            tenant=tenant_of(job.user_id),
        )
    except BaseException:
        run_steps(lambda: _batch_settle_steps(hold, held=len(token_lists), captures=[]))
        raise
    record = UsageRecord(
        created_at=timezone.now(),
        key_id=key.pk,
        user_id=key.user_id,
        request_id=request_id,
        endpoint="harvest",
        status_code=200,
        latency_ms=(time.perf_counter() - started) * 1000,
        model=job.model,
        prompt_tokens=sum(capture.prompt_tokens for capture in captures),
        completion_tokens=sum(capture.completion_tokens for capture in captures),
        activation_layers=job.layers,
    )
    run_steps(
        lambda: _batch_settle_steps(hold, held=len(token_lists), captures=captures, record=record)
    )
    return captures


def batch_request_id(job: HarvestJob, first_index: int) -> str:
    """The request id of the batch starting at prompt `first_index`: its usage record's, and
    its shard's."""
    return f"harvest-{job.pk.hex[:12]}-{first_index}"


def _batch_paid(job: HarvestJob, *, key, request_id: str) -> bool:
    """Whether the batch of `request_id` was paid for (it has a usage record): the usage
    record and the settlement of a batch are written in one transaction."""
    return UsageRecord.objects.filter(
        key_id=key.pk, created_at__gte=job.created_at, request_id=request_id
    ).exists()


def _batch_settle_steps(
    hold: BudgetReservation, *, held: int, captures: list[Capture], record=None
):
    """Steps: settle a batch's hold to the usage of its `captures`, give back the activation
    requests of the `held` captures that did not happen, and write its usage `record`."""
    settled = yield from budget_settle_steps(
        reservation_id=hold.pk,
        prompt_tokens=sum(capture.prompt_tokens for capture in captures),
        completion_tokens=sum(capture.completion_tokens for capture in captures),
    )
    if settled and held > len(captures):
        yield from budget_activations_refund_steps(reservation=hold, count=held - len(captures))
    if record is not None:
        yield from usage_records_steps(records=[record])


class _HarvestOutput:
    """A job's files as its batches arrive: one shard per batch, the running stats, and the
    bytes written, kept under ACS_HARVEST_MAX_JOB_BYTES. It starts from the shards an
    earlier attempt recorded (`HarvestJob.shards`), reading them back for the stats."""

    def __init__(self, job: HarvestJob, *, hidden_size: int):
        self.job = job
        self.hidden_size = hidden_size
        self.stats = ActivationStats(n_layers=len(job.layers), hidden_size=hidden_size)
        self.shards: list[dict] = list(job.shards)
        self.bytes_written = sum(shard["bytes"] for shard in self.shards)
        self.prompts_written = sum(shard["prompts"] for shard in self.shards)
        for shard in self.shards:
            for bits in harvest_shard_captures(job.storage_prefix, shard["name"]):
                self.stats.add(bits)

    def check_room(self, token_lists: list[list[int]], *, first_index: int) -> None:
        """Raise _HarvestRefused (request_too_large) if the batch's captures would take the
        job's files past the cap, before they are paid for."""
        limit = settings.ACS_HARVEST_MAX_JOB_BYTES
        needed = harvest_bytes_estimate(
            prompt_tokens=sum(len(tokens) for tokens in token_lists),
            n_layers=len(self.job.layers),
            hidden_size=self.hidden_size,
        )
        if self.bytes_written + needed > limit:
            raise _HarvestRefused(
                harvest_too_large(
                    f"The captures from prompt {first_index} on take this job's files past "
                    f"{limit} bytes, the most one harvest job may write"
                )
            )

    def add_shard(
        self,
        captures: list[Capture],
        *,
        first_index: int,
        token_strings: list[list[str] | None],
    ) -> None:
        """Write one batch's shard: per prompt i its activations (`prompt_i`) and token ids
        (`tokens_i`), with the metadata `acs_client.downloads` reads (token strings, layers,
        model, request id)."""
        tensors, described = {}, []
        request_id = batch_request_id(self.job, first_index)
        for index, (capture, strings) in enumerate(
            zip(captures, token_strings, strict=True), start=first_index
        ):
            tensors[f"prompt_{index}"] = Tensor.bfloat16(capture.bits)
            tensors[f"tokens_{index}"] = Tensor.from_array(
                np.asarray(capture.tokens, dtype=np.int32)
            )
            # A capture generates one token and covers the prompt's positions only.
            described.append(
                capture_metadata(
                    index=index,
                    token_strings=strings,
                    prompt_length=len(capture.tokens),
                    request_id=request_id,
                )
            )
            self.stats.add(capture.bits)
        name = f"shard_{len(self.shards):05d}.safetensors"
        metadata = file_metadata(
            kind="harvest_shard",
            model=self.job.model,
            layers=self.job.layers,
            captures=described,
            job_id=str(self.job.pk),
            hidden_size=self.hidden_size,
            add_special_tokens=self.job.add_special_tokens,
        )
        content = safetensors_bytes(tensors, metadata)
        harvest_file_write(self.job.storage_prefix, name, content)
        self.shards.append(
            {
                "name": name,
                "tensors": list(tensors),
                "prompts": len(captures),
                "bytes": len(content),
            }
        )
        self.bytes_written += len(content)
        self.prompts_written += len(captures)

    def finish(self) -> list[str]:
        """Write the stats and the manifest of the shards written; the files' names, the
        manifest last."""
        harvest_file_write(self.job.storage_prefix, STATS_NAME, self.stats.safetensors())
        manifest = {
            "job_id": str(self.job.pk),
            "model": self.job.model,
            "layers": self.job.layers,
            "hidden_size": self.hidden_size,
            "dtype": "bfloat16",
            "n_prompts": self.job.n_prompts,
            "prompts_captured": self.prompts_written,
            "add_special_tokens": self.job.add_special_tokens,
            "shards": [{"name": s["name"], "tensors": s["tensors"]} for s in self.shards],
            "stats": {"name": STATS_NAME, "tensors": list(ActivationStats.TENSORS)},
        }
        harvest_file_write(self.job.storage_prefix, MANIFEST_NAME, manifest_bytes(manifest))
        return [*(shard["name"] for shard in self.shards), STATS_NAME, MANIFEST_NAME]


def harvest_too_large(reason: str) -> ApiError:
    """The 413 for a harvest whose files would pass ACS_HARVEST_MAX_JOB_BYTES."""
    return ApiError(
        "request_too_large",
        f"{reason}; send fewer or shorter prompts, or capture fewer layers.",
    )


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
    """Put harvest jobs whose worker died back to pending (to resume after their last
    recorded shard) or fail them after ACS_JOB_MAX_ATTEMPTS attempts, and re-send pending
    jobs no worker took within a lease; see `_jobs_recover`."""
    now = now or timezone.now()
    return _jobs_recover(
        HarvestJob,
        waiting=HarvestJobStatus.PENDING,
        lease_seconds=settings.ACS_HARVEST_JOB_LEASE_SECONDS,
        task=HARVEST_JOB_RUN_TASK,
        fail_fields=lambda attempts: {
            "status": HarvestJobStatus.FAILED,
            "completed_at": now,
            "error": _worker_lost_error(attempts)["error"],
        },
        now=now,
    )


def harvest_jobs_expire(*, now=None) -> int:
    """Delete the files of harvest jobs that ended more than ACS_HARVEST_RETENTION_SECONDS
    ago and mark them expired (their prompts go too); returns how many."""
    now = now or timezone.now()
    cutoff = now - timedelta(seconds=settings.ACS_HARVEST_RETENTION_SECONDS)
    ended = HarvestJob.objects.filter(status__in=HARVEST_ENDED_STATUSES, completed_at__lt=cutoff)
    expired = 0
    for job in ended.only("pk"):
        harvest_files_delete(job.storage_prefix)
        expired += ended.filter(pk=job.pk).update(
            status=HarvestJobStatus.EXPIRED, files=[], shards=[], prompts=[]
        )
    return expired
