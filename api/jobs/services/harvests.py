"""Harvest jobs: submitted in the web process, run by a worker batch by batch (each batch
paid for like /v1 captures through `metering.jobs`), cancelled, recovered and expired."""

import logging
import time
from datetime import timedelta

from asgiref.sync import async_to_sync
from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Case, F, Q, When
from django.utils import timezone

from accounts.models import ApiKey
from api.auth import key_recheck
from api.errors import ApiError, metering_refusal, worker_lost
from api.models import LanguageModel
from api.selectors import model_sizes_ensure
from api.tokenizer import token_strings
from api.upstream import tenant_of
from infra.lifecycle import ACTIVE, ENDED, Attempt, Resend, WorkStatus, work_claim, work_sweep
from infra.tasks import task_send
from metering.budgets import BudgetExceeded, harvest_quota_consume, harvest_quota_refund
from metering.jobs import job_meter, job_metered, job_release, job_reserve

from ..capture import CAPTURE_MAX_TOKENS, Capture, capture_batch, tokenize_batch
from ..models import HarvestJob
from ..storage import harvest_files_delete
from .harvest_output import HarvestOutput, batch_request_id
from .idempotency import IdempotencyKeyReused, request_fingerprint

logger = logging.getLogger(__name__)

# The task that runs a job (`api.jobs.tasks`), enqueued by name.
HARVEST_JOB_RUN_TASK = "api.jobs.tasks.harvest_job_run_task"


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
    """Create a queued harvest job for validated input and count it against the key's
    monthly harvest quota: `(job, True)`. With an `idempotency_key` this user already
    submitted the same request under, `(that job, False)`, consuming nothing; under another
    request, `IdempotencyKeyReused` (concurrent submits with one key create exactly one
    job: a unique constraint decides). Raises `HarvestLimitReached` when the key already has
    ACS_HARVEST_MAX_ACTIVE_JOBS_PER_KEY queued or running jobs (checked under a lock on the
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
            active = HarvestJob.objects.filter(key=key, status__in=ACTIVE)
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
    """Cancel a queued or running job (a running worker stops before its next batch and
    keeps the batches it wrote as the job's files) and give its harvest-quota slot back, or
    raise `HarvestNotCancellable`."""
    now = now or timezone.now()
    # A running job keeps its worker's lease until the worker stops (`_harvest_continue`):
    # until then it may still add the batches it wrote (`HarvestJob.is_stopping`).
    cancelled = HarvestJob.objects.filter(pk=job.pk, status__in=ACTIVE).update(
        status=WorkStatus.CANCELLED,
        finished_at=now,
        lease_expires_at=Case(
            When(status=WorkStatus.RUNNING, then=F("lease_expires_at")), default=None
        ),
    )
    job.refresh_from_db()
    if not cancelled:
        raise HarvestNotCancellable(
            f"The job is {job.public_status}; only pending or running jobs can be cancelled."
        )
    _harvest_quota_give_back(job)
    return job


def _harvest_quota_give_back(job: HarvestJob) -> None:
    """A job that ended without files (cancelled, or failed before it had any to keep) does
    not count against the harvest quota; its captures were paid batch by batch."""
    harvest_quota_refund(key_id=job.key_id, submitted_at=job.created_at)


class _HarvestStopped(Exception):
    """The job left `running` (cancelled, or failed by the sweep) while a worker ran it."""


class _HarvestRefused(Exception):
    """A budget, quota, spend-cap or size limit refused the next batch, or a batch failed
    for good: the job fails with `error` and keeps the batches already written and paid for
    (`files`, `prompts_done`)."""

    def __init__(self, error: ApiError):
        super().__init__(error.message)
        self.error = error
        self.files: list[str] = []
        self.prompts_done = 0


def harvest_job_execute(*, job_id, now=None) -> None:
    """Capture every prompt of a queued job through the model's activation upstream, a batch
    of ACS_HARVEST_BATCH_SIZE prompts at a time, writing one safetensors shard per batch,
    then `stats.safetensors`, then `manifest.json` last. Does nothing if the job is not
    queued.

    Before each batch the worker checks for cancellation and renews its lease, re-checks the
    key and its account (a key revoked or paused, or an account suspended, fails the job
    with the API's code), and pays for the batch like /v1 captures (`_batch_harvest`). A
    budget, quota or spend-cap refusal, or a batch that would take the job's files past
    ACS_HARVEST_MAX_JOB_BYTES, fails the job with that code and keeps what was written (with
    its stats and a manifest) for download: a paused service fails a harvest rather than
    holding its job slot for the hour the pause lasts at least. A retryable upstream error
    (Retry-After) puts the job back to queued after that delay, up to ACS_JOB_MAX_ATTEMPTS
    attempts; any other error fails it with a message. Every attempt resumes after the last
    shard an earlier one recorded (`HarvestJob.shards`).

    The claim's attempt fences every write of the worker and every bill (`infra.lifecycle`):
    a batch is paid for and recorded as a shard of the job in one transaction, only while
    this attempt holds the job. When the sweep took the job back (its lease ran out while a
    batch took longer, or the worker was paused) and another worker claimed it, this attempt
    bills and records nothing more and stops; the shards it recorded before stay the job's
    (paid once: the next attempt resumes after them). A shard file it writes meanwhile is
    never one of the job's: each attempt after the first names its shards after itself
    (`HarvestOutput`), so it cannot replace the file of a shard a later attempt recorded."""
    now = now or timezone.now()
    lease = timedelta(seconds=settings.ACS_HARVEST_JOB_LEASE_SECONDS)
    attempt = work_claim(HarvestJob, pk=job_id, now=now, lease=lease)
    if attempt is None:
        return
    job = HarvestJob.objects.select_related("key", "key__user").get(pk=job_id)
    try:
        files = _harvest(attempt, job)
    except _HarvestStopped:
        return
    except _HarvestRefused as refused:
        _harvest_fail(
            attempt, job, refused.error, prompts_done=refused.prompts_done, files=refused.files
        )
        return
    except ApiError as error:
        if _retried(error, attempt):
            attempt.requeue(
                task=HARVEST_JOB_RUN_TASK,
                delay_s=error.retry_after,
                lease=timedelta(seconds=settings.ACS_HARVEST_JOB_LEASE_SECONDS),
                now=timezone.now(),
            )
            return
        _harvest_fail(attempt, job, error)
        return
    except Exception:
        logger.exception("harvest job %s crashed", job.pk)
        _harvest_fail(attempt, job, _crashed(job))
        return
    attempt.write(
        status=WorkStatus.SUCCEEDED,
        prompts_done=job.n_prompts,
        finished_at=timezone.now(),
        lease_expires_at=None,
        files=files,
    )


def _retried(error: ApiError, attempt: Attempt) -> bool:
    """Whether the job goes back to the queue for `error` (an upstream that said when to come
    back, while attempts remain) rather than failing: the next attempt resumes after the
    shards recorded."""
    retry = error.should_retry and error.retry_after
    return bool(retry) and attempt.number < settings.ACS_JOB_MAX_ATTEMPTS


def _crashed(job: HarvestJob) -> ApiError:
    return ApiError("internal_error", f"The harvest failed inside the service (job {job.pk}).")


def _harvest_fail(attempt: Attempt, job: HarvestJob, error: ApiError, **kept) -> None:
    """Fail the job with `error` while `attempt` holds it; `kept` may set the `files` and
    `prompts_done` of the output it keeps. A job that keeps no files gives its harvest-quota
    slot back."""
    failed = attempt.write(
        status=WorkStatus.FAILED,
        finished_at=timezone.now(),
        lease_expires_at=None,
        error_code=error.code,
        error_message=error.message,
        **kept,
    )
    if failed and not kept.get("files"):
        _harvest_quota_give_back(job)


def _harvest_heartbeat(attempt: Attempt, output: HarvestOutput) -> None:
    """Record the shards written (the progress a later attempt resumes from) and renew the
    lease, or raise _HarvestStopped if `attempt` no longer holds the job (cancelled, or taken
    back by the sweep)."""
    renewed = attempt.heartbeat(
        lease=timedelta(seconds=settings.ACS_HARVEST_JOB_LEASE_SECONDS),
        now=timezone.now(),
        prompts_done=output.prompts_written,
        shards=output.shards,
    )
    if not renewed:
        raise _HarvestStopped


def _harvest(attempt: Attempt, job: HarvestJob) -> list[str]:
    """Write the job's files; returns their names, the manifest last."""
    language_model = LanguageModel.objects.filter(name=job.model).first()
    if language_model is None or not language_model.supports_activations:
        raise ApiError(
            "activation_engine_unconfigured",
            f"Model {job.model!r} no longer offers activation capture.",
        )
    model_sizes_ensure(language_model)
    output = HarvestOutput(job, hidden_size=language_model.hidden_size, attempt=attempt.number)
    batch_size = settings.ACS_HARVEST_BATCH_SIZE
    for start in range(output.prompts_written, job.n_prompts, batch_size):
        _harvest_continue(attempt, output)
        try:
            key = key_recheck(job.key_id)
            token_lists = async_to_sync(tokenize_batch)(
                language_model,
                prompts=job.prompts[start : start + batch_size],
                layers=job.layers,
                add_special_tokens=job.add_special_tokens,
                first_index=start,
            )
            if too_large := output.overflow(token_lists, first_index=start):
                raise _HarvestRefused(too_large)
            _batch_harvest(
                attempt,
                output,
                key=key,
                model=language_model,
                token_lists=token_lists,
                first_index=start,
            )
        except _HarvestRefused as refused:
            raise _keeping_written(attempt, output, refused) from None
        except ApiError as error:
            if _retried(error, attempt) or not output.shards:
                raise
            # A late failure: the batches written before it were paid for; they are kept.
            raise _keeping_written(attempt, output, _HarvestRefused(error)) from error
        except (_HarvestStopped, KeyboardInterrupt):
            raise
        except Exception as crash:
            if not output.shards:
                raise
            logger.exception("harvest job %s crashed after %s shards", job.pk, len(output.shards))
            raise _keeping_written(attempt, output, _HarvestRefused(_crashed(job))) from crash
    _harvest_continue(attempt, output)
    return output.finish()


def _keeping_written(
    attempt: Attempt, output: HarvestOutput, refused: _HarvestRefused
) -> _HarvestRefused:
    """`refused`, carrying the files of the batches written so far (with their stats and a
    manifest), which are written only while this attempt holds the job."""
    _harvest_continue(attempt, output)
    refused.prompts_done = output.prompts_written
    refused.files = output.finish() if output.shards else []
    return refused


def _harvest_continue(attempt: Attempt, output: HarvestOutput) -> None:
    """`_harvest_heartbeat`; when the job was cancelled meanwhile (while this attempt held
    it), first keep the batches it wrote (with their stats and a manifest) as the cancelled
    job's files. An attempt that lost the job otherwise writes nothing more."""
    try:
        _harvest_heartbeat(attempt, output)
    except _HarvestStopped:
        cancelled = attempt.rows(WorkStatus.CANCELLED)
        if not cancelled.exists():
            raise
        kept = {}
        if output.shards:
            kept = {"files": output.finish(), "prompts_done": output.prompts_written}
        cancelled.update(lease_expires_at=None, **kept)
        raise


def _batch_harvest(
    attempt: Attempt, output: HarvestOutput, *, key, model, token_lists, first_index
) -> None:
    """Capture one tokenized batch and write its shard, paid for like the same captures sent
    to /v1/completions: its worst case (its prompt tokens, one generated token and one
    activation request per prompt) is reserved against every budget window first (raising
    _HarvestRefused with the API's code when they cannot cover it); once its shard is
    written, the hold is settled to the upstream's usage, with a usage record, in the
    transaction that records the shard on the job's row while `attempt` holds the job
    (running, or cancelled while it ran). Otherwise the hold is released, nothing is billed
    or recorded, and _HarvestStopped is raised. A batch that fails is settled to nothing and
    its activation requests given back."""
    job = output.job
    started = time.perf_counter()
    request_id = batch_request_id(job, first_index)
    batch = {"model": model, "token_lists": token_lists, "first_index": first_index}
    strings = {"token_strings": async_to_sync(token_strings)(model, token_lists)}
    if job_metered(key_id=key.pk, request_id=request_id, since=job.created_at):
        # Paid for by an attempt whose worker died before recording it (when a batch's bill
        # and record were written apart): captured again for its files, at no second charge.
        output.add_shard(_capture(job, **batch), first_index=first_index, **strings)
        _harvest_heartbeat(attempt, output)
        return
    try:
        hold = job_reserve(
            key=key,
            prompt_tokens=sum(len(tokens) for tokens in token_lists),
            max_tokens=CAPTURE_MAX_TOKENS,
            completions=len(token_lists),
        )
    except BudgetExceeded as exceeded:
        raise _HarvestRefused(metering_refusal(exceeded)) from None
    try:
        captures = _capture(job, **batch)
        shard = output.shard_write(captures, first_index=first_index, **strings)
    except BaseException:
        job_release(hold=hold)
        raise
    recorded = job_meter(
        hold=hold,
        key=key,
        request_id=request_id,
        endpoint="harvest",
        model=job.model,
        completions=len(captures),
        prompt_tokens=sum(capture.prompt_tokens for capture in captures),
        completion_tokens=sum(capture.completion_tokens for capture in captures),
        latency_ms=(time.perf_counter() - started) * 1000,
        activation_layers=job.layers,
        fence=lambda: attempt.fence_steps(
            WorkStatus.RUNNING,
            WorkStatus.CANCELLED,
            shards=[*output.shards, shard],
            prompts_done=output.prompts_written + len(captures),
        ),
    )
    if not recorded:
        raise _HarvestStopped
    output.shard_keep(shard, captures)


def _capture(job: HarvestJob, *, model, token_lists, first_index) -> list[Capture]:
    return async_to_sync(capture_batch)(
        model,
        token_lists=token_lists,
        layers=job.layers,
        first_index=first_index,
        tenant=tenant_of(job.user_id),
    )


def harvest_jobs_recover_stuck(*, now=None) -> int:
    """Put harvest jobs whose worker died back to queued (to resume after their last
    recorded shard) or fail them after ACS_JOB_MAX_ATTEMPTS attempts, and re-send queued
    jobs no worker took within a lease; see `work_sweep`."""
    now = now or timezone.now()
    return work_sweep(
        HarvestJob,
        running_lost=Q(lease_expires_at__lt=now),
        queued_lost=Q(lease_expires_at__lt=now),
        message=lambda job, _code: worker_lost(job.attempts).message,
        resend=Resend(
            HARVEST_JOB_RUN_TASK, timedelta(seconds=settings.ACS_HARVEST_JOB_LEASE_SECONDS)
        ),
        now=now,
    )


def harvest_jobs_expire(*, now=None) -> int:
    """Delete the files of harvest jobs that ended more than ACS_HARVEST_RETENTION_SECONDS
    ago and mark them expired (their prompts go too); returns how many."""
    now = now or timezone.now()
    cutoff = now - timedelta(seconds=settings.ACS_HARVEST_RETENTION_SECONDS)
    ended = HarvestJob.objects.filter(status__in=ENDED, finished_at__lt=cutoff)
    expired = 0
    for job in ended.only("pk"):
        harvest_files_delete(job.storage_prefix)
        expired += ended.filter(pk=job.pk).update(
            status=WorkStatus.EXPIRED, files=[], shards=[], prompts=[]
        )
    return expired
