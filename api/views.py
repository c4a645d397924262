"""The /v1 gateway views (async). Thin: authenticate, read the body, call one service."""

import functools
import gzip
import json

from django.http import HttpResponse, JsonResponse, StreamingHttpResponse
from django.shortcuts import render
from django.views.decorators.csrf import csrf_exempt

from accounts.selectors import budget_windows

from . import upstream
from .auth import authenticate
from .completions import CompletionResult, StreamOpened, completion_run, completion_stream
from .db import run_db
from .errors import ApiError, error_response
from .middleware import request_id_for
from .openapi import openapi_document
from .schemas import FULL_VOCAB_MAX_PROMPT_TOKENS, MAX_BODY_BYTES, MAX_STEERING_VECTORS
from .selectors import model_get, model_list

# Non-streaming bodies at least this large are gzipped for clients that accept it.
GZIP_MIN_BYTES = 1024


def request_id(request) -> str:
    """The request's id, set by RequestIdMiddleware (echoed inbound or generated)."""
    return getattr(request, "request_id", None) or request_id_for(request)


def allow(*methods):
    """Answer other methods with 405 method_not_allowed in the API's error envelope."""

    def decorate(view):
        @functools.wraps(view)
        async def wrapper(request, *args, **kwargs):
            if request.method not in methods:
                response = error_response(
                    ApiError(405, "method_not_allowed", f"Use {' or '.join(methods)}."),
                    request_id(request),
                )
                response["Allow"] = ", ".join(methods)
                return response
            return await view(request, *args, **kwargs)

        return wrapper

    return decorate


def read_json_body(request):
    """The decoded JSON body; 413 request_too_large (checked before parsing, from the
    declared length and then the bytes actually sent) or 400 bad_json."""
    declared = request.headers.get("Content-Length")
    if declared and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise _too_large()
    # Read the stream directly: request.body would apply Django's smaller form-upload limit.
    raw = request.read(MAX_BODY_BYTES + 1)
    if len(raw) > MAX_BODY_BYTES:
        raise _too_large()
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as error:
        raise ApiError(400, "bad_json", f"The body is not valid JSON: {error}.") from None


def _too_large() -> ApiError:
    return ApiError(
        413, "request_too_large", f"The request body exceeds {MAX_BODY_BYTES} bytes (8 MiB)."
    )


def result_response(request, result: CompletionResult) -> HttpResponse:
    content = result.encoded()
    response = HttpResponse(content, status=result.status, content_type="application/json")
    if len(content) >= GZIP_MIN_BYTES and "gzip" in request.headers.get("Accept-Encoding", ""):
        response.content = gzip.compress(content, compresslevel=5)
        response["Content-Encoding"] = "gzip"
        response["Vary"] = "Accept-Encoding"
    for name, value in result.headers.items():
        response[name] = value
    response["X-Request-Id"] = request_id(request)
    return response


@csrf_exempt
@allow("POST")
async def completions(request):
    rid = request_id(request)
    try:
        key = await authenticate(request)
        payload = read_json_body(request)
    except ApiError as error:
        return error_response(error, rid)
    workload = request.headers.get("X-Acs-Workload", "")
    if isinstance(payload, dict) and payload.get("stream") is True:
        return await _stream_response(request, key, payload, rid, workload)
    result = await completion_run(
        key=key, payload=payload, request_id=rid, workload=workload, settle_in_background=True
    )
    return result_response(request, result)


async def _stream_response(request, key, payload, rid, workload):
    frames = completion_stream(key=key, payload=payload, request_id=rid, workload=workload)
    first = await anext(frames)
    if isinstance(first, CompletionResult):
        await frames.aclose()
        return result_response(request, first)
    assert isinstance(first, StreamOpened)
    response = StreamingHttpResponse(frames, content_type="text/event-stream")
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"
    for name, value in first.headers.items():
        response[name] = value
    response["X-Request-Id"] = rid
    return response


@csrf_exempt
async def chat_completions(request):
    return error_response(
        ApiError(
            400,
            "chat_completions_unsupported",
            "This API serves plain text completions only; use POST /v1/completions.",
        ),
        request_id(request),
    )


def model_card(model) -> dict:
    return {
        "id": model.name,
        "object": "model",
        "owned_by": "acs",
        "default": model.is_default,
        "status": model.status,
        "capabilities": {
            "max_model_len": model.max_model_len,
            "max_logprobs": model.max_logprobs,
            "full_vocab_max_prompt_tokens": FULL_VOCAB_MAX_PROMPT_TOKENS,
            "activations": model.supports_activations,
            "n_layers": model.n_layers,
            "hidden_size": model.hidden_size,
            "vocab_size": model.vocab_size,
            "max_steering_vectors": MAX_STEERING_VECTORS if model.supports_activations else 0,
        },
    }


def _json(request, body, status=200):
    """A JSON response carrying the request's X-Request-Id (api.jobs uses it too)."""
    response = JsonResponse(body, status=status)
    response["X-Request-Id"] = request_id(request)
    return response


@allow("GET")
async def models(request):
    try:
        await authenticate(request)
    except ApiError as error:
        return error_response(error, request_id(request))
    return _json(request, {"object": "list", "data": [model_card(m) for m in await model_list()]})


async def _model_or_404(name):
    try:
        return await model_get(name)
    except ApiError:
        raise ApiError(404, "model_not_found", f"The model '{name}' does not exist.") from None


@allow("GET")
async def model_detail(request, model_id):
    try:
        await authenticate(request)
        model = await _model_or_404(model_id)
    except ApiError as error:
        return error_response(error, request_id(request))
    return _json(request, model_card(model))


@allow("GET")
async def model_status(request, model_id):
    try:
        await authenticate(request)
        model = await _model_or_404(model_id)
    except ApiError as error:
        return error_response(error, request_id(request))
    health = await upstream.upstream_health(model.upstream_urls)
    return _json(
        request,
        {
            "id": model.name,
            "object": "model.status",
            "status": model.status,
            "warm": health["warm"],
            "upstreams": [
                {"ok": state["ok"], "model_loaded": state["model_loaded"]}
                for state in health["upstreams"]
            ],
        },
    )


def _usage_body(key) -> dict:
    windows = budget_windows(key=key)
    return {
        "object": "usage",
        "key": {"prefix": key.prefix, "name": key.name},
        "windows": [{**window, "resets_at": window["resets_at"].isoformat()} for window in windows],
    }


@allow("GET")
async def usage(request):
    try:
        key = await authenticate(request)
    except ApiError as error:
        return error_response(error, request_id(request))
    body = await run_db(_usage_body, key)
    return _json(request, body)


@allow("GET")
async def openapi(request):
    return _json(request, openapi_document())


def docs(request):
    """The human API reference (also served at /docs/)."""
    document = openapi_document()
    return render(
        request, "api/docs.html", {"document": document, "error_codes": document["x-error-codes"]}
    )
