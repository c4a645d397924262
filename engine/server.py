"""The HTTP surface (Starlette): vLLM-compatible completions, models, tokenize and health.

The server starts answering at once and loads the model on a background thread; until it is
loaded, /health and the model endpoints answer 503.
"""

import asyncio
import hmac
import json
import logging
import threading
from contextlib import asynccontextmanager

import orjson
import torch
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from engine.config import EngineConfig
from engine.loader import LoadedModel, load_model
from engine.outputs import ChoiceDelta, RequestDone, RequestFailed
from engine.preparation import prepare_completion, prepare_tokenize
from engine.protocol import CompletionRequest, RequestError, TokenizeRequest, parse_model
from engine.scheduler import EngineRequest, Overloaded, Scheduler

log = logging.getLogger(__name__)

CLIENT_GONE = object()  # event-queue marker: the HTTP client disconnected
# Whom a request is for (the gateway sends its account's id): the scheduler shares capacity
# between tenants. vLLM ignores the header.
TENANT_HEADER = "x-acs-tenant"


class EngineState:
    """The model and scheduler once loaded in the background; `load_error` if loading failed."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.loaded: LoadedModel | None = None
        self.scheduler: Scheduler | None = None
        self.load_error: str | None = None

    def load(self) -> None:
        try:
            loaded = load_model(self.config.cache_dir)
            scheduler = Scheduler(
                loaded, self.config.max_active, self.config.max_waiting, self.config.threads
            )
            scheduler.start()
            self.loaded, self.scheduler = loaded, scheduler
            log.info("model %s loaded", loaded.model_id)
        except Exception as error:
            log.exception("loading the model failed")
            self.load_error = str(error)

    def require_loaded(self) -> tuple[LoadedModel, Scheduler]:
        if self.scheduler is None:
            message = (
                f"model failed to load: {self.load_error}"
                if self.load_error
                else "model is loading"
            )
            raise RequestError(message, code="model_loading", status=503, error_type="server_error")
        return self.loaded, self.scheduler


def create_app(config: EngineConfig) -> Starlette:
    state = EngineState(config)

    @asynccontextmanager
    async def lifespan(app):
        threading.Thread(target=state.load, name="engine-loader", daemon=True).start()
        yield
        if state.scheduler is not None:
            state.scheduler.stop()

    app = Starlette(
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/tokenizer.json", tokenizer_json, methods=["GET"]),
            Route("/v1/completions", completions, methods=["POST"]),
        ],
        middleware=[Middleware(RequestGuard, config=config)],
        lifespan=lifespan,
    )
    app.state.engine = state
    return app


class RequestGuard:
    """ASGI middleware refusing, before any route runs, what should never reach an engine that
    has no accounts: a Host outside `allowed_hosts` (a page rebinding its DNS name to
    127.0.0.1 keeps its own name there), a POST body that is not `application/json` (what a
    cross-site page can send without a CORS preflight), and, when `token` is set, a request
    without `Authorization: Bearer <token>` (except /health, which liveness probes poll)."""

    def __init__(self, app, config: EngineConfig):
        self.app = app
        self.allowed_hosts = config.allowed_hosts
        self.expected_authorization = f"Bearer {config.token}".encode() if config.token else None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            refusal = self.refusal(scope)
            if refusal is not None:
                await error_response(refusal)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def refusal(self, scope) -> RequestError | None:
        headers = Headers(scope=scope)
        host = headers.get("host", "")
        if host_name(host) not in self.allowed_hosts:
            return RequestError(
                f"the Host {host!r} is not one this engine serves (ACS_ENGINE_ALLOWED_HOSTS)",
                code="host_not_allowed",
                status=421,
            )
        if self.expected_authorization is not None and scope["path"] != "/health":
            given = headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, self.expected_authorization):
                return RequestError(
                    "this engine needs Authorization: Bearer <ACS_ENGINE_TOKEN>",
                    code="invalid_token",
                    status=401,
                    error_type="authentication_error",
                )
        if scope["method"] == "POST":
            media_type = headers.get("content-type", "").split(";")[0].strip().lower()
            if media_type != "application/json":
                return RequestError(
                    f"the body must be application/json, not {media_type or 'unlabelled'}",
                    code="unsupported_media_type",
                    status=415,
                )
        return None


def host_name(host: str) -> str:
    """The name part of a Host header, lowercased: `localhost:8001` → `localhost`, `[::1]:80`
    → `[::1]`."""
    host = host.lower()
    if host.startswith("["):
        return host[: host.find("]") + 1]
    return host.rsplit(":", 1)[0]


def json_text(body: dict) -> bytes:
    """`body` as compact UTF-8 JSON. orjson writes what `json.dumps(ensure_ascii=False)` does,
    20 times as fast (a full-vocabulary prompt_logprobs answer: 49,152 entries per position),
    but NaN and ±Infinity as null: none reaches here, as every logprob the engine answers
    passed `finite_rows` (non-finite scores are a 400 non_finite_output)."""
    return orjson.dumps(body, option=orjson.OPT_NON_STR_KEYS)


def json_response(body: dict, status: int = 200, headers: dict | None = None) -> Response:
    return Response(
        json_text(body),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )


def error_response(error: RequestError, usage: dict | None = None) -> Response:
    """The error's JSON answer; `usage` (the work done before a request failed) goes beside
    the error object so that the gateway bills it."""
    headers = {"Retry-After": "1"} if error.status == 503 else None
    body = error.body() if usage is None else {**error.body(), "usage": usage}
    return json_response(body, status=error.status, headers=headers)


def failure_error(failure: RequestFailed) -> RequestError:
    return RequestError(
        failure.message, failure.code, status=failure.status, error_type=failure.error_type
    )


async def health(request: Request) -> Response:
    state: EngineState = request.app.state.engine
    if state.load_error is not None:
        body = {"status": "failed", "model_loaded": False, "error": state.load_error}
        return json_response(body, status=503)
    if state.scheduler is None:
        return json_response({"status": "loading", "model_loaded": False}, status=503)
    decoder = state.loaded.decoder
    return json_response(
        {
            "status": "ok",
            "model_loaded": True,
            "device": decoder.device.type,
            "dtype": str(decoder.dtype).removeprefix("torch."),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "half_weight_rows": decoder.plan.half_rows,
            "onednn_weight_rows": decoder.plan.onednn_rows,
            "native_decode_rows": decoder.plan.native_rows,
            **state.scheduler.stats(),
        }
    )


async def models(request: Request) -> Response:
    try:
        loaded, _ = request.app.state.engine.require_loaded()
    except RequestError as error:
        return error_response(error)
    card = {
        "id": loaded.model_id,
        "object": "model",
        "owned_by": "acs",
        "max_model_len": loaded.max_model_len,
        "n_layers": loaded.n_layers,
        "hidden_size": loaded.hidden_size,
        "vocab_size": loaded.vocab_size,
        "dtype": str(loaded.model.dtype).removeprefix("torch."),
    }
    return json_response({"object": "list", "data": [card]})


async def tokenize(request: Request) -> Response:
    try:
        loaded, _ = request.app.state.engine.require_loaded()
        parsed = parse_model(TokenizeRequest, await read_json(request))
        tokens = await run_in_threadpool(prepare_tokenize, parsed, loaded)
    except RequestError as error:
        return error_response(error)
    return json_response(
        {"tokens": tokens, "count": len(tokens), "max_model_len": loaded.max_model_len}
    )


async def tokenizer_json(request: Request) -> Response:
    """The model's tokenizer in the HF `tokenizers` JSON format, so the gateway can count
    prompt tokens itself instead of asking /tokenize on every request."""
    try:
        loaded, _ = request.app.state.engine.require_loaded()
    except RequestError as error:
        return error_response(error)
    return Response(loaded.tokenizer.backend_tokenizer.to_str(), media_type="application/json")


async def completions(request: Request) -> Response:
    try:
        loaded, scheduler = request.app.state.engine.require_loaded()
        parsed = parse_model(CompletionRequest, await read_json(request))
        prepared = await run_in_threadpool(prepare_completion, parsed, loaded)
        engine_request = EngineRequest(
            prepared, asyncio.get_running_loop(), tenant=request.headers.get(TENANT_HEADER, "")
        )
        scheduler.submit(engine_request)
    except RequestError as error:
        return error_response(error)
    except Overloaded as error:
        return error_response(
            RequestError(str(error), "engine_overloaded", status=503, error_type="server_error")
        )
    except MemoryError:
        # Preparing this request alone ran out of memory: a 5xx marked as the request's fault
        # (its error type), which the gateway does not count against the engine's health.
        return error_response(
            RequestError(
                "the request does not fit in the engine's memory",
                "oom",
                status=500,
                error_type="invalid_request_error",
            )
        )
    watcher = asyncio.ensure_future(watch_disconnect(request, engine_request))
    if prepared.stream:
        frames = stream_frames(scheduler, engine_request, watcher, loaded.model_id)
        return StreamingResponse(frames, media_type="text/event-stream")
    try:
        return await complete(engine_request, loaded.model_id)
    finally:
        scheduler.cancel(engine_request)  # a no-op once finished; frees slots if the client left
        watcher.cancel()


async def read_json(request: Request):
    try:
        return json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise RequestError(f"the body is not valid JSON: {error}", code="bad_json") from None


async def watch_disconnect(request: Request, engine_request: EngineRequest) -> None:
    """Put CLIENT_GONE on the request's event queue when the client disconnects."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    engine_request.events.put_nowait(CLIENT_GONE)


