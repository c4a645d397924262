"""Reads of the model registry and of upstream health."""

import asyncio
import contextlib
import datetime as dt
import time
import weakref

from acs_client.protocol import FULL_VOCAB_MAX_PROMPT_TOKENS, MAX_STEERING_VECTORS
from acs_client.responses import ModelCapabilities, ModelCard
from infra.redis import redis_sync
from metering.sql import run_db

from . import dialect
from .errors import ApiError
from .models import LanguageModel, ModelStatus
from .services import ModelSizesUnknown, language_model_sizes_fill
from .upstream import FAILURE_WINDOW_MS, capture_probe, circuit_keys

# The token the capture probe sends: any id of any vocabulary.
PROBE_TOKEN = 0

# The registry changes rarely (staff edit it in the admin), so each process reads it at most
# once per this many seconds instead of once per request.
REGISTRY_TTL_S = 2.0

_registry: dict = {"loaded_at": -1e9, "by_name": {}, "default": None}
# The reload in flight on each event loop: every request that finds the registry stale waits
# for that one read. Without it, at 64 requests in flight each of them read the table in a
# worker thread of its own every REGISTRY_TTL_S (7% of the gateway's CPU under load, py-spy).
_reloads: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Future]" = (
    weakref.WeakKeyDictionary()
)


def _load_registry() -> None:
    # The tokenizer file (megabytes) is read once per process by api.tokenizer, not here.
    models = list(LanguageModel.objects.defer("tokenizer_json"))
    _registry["by_name"] = {model.name: model for model in models}
    _registry["default"] = next((m for m in models if m.is_default), None)
    _registry["loaded_at"] = time.monotonic()


def registry_clear() -> None:
    """Forget the cached registry and its rows' failed size fills (tests, after a staff edit
    in this process): the next request reads it anew, not through a read already in flight,
    and fills a blank row's sizes anew."""
    _registry["loaded_at"] = -1e9
    _reloads.clear()
    _sizes_failures.clear()
    _sizes_fills.clear()


async def _fresh_registry() -> dict:
    if time.monotonic() - _registry["loaded_at"] > REGISTRY_TTL_S:
        loop = asyncio.get_running_loop()
        reload = _reloads.get(loop)
        if reload is None or reload.done():
            reload = _reloads[loop] = asyncio.ensure_future(_reload())
        # A request cancelled while it waits must not cancel the others' reload.
        await asyncio.shield(reload)
    return _registry


async def _reload() -> None:
    await run_db(_load_registry)
    # Each activation upstream is probed as soon as the registry serves it, so that the
    # first activation request finds the answer ready (later loads find it cached).
    for model in _registry["by_name"].values():
        if model.supports_activations and model.status == ModelStatus.LIVE:
            background_probe = asyncio.ensure_future(activation_upstreams_probed(model))
            _background_probes.add(background_probe)
            background_probe.add_done_callback(_background_probes.discard)


async def model_get(name: str | None) -> LanguageModel:
    """The live model called `name` (the default model when None), or 400 model_not_found;
    its blank sizes filled first, or 503 model_sizes_unknown (`model_sizes_ready`)."""
    registry = await _fresh_registry()
    model = registry["default"] if name is None else registry["by_name"].get(name)
    if model is None or model.status != ModelStatus.LIVE:
        raise ApiError(
            "model_not_found",
            f"The model '{name}' does not exist; GET /v1/models lists the models."
            if name is not None
            else "Name a model; GET /v1/models lists them.",
        )
    await model_sizes_ready(model)
    return model


# How long a failure to fill a row's sizes is the answer before the next try (an upstream
# still loading its model answers within seconds).
SIZES_RETRY_S = 5.0
# model id -> (why its sizes could not be filled, when: time.monotonic())
_sizes_failures: dict[int, tuple[str, float]] = {}
_sizes_fills: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict]" = (
    weakref.WeakKeyDictionary()
)


def model_sizes_ensure(model: LanguageModel) -> None:
    """Fill `model`'s blank sizes (`services.language_model_sizes_fill`), or raise 503
    model_sizes_unknown saying why: the registry never guesses a size. A failure stays the
    answer for SIZES_RETRY_S, without asking the upstream again. Synchronous: it may wait on
    the upstream (`model_sizes_ready` is the event loop's)."""
    if not model.sizes_missing:
        return
    failure = _sizes_failures.get(model.pk)
    if failure is not None and time.monotonic() - failure[1] < SIZES_RETRY_S:
        raise ApiError("model_sizes_unknown", failure[0])
    try:
        language_model_sizes_fill(model=model)
    except ModelSizesUnknown as error:
        _sizes_failures[model.pk] = (str(error), time.monotonic())
        raise ApiError("model_sizes_unknown", str(error)) from None
    _sizes_failures.pop(model.pk, None)


async def model_sizes_ready(model: LanguageModel) -> None:
    """`model_sizes_ensure` in a worker thread; the requests that find the same row blank on
    one event loop wait for one fill."""
    if not model.sizes_missing:
        return
    fills = _sizes_fills.setdefault(asyncio.get_running_loop(), {})
    fill = fills.get(model.pk)
    if fill is None or fill.done():
        fill = fills[model.pk] = asyncio.ensure_future(run_db(model_sizes_ensure, model))
    # A request cancelled while it waits must not cancel the others' fill.
    await asyncio.shield(fill)


# How long a capture probe's answer about an activation upstream is kept: a plugin found stays
# found for minutes; one found missing is asked again soon, so an upstream restarted with the
# plugin serves activation requests within this delay.
PROBE_FOUND_TTL_S = 600.0
PROBE_MISSING_TTL_S = 30.0
# url -> (True: captures, False: answers without a capture, checked at (time.monotonic()))
_probes: dict[str, tuple[bool, float]] = {}
_probes_running: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict]" = (
    weakref.WeakKeyDictionary()
)


