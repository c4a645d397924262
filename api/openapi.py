"""The OpenAPI 3.1 document of the gateway (served at /v1/openapi.json and rendered at /docs/)."""

import functools

from acs_client.protocol import (
    FULL_VOCAB_MAX_PROMPT_TOKENS,
    MAX_N,
    MAX_STEERING_VECTORS,
    MAX_STOP_STRINGS,
    NON_STREAMING_MAX_TOKENS,
    OUTPUT_WORK_CAP,
)

from .errors import DEFAULT_RETRY_AFTER, NOT_RETRYABLE
from .jobs.schemas import HarvestRequest
from .schemas import (
    MAX_BODY_BYTES,
    CompletionRequest,
)

# Every error code the gateway answers with, its HTTP status and what to do.
ERROR_CODES = [
    (400, "invalid_request", "The message names the field or limit."),
    (400, "bad_json", "The body is not valid JSON."),
    (400, "model_not_found", "Unknown model id; GET /v1/models lists them."),
    (400, "context_length_exceeded", "Prompt tokens + max_tokens exceed the model's context."),
    (400, "full_vocab_prompt_too_long", "prompt_logprobs: -1 over too many prompt tokens × n."),
    (400, "activation_prompt_too_long", "The capture would be too large."),
    (400, "position_steering_unavailable", "The upstream cannot steer at positions."),
    (400, "chat_completions_unsupported", "Use POST /v1/completions."),
    (400, "vllm_context_length", "The upstream found the prompt too long."),
    (400, "vllm_invalid_request", "The upstream refused the request."),
    (400, "deadline_infeasible", "Lower max_tokens, or stream the request."),
    (401, "missing_authorization", "Send Authorization: Bearer acs-..."),
    (401, "invalid_api_key", "The key is malformed or unknown."),
    (401, "key_revoked", "The key was revoked; create a new one."),
    (401, "key_disabled", "The key is paused; resume it on the API keys page."),
    (401, "account_not_approved", "The account is pending or rejected."),
    (401, "account_suspended", "The account is suspended."),
    (403, "scope_denied", "The key lacks the completions scope."),
    (403, "download_url_invalid", "The signed download link is invalid or has expired."),
    (404, "not_found", "No such endpoint, job or file."),
    (409, "harvest_not_cancellable", "The harvest job has already ended."),
    (409, "idempotency_key_reused", "This Idempotency-Key names a job with another body."),
    (405, "method_not_allowed", "Use the method the Allow header names."),
    (413, "request_too_large", "The body exceeds 8 MiB."),
    (429, "budget_exceeded", "A token budget is spent; no Retry-After."),
    (429, "activation_quota_exceeded", "The monthly activation-request quota is spent."),
    (429, "spend_cap", "The service is paused; Retry-After: 3600."),
    (429, "queue_full", "16 running and 64 waiting requests for this key."),
    (429, "rate_limited", "600 request starts in the last minute for this key."),
    (429, "harvest_quota_exceeded", "The monthly harvest-job quota is spent."),
    (429, "harvest_jobs_limit", "The key runs its maximum of harvest jobs; Retry-After: 30."),
    (500, "internal_error", "Report the request id."),
    (502, "upstream_unreachable", "The upstream could not be reached."),
    (502, "vllm_engine_dead", "The upstream closed the connection mid-response."),
    (502, "vllm_oom", "The upstream ran out of memory."),
    (502, "upstream_server_error", "The upstream failed; retry only with Retry-After."),
    (502, "upstream_auth", "The upstream refused the gateway."),
    (502, "capture_incomplete", "The upstream returned a partial capture."),
    (502, "capture_rows_missing", "Check each steering vector's hidden size."),
    (503, "circuit_open", "Every upstream of the model is failing."),
    (503, "capture_preempted", "The upstream preempted the capture; retry."),
    (503, "weights_unverified", "The upstream's weights are not verified yet; retry."),
    (503, "kv_cache_unverified", "The upstream's KV cache is not verified yet; retry."),
    (503, "db_pool_exhausted", "Every database connection of the gateway is busy; retry."),
    (503, "wrapper_saturated", "The upstream is at capacity."),
    (503, "modal_cold_boot", "The model is loading; poll /v1/models/{id}/status."),
    (503, "tokenizer_unavailable", "The model's tokenizer could not be reached."),
    (503, "activation_engine_unconfigured", "The model serves no activations."),
    (504, "upstream_deadline", "The upstream ran out of time; lower max_tokens."),
]

