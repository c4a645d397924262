"""The API's error envelope: `{"error": {"code", "message", "type"}}` with the contract's
headers. Raise `ApiError` anywhere in a request; views turn it into `error_response`.

Every code of the contract has a default status-independent retry policy: codes a retry can
help carry `Retry-After` (the default below unless the raiser gives one), codes resending
cannot fix carry `X-Should-Retry: false`.
"""

import json

from django.http import JsonResponse

from metering.budgets import BudgetExceeded
from metering.sql import DatabaseBusy

# Seconds a client should wait before retrying, for codes where a retry can help.
DEFAULT_RETRY_AFTER = {
    "queue_full": 1,
    "rate_limited": 1,
    "spend_cap": 3600,
    "upstream_unreachable": 5,
    "vllm_engine_dead": 10,
    "vllm_oom": 5,
    "capture_incomplete": 5,
    "capture_preempted": 5,
    "wrapper_saturated": 2,
    "circuit_open": 30,
    "tokenizer_unavailable": 5,
    "db_pool_exhausted": 2,
    "weights_unverified": 30,
    "kv_cache_unverified": 30,
    "modal_cold_boot": 30,
}

# Codes that resending the same request cannot fix.
NOT_RETRYABLE = {
    "invalid_request",
    "bad_json",
    "model_not_found",
    "context_length_exceeded",
    "full_vocab_prompt_too_long",
    "activation_prompt_too_long",
    "position_steering_unavailable",
    "chat_completions_unsupported",
    "vllm_context_length",
    "vllm_invalid_request",
    "deadline_infeasible",
    "missing_authorization",
    "invalid_api_key",
    "key_revoked",
    "key_disabled",
    "account_not_approved",
    "account_suspended",
    "scope_denied",
    "request_too_large",
    "budget_exceeded",
    "activation_quota_exceeded",
    "harvest_quota_exceeded",
    "upstream_auth",
    "capture_rows_missing",
    "activation_engine_unconfigured",
    "upstream_deadline",
    "not_found",
    "method_not_allowed",
}

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


class ApiError(Exception):
    """An error answered with the contract's envelope. `retry_after` (seconds) defaults per
    code (see DEFAULT_RETRY_AFTER); `should_retry=False` adds `X-Should-Retry: false` and
    defaults to False for the codes in NOT_RETRYABLE."""

    def __init__(self, status, code, message, *, retry_after=None, should_retry=None):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.retry_after = DEFAULT_RETRY_AFTER.get(code) if retry_after is None else retry_after
        self.should_retry = (code not in NOT_RETRYABLE) if should_retry is None else should_retry

    @property
    def error_type(self) -> str:
        return _TYPE_BY_STATUS.get(self.status, "server_error")

    def body(self) -> dict:
        return {"error": {"code": self.code, "message": self.message, "type": self.error_type}}

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
        return ApiError(503, "db_pool_exhausted", str(error))
    return ApiError(429, error.code, error.message)


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