async def complete(engine_request: EngineRequest, model_id: str) -> Response:
    prepared = engine_request.prepared
    params = prepared.params
    choices = [
        new_choice(index, params.return_token_ids) for index in range(prepared.sequence_count)
    ]
    while True:
        event = await engine_request.events.get()
        if event is CLIENT_GONE:
            return Response(status_code=499)
        if isinstance(event, ChoiceDelta):
            add_delta(choices[event.index], event, params.logprobs is not None)
        elif isinstance(event, RequestFailed):
            return error_response(failure_error(event), usage=event.usage)
        elif isinstance(event, RequestDone):
            body = completion_header(engine_request, model_id)
            body["choices"] = choices
            body["usage"] = event.usage
            if event.activations is not None:
                body["activations"] = event.activations
            return json_response(body)


def new_choice(index: int, with_token_ids: bool) -> dict:
    choice = {
        "index": index,
        "text": "",
        "logprobs": None,
        "finish_reason": None,
        "stop_reason": None,
        "prompt_logprobs": None,
    }
    if with_token_ids:
        choice.update(prompt_token_ids=None, token_ids=[])
    return choice


def add_delta(choice: dict, delta: ChoiceDelta, with_logprobs: bool) -> None:
    choice["text"] += delta.text
    if with_logprobs and delta.logprobs is not None:
        if choice["logprobs"] is None:
            choice["logprobs"] = delta.logprobs.to_json()
        else:
            for key, values in delta.logprobs.to_json().items():
                choice["logprobs"][key] += values
    if delta.prompt_logprobs is not None:
        choice["prompt_logprobs"] = delta.prompt_logprobs
    if delta.token_ids is not None:
        choice["token_ids"] += delta.token_ids
    if delta.prompt_token_ids is not None:
        choice["prompt_token_ids"] = delta.prompt_token_ids
    if delta.finish_reason is not None:
        choice["finish_reason"] = delta.finish_reason
        choice["stop_reason"] = delta.stop_reason


