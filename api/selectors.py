"""Reads of the model registry and of upstream health."""

import asyncio
import datetime as dt
import time
import weakref

from acs_client.protocol import FULL_VOCAB_MAX_PROMPT_TOKENS, MAX_STEERING_VECTORS
from acs_portal.redis import redis_sync
from metering.sql import run_db

from .errors import ApiError
from .models import LanguageModel, ModelStatus
from .upstream import FAILURE_WINDOW_MS, circuit_keys

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
    """Forget the cached registry (tests, after a staff edit in this process): the next
    request reads it anew, not through a read already in flight."""
    _registry["loaded_at"] = -1e9
    _reloads.clear()


async def _fresh_registry() -> dict:
    if time.monotonic() - _registry["loaded_at"] > REGISTRY_TTL_S:
        loop = asyncio.get_running_loop()
        reload = _reloads.get(loop)
        if reload is None or reload.done():
            reload = _reloads[loop] = asyncio.ensure_future(run_db(_load_registry))
        # A request cancelled while it waits must not cancel the others' reload.
        await asyncio.shield(reload)
    return _registry


async def model_get(name: str | None) -> LanguageModel:
    """The live model called `name` (the default model when None), or 400 model_not_found."""
    registry = await _fresh_registry()
    model = registry["default"] if name is None else registry["by_name"].get(name)
    if model is None or model.status != ModelStatus.LIVE:
        raise ApiError(
            "model_not_found",
            f"The model '{name}' does not exist; GET /v1/models lists the models."
            if name is not None
            else "Name a model; GET /v1/models lists them.",
        )
    return model


async def model_list() -> list[LanguageModel]:
    registry = await _fresh_registry()
    return sorted(registry["by_name"].values(), key=lambda model: model.name)


def model_card(model) -> dict:
    """A model as GET /v1/models lists it."""
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


def model_cards() -> list[dict]:
    """Every model as GET /v1/models lists it, read from the database (synchronous, for the
    portal's and playground's forms: no API key, no HTTP round trip)."""
    return [
        model_card(model)
        for model in LanguageModel.objects.defer("tokenizer_json").order_by("name")
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