_background_probes: set[asyncio.Future] = set()


async def activation_upstreams_probed(model: LanguageModel) -> list[bool | None]:
    """Each activation upstream's capture probe answer (see `activation_upstreams_check`)."""
    urls = model.urls_for(activation=True)
    return list(await asyncio.gather(*(_capture_probed(url, model) for url in urls)))


async def activation_upstreams_check(model: LanguageModel) -> None:
    """Refuse (503 activation_engine_unconfigured) an activation request to `model` when every
    one of its activation upstreams answered a capture probe without a capture: it lacks the
    vLLM-Lens plugin, and would answer without the capture, or unsteered, with a 200. Each
    URL is probed when the registry first serves it and again after the probe's TTL; an
    upstream that did not answer the probe is not held against it (the request then meets
    the same error as any other)."""
    found = await activation_upstreams_probed(model)
    if found and all(answer is False for answer in found):
        raise ApiError(
            "activation_engine_unconfigured",
            f"The activation upstream of '{model.name}' answers without captures (it does "
            "not run the vLLM-Lens plugin), so it can neither capture nor steer; use another "
            "model.",
        )


async def _capture_probed(url: str, model: LanguageModel) -> bool | None:
    answer, checked_at = _probes.get(url, (None, -1e9))
    ttl = PROBE_FOUND_TTL_S if answer else PROBE_MISSING_TTL_S
    if time.monotonic() - checked_at < ttl:
        return answer
    running = _probes_running.setdefault(asyncio.get_running_loop(), {})
    probe = running.get(url)
    if probe is None or probe.done():
        probe = running[url] = asyncio.ensure_future(_probe(url, model))
    return await asyncio.shield(probe)


async def _probe(url: str, model: LanguageModel) -> bool | None:
    body = dialect.capture_body(model, tokens=[PROBE_TOKEN], layers=[0], max_tokens=1)
    answer = await capture_probe(url, body)
    if answer is not None:
        _probes[url] = (answer, time.monotonic())
    return answer


def probes_clear() -> None:
    """Forget every capture probe's answer (tests that change what an upstream runs)."""
    _probes.clear()
    _probes_running.clear()


async def model_list() -> list[LanguageModel]:
    """The models GET /v1/models lists: each live one's blank sizes filled first, and those
    still blank left out (requests to them get 503 model_sizes_unknown)."""
    registry = await _fresh_registry()
    models = sorted(registry["by_name"].values(), key=lambda model: model.name)
    await asyncio.gather(*(_sizes_tried(model) for model in models))
    return [model for model in models if not model.sizes_missing]


async def _sizes_tried(model: LanguageModel) -> None:
    if model.status == ModelStatus.LIVE:
        with contextlib.suppress(ApiError):
            await model_sizes_ready(model)


def model_card(model: LanguageModel) -> ModelCard:
    """A model as GET /v1/models lists it."""
    return ModelCard(
        id=model.name,
        default=model.is_default,
        status=model.status,
        capabilities=ModelCapabilities(
            max_model_len=model.max_model_len,
            max_logprobs=model.max_logprobs,
            full_vocab_max_prompt_tokens=FULL_VOCAB_MAX_PROMPT_TOKENS,
            activations=model.supports_activations,
            n_layers=model.n_layers,
            hidden_size=model.hidden_size,
            vocab_size=model.vocab_size,
            max_steering_vectors=MAX_STEERING_VECTORS if model.supports_activations else 0,
        ),
    )


def model_cards() -> list[dict]:
    """The models GET /v1/models lists (JSON-shaped dicts), read from the database
    (synchronous, for the portal's and playground's forms: no API key). A live row with blank
    sizes is filled first (`model_sizes_ensure`: a round trip to its upstream until then)."""
    models = list(LanguageModel.objects.defer("tokenizer_json").order_by("name"))
    for model in models:
        if model.status == ModelStatus.LIVE:
            with contextlib.suppress(ApiError):
                model_sizes_ensure(model)
    return [
        model_card(model).model_dump(mode="json") for model in models if not model.sizes_missing
    ]


def upstream_states() -> list[dict]:
    """Every upstream URL of every model with its circuit state, for the staff overview:
    `{model, url, kind ("completions" | "activations"), state ("closed" | "open" |
    "half-open"), recent_failures, open_until (datetime or None)}`."""
    client = redis_sync()
    now_ms = time.time() * 1000
    states = []
    try:
        for model in LanguageModel.objects.defer("tokenizer_json"):
            kinds = [("completions", url) for url in model.upstream_urls] + [
                ("activations", url) for url in model.activation_upstream_urls
            ]
            for kind, url in kinds:
                open_key, _, fails_key, *_ = circuit_keys(url)
                pipe = client.pipeline()
                pipe.get(open_key)
                pipe.zcount(fails_key, now_ms - FAILURE_WINDOW_MS, "+inf")
                open_until, failures = pipe.execute()
                if open_until is None:
                    state, until = "closed", None
                else:
                    until_ms = float(open_until)
                    state = "open" if until_ms > now_ms else "half-open"
                    until = dt.datetime.fromtimestamp(until_ms / 1000, tz=dt.UTC)
                states.append(
                    {
                        "model": model.name,
                        "url": url,
                        "kind": kind,
                        "state": state,
                        "recent_failures": failures,
                        "open_until": until,
                    }
                )
    finally:
        client.close()
    return states
