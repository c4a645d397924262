"""Playground fixtures: recorded /v1 answers of the embedded engine (smollm2-135m) and an
httpx mock of the gateway for the worker."""

import functools
import json
from pathlib import Path

import httpx
import pytest

from acs_client.client import AcsClient
from acs_portal.celery import app as celery_app
from infra.redis import redis_sync
from playground.runs import streams
from tests.gateway.conftest import gateway_url  # noqa: F401 (the live /v1 gateway)

FIXTURES = Path(__file__).parent / "fixtures"
# The modules whose workers call /v1 with `AcsClient`.
WORKER_MODULES = (
    "playground.runs.execution",
    "playground.steering.services",
    "portal.services",
)


# The model card the pages list (`playground.views.model_cards`), without a registry.
MODEL = {
    "id": "smollm2-135m",
    "object": "model",
    "status": "live",
    "capabilities": {
        "max_model_len": 8192,
        "max_logprobs": 20,
        "full_vocab_max_prompt_tokens": 256,
        "activations": True,
        "n_layers": 30,
        "hidden_size": 576,
        "max_steering_vectors": 8,
    },
}
# The header htmx sends: views answer it with a fragment.
HTMX = {"HTTP_HX_REQUEST": "true"}


@pytest.fixture
def ada(client, approved_user):
    """Ada, an approved researcher, signed in."""
    client.force_login(approved_user)
    return client


@pytest.fixture
def listed_model(monkeypatch):
    """The playground's pages list MODEL."""
    monkeypatch.setattr("playground.runs.views.model_cards", lambda: [MODEL])


def replay(run_id) -> list[dict]:
    """Every event published so far to the run's stream."""
    entries = redis_sync().xrange(streams.stream_key(run_id))
    return [json.loads(fields[b"event"]) for _, fields in entries]


def recorded(name: str):
    """A recorded answer: parsed JSON for .json files, the raw text otherwise."""
    text = (FIXTURES / name).read_text()
    return json.loads(text) if name.endswith(".json") else text


@pytest.fixture
def gateway(monkeypatch):
    """Route the worker's /v1 calls to `gateway.handler(request) -> httpx.Response`; every
    request is kept in `gateway.requests`."""

    class Gateway:
        requests: list[httpx.Request] = []
        handler = None

        def __call__(self, request: httpx.Request) -> httpx.Response:
            self.requests.append(request)
            return self.handler(request)

    fake = Gateway()
    fake.requests = []
    transport = httpx.MockTransport(fake)
    workers_client(monkeypatch, transport)
    return fake


def workers_client(monkeypatch, transport: httpx.BaseTransport) -> None:
    """Send the /v1 calls of the playground's workers (runs, same-token scores, job
    submissions) through `transport`."""
    for module in WORKER_MODULES:
        monkeypatch.setattr(
            f"{module}.AcsClient", functools.partial(AcsClient, transport=transport)
        )


@pytest.fixture
def no_enqueue(monkeypatch):
    """Record enqueued run ids instead of sending them to the broker."""
    queued = []
    monkeypatch.setattr(
        celery_app, "send_task", lambda name, args, countdown=None: queued.append(args[0])
    )
    return queued
