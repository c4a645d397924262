"""The /v1 job endpoints (async, like the rest of the gateway): completion jobs, harvest jobs
and the signed harvest downloads. Thin: authenticate, read and validate the body, call one
service, answer in the contract's shape."""

from django.conf import settings
from django.http import FileResponse
from django.views.decorators.csrf import csrf_exempt

from acs_client import responses
from api.admission import admission_slot
from api.auth import authenticate, owner_recheck
from api.completions import CompletionResult
from api.errors import ApiError
from api.http import json_response, read_json_body, request_id, result_response, v1_view
from api.schemas import parse_body
from api.selectors import model_get
from api.validation import validate_completion
from infra.lifecycle import WorkStatus
from metering.sql import run_db

from . import selectors
from .models import CompletionJob, HarvestJob
from .schemas import HarvestRequest
from .services.completion_jobs import completion_job_submit
from .services.harvests import (
    HarvestLimitReached,
    HarvestNotCancellable,
    harvest_job_cancel,
    harvest_job_submit,
)
from .services.idempotency import IdempotencyKeyReused
from .signing import DownloadRefused, download_check
from .storage import MANIFEST_NAME, harvest_file_open
from .validation import validate_harvest

# How long a client polling a completion job's result is asked to wait.
RESULT_POLL_SECONDS = 2
MAX_IDEMPOTENCY_KEY_LENGTH = 255


def _not_found(what: str, job_id) -> ApiError:
    return ApiError("not_found", f"No {what} with id '{job_id}'.")


# ---------------------------------------------------------------------------------------
# Completion jobs


def completion_job_body(job: CompletionJob) -> responses.CompletionJob:
    return responses.CompletionJob(
        id=str(job.pk),
        status=job.status,
        created_at=job.created_at,
        started_at=job.started_at,
        finished_at=job.finished_at,
        error=job.error,
    )


def _idempotency_key(request, *, required: bool) -> str:
    """The request's Idempotency-Key ("" when it sent none and none is `required`)."""
    value = request.headers.get("Idempotency-Key", "").strip()
    if not value and required:
        raise ApiError(
            "invalid_request",
            "The Idempotency-Key header is required: send a unique value per job, and the "
            "same value when you resend the same submit.",
        )
    if len(value) > MAX_IDEMPOTENCY_KEY_LENGTH:
        raise ApiError(
            "invalid_request",
            f"The Idempotency-Key header may be at most {MAX_IDEMPOTENCY_KEY_LENGTH} characters.",
        )
    return value


@csrf_exempt
@v1_view("POST")
async def completion_jobs(request):
    """Submit a completion body as a job: 202 (new), 200 (the same key and body again),
    409 idempotency_key_reused (the same key with another body)."""
    key = await authenticate(request)
    idempotency_key = _idempotency_key(request, required=True)
    payload = read_json_body(request)
    valid = await validate_completion(payload)
    if valid.request.stream:
        raise ApiError(
            "invalid_request",
            "'stream' is not allowed in a completion job; poll the job's result instead.",
        )
    async with admission_slot(key.pk, key.user_id):
        try:
            job, created = await run_db(
                completion_job_submit,
                key=key,
                idempotency_key=idempotency_key,
                payload=payload,
                workload=request.headers.get("X-Acs-Workload", "")[:16],
            )
        except IdempotencyKeyReused as conflict:
            raise _idempotency_conflict(conflict) from None
    return json_response(request, completion_job_body(job), status=202 if created else 200)


def _idempotency_conflict(conflict: IdempotencyKeyReused) -> ApiError:
    return ApiError(
        "idempotency_key_reused",
        f"This Idempotency-Key already names job {conflict.job.pk}, submitted with a "
        "different body; use a new key for a new job.",
    )


async def _own_completion_job(request, job_id) -> CompletionJob:
    key = await authenticate(request)
    job = await run_db(selectors.completion_job_get, user_id=key.user_id, job_id=job_id)
    if job is None:
        raise _not_found("completion job", job_id)
    return job


@v1_view("GET")
async def completion_job_detail(request, job_id):
    return json_response(request, completion_job_body(await _own_completion_job(request, job_id)))


@v1_view("GET")
async def completion_job_result(request, job_id):
    """202 with Retry-After while the job waits or runs; then the stored completion (200)
    or the stored error with its status."""
    job = await _own_completion_job(request, job_id)
    if not job.is_finished:
        response = json_response(request, completion_job_body(job), status=202)
        response["Retry-After"] = str(RESULT_POLL_SECONDS)
        return response
    status, body = job.answer
    return result_response(request, CompletionResult(status, body, dict(job.result_headers)))


