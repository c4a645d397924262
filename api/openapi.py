"""The OpenAPI 3.1 document of the gateway (served at /v1/openapi.json and rendered at /docs/)."""

import functools

from django.conf import settings

from acs_client.protocol import (
    FULL_VOCAB_MAX_PROMPT_TOKENS,
    MAX_N,
    MAX_STEERING_VECTORS,
    MAX_STOP_STRINGS,
    NON_STREAMING_MAX_TOKENS,
    OUTPUT_WORK_CAP,
)

from .errors import ERROR_CODES
from .jobs.schemas import HarvestRequest
from .limits import MAX_BODY_BYTES, MAX_RUNNING, MAX_WAITING, STARTS_PER_MINUTE
from .schemas import CompletionRequest

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
        codes = [code for code, entry in ERROR_CODES.items() if entry.status == status]
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
    completion_errors = _error_responses(400, 401, 403, 408, 413, 415, 429, 500, 502, 503, 504)
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
                f"{MAX_STEERING_VECTORS} steering vectors. Per key: {MAX_RUNNING} running + "
                f"{MAX_WAITING} waiting requests, {STARTS_PER_MINUTE} starts per minute. "
                "Every POST body is JSON, sent as "
                "Content-Type: application/json (else 415) within "
                f"{settings.ACS_REQUEST_BODY_TIMEOUT_SECONDS} s (else 408); its text holds no "
                "NUL (\\u0000) and no lone surrogate (400 invalid_request naming the field; "
                "send such a prompt as token ids). While the gateway cannot reach Redis every "
                "authenticated request is 503 redis_unavailable with Retry-After: 1."
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
                    | _error_responses(400),
                }
            },
            "/v1/models/{model_id}/status": {
                "get": {
                    "summary": "Whether the model is loaded upstream ({id, warm})",
                    "parameters": [_MODEL_ID],
                    "responses": {"200": {"description": "{id, warm, status}"}}
                    | _auth_errors()
                    | _error_responses(400),
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
                    | _error_responses(400, 401, 403, 408, 409, 413, 415, 429, 503),
                }
            },
            "/v1/completion-jobs/{job_id}": {
                "get": {
                    "summary": "A completion job's status (queued, running, succeeded, failed)",
                    "parameters": [_JOB_ID],
                    "responses": {"200": {"description": "{id, object, status, error, ...}"}}
                    | _auth_errors()
                    | _error_responses(400),
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
                    | _error_responses(400),
                }
            },
            "/v1/harvest": {
                "post": {
                    "summary": "Capture the residual stream of many prompts into safetensors",
                    "description": (
                        "With an Idempotency-Key (optional), the same key and request returns "
                        "the existing job (200) and the same key with another request is 409 "
                        "idempotency_key_reused, as for completion jobs. A job whose worker "
                        "died resumes after the last shard it wrote."
                    ),
                    "parameters": [{**_IDEMPOTENCY_KEY, "required": False}],
                    "requestBody": {
                        "required": True,
                        "content": {
                            "application/json": {
                                "schema": {"$ref": "#/components/schemas/HarvestRequest"}
                            }
                        },
                    },
                    "responses": {
                        "202": {"description": "{job_id, status: pending, model, n_prompts}"},
                        "200": {"description": "The job this Idempotency-Key already names"},
                    }
                    | _error_responses(400, 401, 403, 408, 409, 413, 415, 429, 503),
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
                    | _error_responses(400),
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
                    "summary": "One file of a finished harvest, by its signed URL (no API key), "
                    "while the key that read the URL may still use the API (401 with its code "
                    "once it is revoked or paused, or the account suspended)",
                    "security": [],
                    "parameters": [
                        _JOB_ID,
                        {"name": "name", "in": "path", "required": True, "schema": _STRING},
                        {"name": "token", "in": "query", "required": True, "schema": _STRING},
                    ],
                    "responses": {"200": {"description": "The file (safetensors or JSON)"}}
                    | _error_responses(401, 403, 404),
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
                "status": entry.status,
                "code": code,
                "type": entry.type,
                "meaning": entry.description,
                "retry_after": entry.retry_after,
                "should_retry": entry.should_retry,
            }
            for code, entry in ERROR_CODES.items()
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
