"""The /v1 gateway views (async). Thin: authenticate, read the body, call one service."""

import functools

from django.conf import settings
from django.http import HttpResponse, JsonResponse
from django.shortcuts import render
from django.views.decorators.csrf import csrf_exempt

from acs_client.protocol import FULL_VOCAB_MAX_PROMPT_TOKENS, MAX_STEERING_VECTORS
from metering.selectors import budget_windows
from metering.sql import run_db

from . import upstream
from .auth import authenticate
from .bodies import check_content_type, check_declared_length, decode_json
from .completions import CompletionResult
from .errors import ApiError, error_response
from .middleware import request_id_for
from .openapi import openapi_document
from .schemas import MAX_BODY_BYTES
from .selectors import model_get, model_list


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

        wrapper.allowed_methods = methods
        return wrapper

    return decorate


def read_json_body(request):
    """The decoded JSON body; 415 unsupported_media_type unless it is declared as JSON, 413
    request_too_large (checked before parsing, from the declared length and then the bytes
    actually sent) or 400 bad_json."""
    check_content_type(request.headers.get("Content-Type"))
    check_declared_length(request.headers.get("Content-Length"))
    # Read the stream directly: request.body would apply Django's smaller form-upload limit.
    return decode_json(request.read(MAX_BODY_BYTES + 1))


def result_response(request, result: CompletionResult) -> HttpResponse:
    content, headers = result.for_client(request.headers.get("Accept-Encoding", ""))
    response = HttpResponse(content, status=result.status, content_type="application/json")
    for name, value in headers.items():
        response[name] = value
    response["X-Request-Id"] = request_id(request)
    return response


@csrf_exempt
async def not_found(request, path=""):
    """Any /v1 path that names no endpoint."""
    error = ApiError(
        404,
        "not_found",
        f"No endpoint at {request.path}; the API is described at /v1/openapi.json.",
    )
    return error_response(error, request_id(request))


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
    """The human API reference (also served at /docs/). Its examples name the configured
    site, not the request's Host header (a forged one must not end up in the page)."""
    document = openapi_document()
    context = {
        "document": document,
        "error_codes": document["x-error-codes"],
        "site_url": settings.SITE_URL.rstrip("/"),
    }
    return render(request, "api/docs.html", context)