def completion_header(engine_request: EngineRequest, model_id: str) -> dict:
    return {
        "id": engine_request.id,
        "object": "text_completion",
        "created": engine_request.created,
        "model": model_id,
    }


async def stream_frames(
    scheduler: Scheduler, engine_request, watcher: asyncio.Future, model_id: str
):
    """SSE frames: one per choice delta, the usage frame if asked, then [DONE]."""
    try:
        while True:
            event = await engine_request.events.get()
            if event is CLIENT_GONE:
                return
            if isinstance(event, ChoiceDelta):
                frame = completion_header(engine_request, model_id)
                frame["choices"] = [delta_json(event)]
                yield sse(frame)
            elif isinstance(event, RequestFailed):
                # With the usage so far, where known, as a non-streaming error body has it.
                usage = {"usage": event.usage} if event.usage is not None else {}
                yield sse({**failure_error(event).body(), **usage})
                return
            elif isinstance(event, RequestDone):
                if engine_request.prepared.include_usage:
                    frame = completion_header(engine_request, model_id)
                    frame["choices"] = []
                    frame["usage"] = event.usage
                    yield sse(frame)
                yield b"data: [DONE]\n\n"
                return
    finally:
        scheduler.cancel(engine_request)
        watcher.cancel()


def delta_json(delta: ChoiceDelta) -> dict:
    choice = {
        "index": delta.index,
        "text": delta.text,
        "logprobs": delta.logprobs.to_json() if delta.logprobs is not None else None,
        "finish_reason": delta.finish_reason,
        "stop_reason": delta.stop_reason,
    }
    if delta.prompt_logprobs is not None:
        choice["prompt_logprobs"] = delta.prompt_logprobs
    if delta.prompt_token_ids is not None:
        choice["prompt_token_ids"] = delta.prompt_token_ids
    if delta.token_ids is not None:
        choice["token_ids"] = delta.token_ids
    return choice


def sse(payload: dict) -> bytes:
    return b"data: " + json_text(payload) + b"\n\n"