# ---------------------------------------------------------------------------------------
# Harvest jobs


def _expiry_message() -> str:
    return (
        f"This job's files were deleted {selectors.harvest_retention_days()} days after it "
        "ended; submit the prompts again to harvest them anew."
    )


def _site_url(path: str) -> str:
    """`path` on the configured site. Never from the request's Host header: a forged Host
    would otherwise put a stranger's host in front of the signed token."""
    return settings.SITE_URL.rstrip("/") + path


def harvest_job_body(job: HarvestJob, *, key_id: int) -> responses.HarvestJob:
    """The job as the API shows it to key `key_id` (its download links work for that key)."""
    links = selectors.harvest_download_links(job=job, key_id=key_id)
    return responses.HarvestJob(
        job_id=str(job.pk),
        status=job.public_status,
        model=job.model,
        layers=job.layers,
        n_prompts=job.n_prompts,
        progress=responses.HarvestProgress(prompts_done=job.prompts_done, n_prompts=job.n_prompts),
        created_at=job.created_at,
        completed_at=job.finished_at,
        error=job.error,
        message=_expiry_message() if job.status == WorkStatus.EXPIRED else None,
        result=None if links is None else _harvest_files(links),
    )


def _harvest_files(links: dict) -> responses.HarvestFiles:
    return responses.HarvestFiles(
        manifest_url=_site_url(links["manifest_url"]),
        shard_urls=[_site_url(url) for url in links["shard_urls"]],
        stats_url=_site_url(links["stats_url"]),
        urls_expire_at=links["urls_expire_at"],
    )


@csrf_exempt
@v1_view("POST")
async def harvest_jobs(request):
    """Submit prompts for residual-stream capture: 202 and the job, as GET shows it.
    With an Idempotency-Key (optional here), as completion jobs: 200 and the existing job
    for the same key and request, 409 idempotency_key_reused for another request."""
    key = await authenticate(request)
    idempotency_key = _idempotency_key(request, required=False)
    harvest = parse_body(HarvestRequest, read_json_body(request))
    model = await model_get(harvest.model)
    layers = await validate_harvest(harvest, model)
    async with admission_slot(key.pk, key.user_id):
        try:
            job, created = await run_db(
                harvest_job_submit,
                key=key,
                model=model.name,
                prompts=harvest.prompts,
                layers=layers,
                add_special_tokens=harvest.add_special_tokens,
                idempotency_key=idempotency_key,
            )
        except IdempotencyKeyReused as conflict:
            raise _idempotency_conflict(conflict) from None
        except HarvestLimitReached as limit:
            raise ApiError("harvest_jobs_limit", f"{limit} Retry when one ends.") from None
    return json_response(
        request, harvest_job_body(job, key_id=key.pk), status=202 if created else 200
    )


@csrf_exempt
@v1_view("GET", "DELETE")
async def harvest_job_detail(request, job_id):
    """GET: the job's status, progress and (when done) signed download URLs. DELETE: cancel
    a pending or running job (409 harvest_not_cancellable otherwise)."""
    key = await authenticate(request)
    job = await run_db(selectors.harvest_job_get, user_id=key.user_id, job_id=job_id)
    if job is None:
        raise _not_found("harvest job", job_id)
    if request.method == "DELETE":
        try:
            job = await run_db(harvest_job_cancel, job=job)
        except HarvestNotCancellable as refusal:
            raise ApiError("harvest_not_cancellable", str(refusal)) from None
    return json_response(request, harvest_job_body(job, key_id=key.pk))


@v1_view("GET")
async def harvest_file(request, job_id, name):
    """One file of a finished harvest, for anyone holding an unexpired signed URL whose key
    (or, for the portal's links, the job's account) may still use the API."""
    try:
        key_id = download_check(token=request.GET.get("token", ""), job_id=job_id, name=name)
    except DownloadRefused as refusal:
        raise ApiError("download_url_invalid", str(refusal)) from None
    job = await run_db(selectors.harvest_job_by_id, job_id=job_id)
    if job is not None:
        await run_db(owner_recheck, user_id=job.user_id, key_id=key_id)
    if job is not None and job.status == WorkStatus.EXPIRED:
        raise ApiError("not_found", _expiry_message())
    if job is None or name not in job.files:
        raise ApiError("not_found", f"No file '{name}' in this job.")
    handle = await run_db(harvest_file_open, job.storage_prefix, name)
    content_type = "application/json" if name == MANIFEST_NAME else "application/octet-stream"
    response = FileResponse(handle, as_attachment=True, filename=name, content_type=content_type)
    response["X-Request-Id"] = request_id(request)
    return response
