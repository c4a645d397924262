"""The API's error envelope: `{"error": {"code", "message", "type"}}` with the contract's
headers. Raise `ApiError` anywhere in a request; views turn it into `error_response`.

`ERROR_CODES` is the one table of the contract's codes: each code's HTTP status, its type,
what it means, and its retry policy (codes a retry can help carry `Retry-After`, the table's
default unless the raiser gives one; codes resending cannot fix carry
`X-Should-Retry: false`). The OpenAPI document and the upstream error mapping read it.
"""

import json
from dataclasses import dataclass

from django.http import JsonResponse
from redis import RedisError

from acs_client.responses import ErrorObject, ErrorResponse
from infra.database import pool_exhausted
from metering.budgets import BudgetExceeded
from metering.sql import DatabaseBusy

from .limits import MAX_BODY_BYTES, MAX_RUNNING, MAX_WAITING, STARTS_PER_MINUTE

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
}


@dataclass(frozen=True)
class ErrorCode:
    status: int
    description: str
    retry_after: int | None = None  # seconds a client should wait before retrying
    should_retry: bool = True  # False: resending the same request cannot help
    from_upstream: bool = False  # an upstream's error with this code keeps it

    @property
    def type(self) -> str:
        return _TYPE_BY_STATUS.get(self.status, "server_error")


