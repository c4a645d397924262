"""The /v1 gateway views (async). Thin: authenticate, read the body, call one service."""

from django.conf import settings
from django.http import JsonResponse
from django.shortcuts import render
from django.views.decorators.csrf import csrf_exempt

from acs_client.responses import (
    BudgetWindow,
    KeyUsage,
    ModelList,
    ModelStatus,
    UpstreamHealth,
    UsageKey,
)
from metering.selectors import budget_windows
from metering.sql import run_db

from . import upstream
from .auth import authenticate
from .errors import ApiError, error_response
from .http import json_response, request_id, v1_view
from .openapi import openapi_document
from .selectors import model_card, model_get, model_list


@csrf_exempt
async def not_found(request, path=""):
    """Any /v1 path that names no endpoint."""
    error = ApiError(
        "not_found", f"No endpoint at {request.path}; the API is described at /v1/openapi.json."
    )
    return error_response(error, request_id(request))


@csrf_exempt
async def chat_completions(request):
    return error_response(
        ApiError(
            "chat_completions_unsupported",
            "This API serves plain text completions only; use POST /v1/completions.",
        ),
        request_id(request),
    )


@v1_view("GET")
async def models(request):
    await authenticate(request)
    return json_response(request, ModelList(data=[model_card(m) for m in await model_list()]))


@v1_view("GET")
async def model_detail(request, model_id):
    await authenticate(request)
    return json_response(request, model_card(await model_get(model_id)))


@v1_view("GET")
async def model_status(request, model_id):
    await authenticate(request)
    model = await model_get(model_id)
    health = await upstream.upstream_health(model.upstream_urls)
    upstreams = [
        UpstreamHealth(ok=state["ok"], model_loaded=state["model_loaded"])
        for state in health["upstreams"]
    ]
    return json_response(
        request,
        ModelStatus(id=model.name, status=model.status, warm=health["warm"], upstreams=upstreams),
    )


def _usage_body(key) -> KeyUsage:
    return KeyUsage(
        key=UsageKey(prefix=key.prefix, name=key.name),
        windows=[BudgetWindow(**window) for window in budget_windows(key=key)],
    )


@v1_view("GET")
async def usage(request):
    key = await authenticate(request)
    return json_response(request, await run_db(_usage_body, key))


@v1_view("GET")
async def openapi(request):
    return JsonResponse(openapi_document())


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