_ERROR = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "code": {"type": "string"},
                "message": {"type": "string"},
                "type": {"type": "string"},
            },
            "required": ["code", "message", "type"],
        }
    },
}


def _error_responses(*statuses) -> dict:
    responses = {}
    for status in statuses:
        codes = [code for s, code, _ in ERROR_CODES if s == status]
        responses[str(status)] = {
            "description": "Error codes: " + ", ".join(codes),
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
        }
    return responses


def _auth_errors():
    return _error_responses(401, 403)


@functools.cache
def openapi_document() -> dict:
    request_schema = CompletionRequest.model_json_schema(
        ref_template="#/components/schemas/{model}"
    )
    definitions = request_schema.pop("$defs", {})
    harvest_schema = HarvestRequest.model_json_schema(ref_template="#/components/schemas/{model}")
    completion_errors = _error_responses(400, 401, 403, 413, 429, 500, 502, 503, 504)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "ACS API",
            "version": "1",
            "description": (
                "Plain text completions with logprobs, residual-stream capture and "
                f"activation steering. Limits: n ≤ {MAX_N}, stop ≤ {MAX_STOP_STRINGS} strings, "
                "logprobs and prompt_logprobs ≤ 100 (prompt_logprobs -1: at most "
                f"{FULL_VOCAB_MAX_PROMPT_TOKENS} prompt tokens × n), prompt_count × n × "
                f"max_tokens ≤ {OUTPUT_WORK_CAP}, non-streaming max_tokens ≤ "
                f"{NON_STREAMING_MAX_TOKENS}, body ≤ {MAX_BODY_BYTES} bytes, ≤ "
                f"{MAX_STEERING_VECTORS} steering vectors. Per key: 16 running + 64 waiting "
                "requests, 600 starts per minute."
            ),
        },
        "servers": [{"url": "/"}],
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {
                "CompletionRequest": request_schema,
                "HarvestRequest": harvest_schema,
                "Error": _ERROR,
                **definitions,
            },
        },
        "security": [{"bearer": []}],
        "paths": {
            "/v1/completions": {
                "post": {
                    "summary": "Create a completion (stream: true for server-sent events)",
                    "requestBody": _completion_body(),
                    "responses": {
                        "200": {
                            "description": "The completion, or a text/event-stream of chunks "
                            "ending in data: [DONE] (an error after the 200 arrives as one "
                            'data: {"error": ...} frame and no [DONE]).',
                            "headers": {
                                "X-Request-Id": {"schema": {"type": "string"}},
                                "X-Acs-Max-Tokens-Clamped": {"schema": {"type": "string"}},
                                "Server-Timing": {"schema": {"type": "string"}},
                            },
                        },
                        **completion_errors,
                    },
                }
            },
            "/v1/chat/completions": {
                "post": {
                    "summary": "Not supported: answers 400 chat_completions_unsupported",
                    "responses": _error_responses(400),
                }
            },
            "/v1/models": {
                "get": {
                    "summary": "List the models and their capabilities",
                    "responses": {"200": {"description": "{object: list, data: [model]}"}}
                    | _auth_errors(),
                }
            },
            "/v1/models/{model_id}": {
                "get": {
                    "summary": "One model and its capabilities",
                    "parameters": [_MODEL_ID],
                    "responses": {"200": {"description": "The model card"}}
                    | _auth_errors()
                    | _error_responses(404),
                }
            },
            "/v1/models/{model_id}/status": {
                "get": {
                    "summary": "Whether the model is loaded upstream ({id, warm})",
                    "parameters": [_MODEL_ID],
                    "responses": {"200": {"description": "{id, warm, status}"}}
                    | _auth_errors()
                    | _error_responses(404),
                }
            },
            "/v1/usage": {
                "get": {
                    "summary": "The key's and account's budget windows",
                    "description": (
                        "`reserved` counts the worst cases of running requests and budget "
                        "the gateway has leased for the key (given back 2 s after its last "
                        "request); `used` trails finished requests by up to 50 ms."
                    ),
                    "responses": {
                        "200": {
                            "description": "{windows: [{name, used, limit, remaining, resets_at}]}"
                        }
                    }
                    | _auth_errors(),
                }
            },
            "/v1/completion-jobs": {
                "post": {
                    "summary": "Submit a completion body as a job (runs after you disconnect)",
                    "description": (
                        "The same Idempotency-Key and body returns the existing job (200); the "
                        "same key with another body is 409 idempotency_key_reused. stream is "
                        "not allowed."
                    ),
                    "parameters": [_IDEMPOTENCY_KEY],
                    "requestBody": _completion_body(),
                    "responses": {
                        "202": {"description": "The new job: {id, object, status: queued, ...}"},
                        "200": {"description": "The job this Idempotency-Key already names"},
                    }
                    | _error_responses(400, 401, 403, 409, 413, 429),
                }
            },
            "/v1/completion-jobs/{job_id}": {
                "get": {
                    "summary": "A completion job's status (queued, running, succeeded, failed)",
                    "parameters": [_JOB_ID],
                    "responses": {"200": {"description": "{id, object, status, error, ...}"}}
                    | _auth_errors()
                    | _error_responses(404),
                }
            },
            "/v1/completion-jobs/{job_id}/result": {
                "get": {
                    "summary": "202 with Retry-After until the job ends, then its stored body",
                    "parameters": [_JOB_ID],
                    "responses": {
                        "200": {"description": "The stored completion body"},
                        "202": {"description": "The job's status; poll after Retry-After"},
                    }
                    | _auth_errors()
                    | _error_responses(404),
                }
            },
            "/v1/harvest": {
                "post": {
                    "summary": "Capture the residual stream of many prompts into safetensors",
                    "requestBody": {
                        "required": True,
                        "content": {
                            "application/json": {
                                "schema": {"$ref": "#/components/schemas/HarvestRequest"}
                            }
                        },
                    },
                    "responses": {
                        "202": {"description": "{job_id, status: pending, model, n_prompts}"}
                    }
                    | _error_responses(400, 401, 403, 413, 429, 503),
                }
            },
            "/v1/harvest/{job_id}": {
                "get": {
                    "summary": "A harvest job's status and progress; download URLs once done "
                    "(or failed on a limit, or cancelled, after writing some batches)",
                    "parameters": [_JOB_ID],
                    "responses": {
                        "200": {
                            "description": "{job_id, status: pending|running|done|failed|"
                            "cancelled, progress, result: {manifest_url, shard_urls, stats_url, "
                            "urls_expire_at}}"
                        }
                    }
                    | _auth_errors()
                    | _error_responses(404),
                },
                "delete": {
                    "summary": "Cancel a pending or running harvest job; the batches it "
                    "wrote are kept",
                    "parameters": [_JOB_ID],
                    "responses": {"200": {"description": "The job, status: cancelled"}}
                    | _auth_errors()
                    | _error_responses(404, 409),
                },
            },
            "/v1/harvest/{job_id}/files/{name}": {
                "get": {
                    "summary": "One file of a finished harvest, by its signed URL (no API key)",
                    "security": [],
                    "parameters": [
                        _JOB_ID,
                        {"name": "name", "in": "path", "required": True, "schema": _STRING},
                        {"name": "token", "in": "query", "required": True, "schema": _STRING},
                    ],
                    "responses": {"200": {"description": "The file (safetensors or JSON)"}}
                    | _error_responses(403, 404),
                }
            },
            "/v1/openapi.json": {
                "get": {
                    "summary": "This document",
                    "security": [],
                    "responses": {"200": {"description": "OpenAPI 3.1"}},
                }
            },
            "/v1/docs": {
                "get": {
                    "summary": "This document as a web page (also at /docs/)",
                    "security": [],
                    "responses": {"200": {"description": "HTML"}},
                }
            },
        },
        "x-error-codes": [
            {
                "status": status,
                "code": code,
                "meaning": meaning,
                "retry_after": DEFAULT_RETRY_AFTER.get(code),
                "should_retry": code not in NOT_RETRYABLE,
            }
            for status, code, meaning in ERROR_CODES
        ],
    }


_STRING = {"type": "string"}
_MODEL_ID = {"name": "model_id", "in": "path", "required": True, "schema": _STRING}
_JOB_ID = {"name": "job_id", "in": "path", "required": True, "schema": _STRING}
_IDEMPOTENCY_KEY = {
    "name": "Idempotency-Key",
    "in": "header",
    "required": True,
    "description": "A unique value per job; resend the same value with the same body.",
    "schema": {"type": "string", "minLength": 1, "maxLength": 255},
}


def _completion_body() -> dict:
    return {
        "required": True,
        "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/CompletionRequest"}}
        },
    }
