"""A live gateway (uvicorn serving acs_portal.asgi in a thread of the test process, on the
test database) in front of a stub upstream. Tests using them need
`pytest.mark.django_db(transaction=True)` so the server's connections see the test's rows."""

import asyncio
import time

import httpx
import pytest
from django.db import connections

from api import admission, completions, selectors, upstream
from api.models import LanguageModel
from infra import background
from metering import leases, windows
from testsupport.servers import serve_in_thread, stop_server
from testsupport.stub import StubUpstream


@pytest.fixture(scope="session")
def stub_upstream():
    stub = StubUpstream().start()
    yield stub
    stub.stop()


@pytest.fixture(scope="session")
def gateway_url(tmp_path_factory, django_db_setup):
    """Depends on django_db_setup so that the server (and its pool) stops before the test
    database is dropped."""
    from django.conf import settings

    from acs_portal.asgi import application

    settings.ACS_TOKENIZER_CACHE_DIR = str(tmp_path_factory.mktemp("tokenizers"))
    # The server's worker threads must not keep connections open past a test: pytest-django
    # empties (and finally drops) the test database between tests.
    connections.settings["default"]["CONN_MAX_AGE"] = 0
    # Lifespan on: shutting down closes the gateway's pool before the test database goes.
    server, thread, url = serve_in_thread(application, lifespan="on")
    yield url
    stop_server(server, thread)


@pytest.fixture(autouse=True)
def leases_write_at_once(monkeypatch):
    """The lease writer writes each request's usage and gives its budget lease back as soon as it
    can, so a test that waited for `background.pending()` sees every window settled. Tests
    of batching and lease reuse set their own delays."""
    monkeypatch.setattr(leases, "FLUSH_DELAY_S", 0)
    monkeypatch.setattr(leases, "LEASE_IDLE_S", 0)
    monkeypatch.setattr(leases, "RETRY_S", 0.05)


@pytest.fixture
def exact_budgets(monkeypatch):
    """No budget leases: every request holds a BudgetReservation of its own."""
    from metering import budgets

    monkeypatch.setattr(budgets, "LEASE_MAX_TOKENS", 0)


@pytest.fixture
def stub(stub_upstream, redis_client):
    stub_upstream.reset()
    upstream.circuit_trust_clear()
    yield stub_upstream
    stub_upstream.reset()


def make_model(url, **fields):
    values = {
        "name": "stub-model",
        "upstream_urls": [url],
        "max_model_len": 64,
        "n_layers": 4,
        "hidden_size": 8,
        "vocab_size": 1000,
        "supports_activations": True,
        "is_default": True,
    }
    values.update(fields)
    LanguageModel.objects.update_or_create(name=values.pop("name"), defaults=values)
    selectors.registry_clear()


@pytest.fixture
def model(stub, transactional_db):
    LanguageModel.objects.all().delete()
    make_model(stub.url)
    yield "stub-model"
    wait_settled()  # before the database is emptied
    selectors.registry_clear()


def wait_settled(timeout=10.0) -> None:
    """Wait until the gateway has written every background settlement and usage record."""
    deadline = time.monotonic() + timeout
    while background.pending():
        assert time.monotonic() < deadline, "settlements still pending"
        time.sleep(0.005)


def key_day_window(key):
    """The key's budget window of today, where requests hold and settle their tokens
    (through a budget lease or a reservation of their own)."""
    from metering.models import UsagePeriod

    return UsagePeriod.objects.get(key=key, period=windows.DAY.name)


def _settled_hook(response):
    if not response.headers.get("content-type", "").startswith("text/event-stream"):
        wait_settled()


async def _async_settled_hook(response):
    while background.pending():
        await asyncio.sleep(0.005)


SETTLED_HOOKS = {"response": [_settled_hook]}
ASYNC_SETTLED_HOOKS = {"response": [_async_settled_hook]}


def gateway_client(gateway_url: str, secret: str, *, timeout: float = 30) -> httpx.Client:
    """An httpx client of the gateway with the key `secret`, declaring its bodies JSON (also
    those sent as raw `content=`); non-streaming responses return once the gateway has settled
    and metered them (the gateway does that after sending the body)."""
    return httpx.Client(
        base_url=gateway_url,
        headers={"Authorization": f"Bearer {secret}", "Content-Type": "application/json"},
        timeout=timeout,
        event_hooks=SETTLED_HOOKS,
    )


@pytest.fixture
def client(gateway_url, api_secret, model):
    """`gateway_client` with the test key."""
    with gateway_client(gateway_url, api_secret) as http:
        yield http


@pytest.fixture
def limits(monkeypatch):
    """Lets a test shrink admission and keepalive limits (the server runs in this process)."""

    def set_limits(**values):
        for name, value in values.items():
            module = completions if name == "KEEPALIVE_S" else admission
            monkeypatch.setattr(module, name, value)

    return set_limits