ERROR_CODES = {
    "invalid_request": ErrorCode(400, "The message names the field or limit.", should_retry=False),
    "bad_json": ErrorCode(400, "The body is not valid JSON.", should_retry=False),
    "model_not_found": ErrorCode(
        400, "Unknown model id; GET /v1/models lists them.", should_retry=False
    ),
    "context_length_exceeded": ErrorCode(
        400, "Prompt tokens + max_tokens exceed the model's context.", should_retry=False
    ),
    "full_vocab_prompt_too_long": ErrorCode(
        400,
        "prompt_logprobs: -1 over too many prompt tokens × n.",
        should_retry=False,
        from_upstream=True,
    ),
    "activation_prompt_too_long": ErrorCode(
        400, "The capture would be too large.", should_retry=False, from_upstream=True
    ),
    "position_steering_unavailable": ErrorCode(
        400, "The upstream cannot steer at positions.", should_retry=False, from_upstream=True
    ),
    "chat_completions_unsupported": ErrorCode(400, "Use POST /v1/completions.", should_retry=False),
    "vllm_context_length": ErrorCode(
        400, "The upstream found the prompt too long.", should_retry=False
    ),
    "vllm_invalid_request": ErrorCode(400, "The upstream refused the request.", should_retry=False),
    "host_not_allowed": ErrorCode(
        400, "The Host header names no host this server answers for.", should_retry=False
    ),
    "non_finite_output": ErrorCode(
        400,
        "The model's output under this request is NaN or infinite (steering whose values "
        "times scale overflow the residual stream does that); lower the steering scale or "
        "values. The tokens computed are billed.",
        should_retry=False,
        from_upstream=True,
    ),
    "deadline_infeasible": ErrorCode(
        400, "Lower max_tokens, or stream the request.", should_retry=False
    ),
    "missing_authorization": ErrorCode(
        401, "Send Authorization: Bearer acs-...", should_retry=False
    ),
    "invalid_api_key": ErrorCode(401, "The key is malformed or unknown.", should_retry=False),
    "key_revoked": ErrorCode(401, "The key was revoked; create a new one.", should_retry=False),
    "key_disabled": ErrorCode(
        401, "The key is paused; resume it on the API keys page.", should_retry=False
    ),
    "account_not_approved": ErrorCode(
        401, "The account is pending or rejected.", should_retry=False
    ),
    "account_suspended": ErrorCode(401, "The account is suspended.", should_retry=False),
    "scope_denied": ErrorCode(403, "The key lacks the completions scope.", should_retry=False),
    "download_url_invalid": ErrorCode(403, "The signed download link is invalid or has expired."),
    "not_found": ErrorCode(404, "No such endpoint, job or file.", should_retry=False),
    "harvest_not_cancellable": ErrorCode(
        409, "The harvest job has already ended.", should_retry=False
    ),
    "idempotency_key_reused": ErrorCode(
        409, "This Idempotency-Key names a job with another body.", should_retry=False
    ),
    "method_not_allowed": ErrorCode(
        405, "Use the method the Allow header names.", should_retry=False
    ),
    "request_timeout": ErrorCode(
        408, "The body did not arrive within the server's time limit; resend it.", retry_after=1
    ),
    "request_too_large": ErrorCode(
        413, f"The body exceeds {MAX_BODY_BYTES // 2**20} MiB.", should_retry=False
    ),
    "unsupported_media_type": ErrorCode(
        415, "Send the body as Content-Type: application/json.", should_retry=False
    ),
    "budget_exceeded": ErrorCode(
        429, "A token budget is spent; no Retry-After.", should_retry=False
    ),
    "activation_quota_exceeded": ErrorCode(
        429, "The monthly activation-request quota is spent.", should_retry=False
    ),
    "spend_cap": ErrorCode(429, "The service is paused.", retry_after=3600),
    "queue_full": ErrorCode(
        429,
        f"{MAX_RUNNING} running and {MAX_WAITING} waiting requests for this key.",
        retry_after=1,
    ),
    "rate_limited": ErrorCode(
        429, f"{STARTS_PER_MINUTE} request starts in the last minute for this key.", retry_after=1
    ),
    "harvest_quota_exceeded": ErrorCode(
        429, "The monthly harvest-job quota is spent.", should_retry=False
    ),
    "harvest_jobs_limit": ErrorCode(
        429, "The key runs its maximum of harvest jobs.", retry_after=30
    ),
    "internal_error": ErrorCode(500, "Report the request id."),
    "worker_lost": ErrorCode(500, "The worker running the job stopped too often."),
    "result_unstorable": ErrorCode(
        500,
        "The job or playground run ran (and was billed once) but its result could not be "
        "stored; the message says why.",
        should_retry=False,
    ),
    "upstream_unreachable": ErrorCode(502, "The upstream could not be reached.", retry_after=5),
    "vllm_engine_dead": ErrorCode(
        502, "The upstream closed the connection mid-response.", retry_after=10, from_upstream=True
    ),
    "vllm_oom": ErrorCode(
        502, "The upstream ran out of memory.", retry_after=5, from_upstream=True
    ),
    "upstream_server_error": ErrorCode(502, "The upstream failed; retry only with Retry-After."),
    "upstream_auth": ErrorCode(502, "The upstream refused the gateway.", should_retry=False),
    "capture_incomplete": ErrorCode(
        502, "The upstream returned a partial capture.", retry_after=5, from_upstream=True
    ),
    "capture_rows_missing": ErrorCode(
        502, "Check each steering vector's hidden size.", should_retry=False, from_upstream=True
    ),
    "circuit_open": ErrorCode(
        503,
        "Every upstream of the model is failing; the gateway checks their health every second.",
        retry_after=2,
    ),
    "capture_preempted": ErrorCode(
        503, "The upstream preempted the capture; retry.", retry_after=5, from_upstream=True
    ),
    "weights_unverified": ErrorCode(
        503,
        "The upstream's weights are not verified yet; retry.",
        retry_after=30,
        from_upstream=True,
    ),
    "kv_cache_unverified": ErrorCode(
        503,
        "The upstream's KV cache is not verified yet; retry.",
        retry_after=30,
        from_upstream=True,
    ),
    "db_pool_exhausted": ErrorCode(
        503, "Every database connection of the gateway is busy; retry.", retry_after=2
    ),
    "redis_unavailable": ErrorCode(
        503,
        "The gateway cannot reach Redis (admission, access checks); retry.",
        retry_after=1,
    ),
    "wrapper_saturated": ErrorCode(
        503, "The upstream is at capacity.", retry_after=2, from_upstream=True
    ),
    "modal_cold_boot": ErrorCode(
        503,
        "The model is loading; poll /v1/models/{id}/status.",
        retry_after=30,
        from_upstream=True,
    ),
    "tokenizer_unavailable": ErrorCode(
        503, "The model's tokenizer could not be reached.", retry_after=5
    ),
    "model_sizes_unknown": ErrorCode(
        503,
        "The model's sizes (context, layers, hidden size, vocabulary) are not known yet: its "
        "upstream did not report them and it has no config.json to read them from.",
        retry_after=5,
    ),
    "activation_engine_unconfigured": ErrorCode(
        503, "The model serves no activations.", should_retry=False
    ),
    "upstream_deadline": ErrorCode(
        504, "The upstream ran out of time; lower max_tokens.", should_retry=False
    ),
}


