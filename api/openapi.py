"""The OpenAPI 3.1 document of the gateway (served at /v1/openapi.json and rendered at /docs/).

Every body schema is generated from the pydantic models of the wire format: the request
bodies from `api.schemas` and `api.jobs.schemas`, which the views validate with, and the
response bodies from `acs_client.responses`, which the views build their answers with. Each
operation's responses refer to those components by `$ref`, so what the document says a
response holds is what the code that writes it can hold.
"""

import functools

from django.conf import settings
from pydantic.json_schema import models_json_schema

from acs_client import responses
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

# Request bodies are documented as clients send them, response bodies as the gateway writes
# them (a job's times: integers, not the datetimes the models hold).
REQUEST_MODELS = (CompletionRequest, HarvestRequest)
RESPONSE_MODELS = (
    responses.CompletionResponse,
    responses.CompletionStreamChunk,
    responses.ModelList,
    responses.ModelCard,
    responses.ModelStatus,
    responses.KeyUsage,
    responses.CompletionJob,
    responses.HarvestJob,
    responses.ErrorResponse,
)
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
# The errors of every request that needs an API key.
_AUTH_STATUSES = (401, 403)
# The errors of a JSON POST body, besides validation (400) and authentication.
_POST_STATUSES = (408, 413, 415, 429)


@functools.cache
def openapi_document() -> dict:
    schemas, _ = _components()
    return {
        "openapi": "3.1.0",
        "info": {"title": "ACS API", "version": "1", "description": _description()},
        "servers": [{"url": "/"}],
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": schemas,
        },
        "security": [{"bearer": []}],
        "paths": {
            **_completion_paths(),
            **_model_paths(),
            **_usage_paths(),
            **_completion_job_paths(),
            **_harvest_paths(),
            **_document_paths(),
        },
        "x-error-codes": _error_codes(),
    }


@functools.cache
def _components() -> tuple[dict, dict]:
    """The schema of every body model, named by its class, and each model's `$ref`."""
    keys = [(model, "validation") for model in REQUEST_MODELS]
    keys += [(model, "serialization") for model in RESPONSE_MODELS]
    refs, schemas = models_json_schema(keys, ref_template="#/components/schemas/{model}")
    return schemas["$defs"], {model: refs[(model, mode)] for model, mode in keys}


def component_name(model) -> str:
    """The name of `model`'s schema under components.schemas."""
    return _ref(model)["$ref"].rsplit("/", 1)[1]


def _ref(model) -> dict:
    return _components()[1][model]


def _json_body(model) -> dict:
    return {"required": True, "content": {"application/json": {"schema": _ref(model)}}}


def _answer(description: str, model, **fields) -> dict:
    """A response whose JSON body is `model`."""
    return {
        "description": description,
        "content": {"application/json": {"schema": _ref(model)}},
        **fields,
    }


def _errors(*statuses: int) -> dict:
    """The error responses of `statuses`, each listing the codes ERROR_CODES gives it."""
    return {
        str(status): _answer(
            "Error codes: "
            + ", ".join(code for code, entry in ERROR_CODES.items() if entry.status == status),
            responses.ErrorResponse,
        )
        for status in statuses
    }


def _description() -> str:
    return (
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
    )


def _completion_paths() -> dict:
    completion = {
        "description": "The completion, or with stream: true a text/event-stream whose every "
        "data: frame is one chunk, ending in data: [DONE] (an error after the 200 arrives as "
        'one data: {"error": ...} frame and no [DONE]).',
        "content": {
            "application/json": {"schema": _ref(responses.CompletionResponse)},
            "text/event-stream": {"schema": _ref(responses.CompletionStreamChunk)},
        },
        "headers": {
            "X-Request-Id": {"schema": _STRING},
            "X-Acs-Max-Tokens-Clamped": {"schema": _STRING},
            "Server-Timing": {"schema": _STRING},
        },
    }
    return {
        "/v1/completions": {
            "post": {
                "summary": "Create a completion (stream: true for server-sent events)",
                "requestBody": _json_body(CompletionRequest),
                "responses": {"200": completion}
                | _errors(400, *_AUTH_STATUSES, *_POST_STATUSES, 500, 502, 503, 504),
            }
        },
        "/v1/chat/completions": {
            "post": {
                "summary": "Not supported: answers 400 chat_completions_unsupported",
                "responses": _errors(400),
            }
        },
    }


def _model_paths() -> dict:
    return {
        "/v1/models": {
            "get": {
                "summary": "List the models and their capabilities",
                "responses": {"200": _answer("The models", responses.ModelList)}
                | _errors(*_AUTH_STATUSES),
            }
        },
        "/v1/models/{model_id}": {
            "get": {
                "summary": "One model and its capabilities",
                "parameters": [_MODEL_ID],
                "responses": {"200": _answer("The model card", responses.ModelCard)}
                | _errors(400, *_AUTH_STATUSES),
            }
        },
        "/v1/models/{model_id}/status": {
            "get": {
                "summary": "Whether the model is loaded upstream",
                "parameters": [_MODEL_ID],
                "responses": {"200": _answer("The model's status", responses.ModelStatus)}
                | _errors(400, *_AUTH_STATUSES),
            }
        },
    }


def _usage_paths() -> dict:
    return {
        "/v1/usage": {
            "get": {
                "summary": "The key's and account's budget windows",
                "responses": {"200": _answer("The budget windows", responses.KeyUsage)}
                | _errors(*_AUTH_STATUSES),
            }
        }
    }


def _completion_job_paths() -> dict:
    job = responses.CompletionJob
    return {
        "/v1/completion-jobs": {
            "post": {
                "summary": "Submit a completion body as a job (runs after you disconnect)",
                "description": (
                    "The same Idempotency-Key and body returns the existing job (200); the "
                    "same key with another body is 409 idempotency_key_reused. stream is "
                    "not allowed."
                ),
                "parameters": [_IDEMPOTENCY_KEY],
                "requestBody": _json_body(CompletionRequest),
                "responses": {
                    "202": _answer("The new job, status queued", job),
                    "200": _answer("The job this Idempotency-Key already names", job),
                }
                | _errors(400, *_AUTH_STATUSES, 409, *_POST_STATUSES, 503),
            }
        },
        "/v1/completion-jobs/{job_id}": {
            "get": {
                "summary": "A completion job's status (queued, running, succeeded, failed)",
                "parameters": [_JOB_ID],
                "responses": {"200": _answer("The job", job)} | _errors(*_AUTH_STATUSES, 404),
            }
        },
        "/v1/completion-jobs/{job_id}/result": {
            "get": {
                "summary": "202 with Retry-After until the job ends, then its stored body",
                "description": "A failed job's result is its stored error, with its status.",
                "parameters": [_JOB_ID],
                "responses": {
                    "200": _answer("The stored completion", responses.CompletionResponse),
                    "202": _answer("The job; poll again after Retry-After", job),
                }
                | _errors(400, *_AUTH_STATUSES, 404, 429, 500, 502, 503, 504),
            }
        },
    }


def _harvest_paths() -> dict:
    job = responses.HarvestJob
    return {
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
                "requestBody": _json_body(HarvestRequest),
                "responses": {
                    "202": _answer("The new job, status pending", job),
                    "200": _answer("The job this Idempotency-Key already names", job),
                }
                | _errors(400, *_AUTH_STATUSES, 409, *_POST_STATUSES, 503),
            }
        },
        "/v1/harvest/{job_id}": {
            "get": {
                "summary": "A harvest job's status and progress; download URLs once done "
                "(or failed on a limit, or cancelled, after writing some batches)",
                "parameters": [_JOB_ID],
                "responses": {"200": _answer("The job", job)} | _errors(*_AUTH_STATUSES, 404),
            },
            "delete": {
                "summary": "Cancel a pending or running harvest job; the batches it wrote are kept",
                "parameters": [_JOB_ID],
                "responses": {"200": _answer("The job, status cancelled", job)}
                | _errors(*_AUTH_STATUSES, 404, 409),
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
                | _errors(401, 403, 404),
            }
        },
    }


def _document_paths() -> dict:
    return {
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
    }


def _error_codes() -> list[dict]:
    return [
        {
            "status": entry.status,
            "code": code,
            "type": entry.type,
            "meaning": entry.description,
            "retry_after": entry.retry_after,
            "should_retry": entry.should_retry,
        }
        for code, entry in ERROR_CODES.items()
    ]