class ApiError(Exception):
    """An error answered with the contract's envelope, with the HTTP status ERROR_CODES gives
    its `code` (the one place a code's status is written). `retry_after` (seconds) and
    `should_retry` (False adds `X-Should-Retry: false`) default to the code's entry in
    ERROR_CODES. `usage` is an upstream's `{prompt_tokens, completion_tokens}` for work it
    did before failing (billed; never sent to the client)."""

    def __init__(self, code, message, *, retry_after=None, should_retry=None, usage=None):
        super().__init__(message)
        entry = ERROR_CODES[code]
        self.status = entry.status
        self.code = code
        self.message = message
        self.retry_after = entry.retry_after if retry_after is None else retry_after
        self.should_retry = entry.should_retry if should_retry is None else should_retry
        self.usage = usage

    @property
    def error_type(self) -> str:
        return ERROR_CODES[self.code].type

    def body(self) -> dict:
        """The envelope, built through its response model (`acs_client.responses`)."""
        error = ErrorObject(code=self.code, message=self.message, type=self.error_type)
        return ErrorResponse(error=error).model_dump()

    def headers(self) -> dict:
        headers = {}
        if self.retry_after is not None:
            headers["Retry-After"] = str(int(self.retry_after))
        if not self.should_retry:
            headers["X-Should-Retry"] = "false"
        return headers


def metering_refusal(error: BudgetExceeded | DatabaseBusy) -> ApiError:
    """The contract's error for a request that metering refuses: 429 with the budget's code
    (Retry-After for spend_cap, X-Should-Retry: false for spent budgets and quotas), or 503
    db_pool_exhausted."""
    if isinstance(error, DatabaseBusy):
        return ApiError("db_pool_exhausted", str(error))
    return ApiError(error.code, error.message)


def redis_unavailable() -> ApiError:
    """The 503 for a request that needs Redis (every authenticated one: the access
    generation, admission) while Redis is out of reach. Without Redis the per-key limits
    cannot hold across replicas, so the gateway refuses rather than serve unlimited."""
    return ApiError(
        "redis_unavailable",
        "The gateway cannot reach Redis, which admission and access checks need; retry.",
    )


def unexpected_error(error: Exception, request_id: str) -> ApiError:
    """The answer to an exception no code path expected: 503 redis_unavailable when Redis
    failed under the request (it went away mid-request), 503 db_pool_exhausted when no
    database connection freed up in time, else 500 internal_error quoting the request id."""
    if isinstance(error, RedisError):
        return redis_unavailable()
    if pool_exhausted(error):
        return ApiError("db_pool_exhausted", "Every database connection was busy; retry.")
    return ApiError("internal_error", f"Internal error; quote request id {request_id}.")


def worker_lost(attempts: int) -> ApiError:
    """The error of a job given up after its worker died `attempts` times."""
    return ApiError(
        "worker_lost",
        f"The worker running this job stopped {attempts} times; the job was given up.",
    )


def result_unstorable(error: Exception, *, request_id: str) -> ApiError:
    """The error of a job or playground run whose completion ran (and was billed) but whose
    result the database refused, such as text holding \u0000, which PostgreSQL's JSON cannot
    hold. Stored instead of the result, so that the work is neither lost silently nor run and
    billed again."""
    lines = str(error).strip().splitlines()
    reason = lines[0] if lines else type(error).__name__
    return ApiError(
        "result_unstorable",
        f"The completion ran and was billed (request {request_id}), but its result could not "
        f"be stored: {reason}",
    )


def error_response(error: ApiError, request_id: str) -> JsonResponse:
    """The JSON response for `error`, with Retry-After / X-Should-Retry / X-Request-Id."""
    response = JsonResponse(error.body(), status=error.status)
    for name, value in error.headers().items():
        response[name] = value
    response["X-Request-Id"] = request_id
    return response


def sse_error_frame(error: ApiError) -> bytes:
    """The one frame that ends a stream whose 200 was already sent (no [DONE] follows)."""
    return b"data: " + json.dumps(error.body()).encode() + b"\n\n"
