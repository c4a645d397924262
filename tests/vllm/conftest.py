"""The gateway in front of a real vLLM server with the vLLM-Lens plugin (testsupport/vllm_lens.py:
the one `make test` started, or one of this session's) and of the embedded engine, as two
models of one registry: `vllm` (vLLM-Lens, as docs/deploy.md §5 starts and registers it:
the tokenizer pasted into the row, its `--api-key` the gateway's ACS_ENGINE_TOKEN) and
`engine`. The same public request to both must get the same public answer.

Run by `make test-vllm` (part of `make test`), not by the web suite: `pytest tests/vllm`.
"""

from pathlib import Path

import pytest
from django.db import connections

from acs_portal.celery import app as celery_app
from api.models import LanguageModel
from api.selectors import probes_clear, registry_clear
from tests.conftest import ENGINE_MODEL_FIELDS
from tests.gateway.conftest import gateway_client
from testsupport.servers import engine_server, serve_in_thread, stop_server
from testsupport.vllm_lens import MODEL, vllm_lens_server

VLLM_MODEL = "smollm2-vllm"
ENGINE_MODEL = "smollm2-engine"


@pytest.fixture(scope="session")
def vllm_lens():
    with vllm_lens_server() as server:
        yield server


@pytest.fixture(scope="session")
def engine_url():
    """The engine, computing on one thread: beside vLLM's CPU workers, whose OpenMP threads
    spin between steps, a two-thread engine's barriers stalled it to 1 s a request (80 ms
    alone); one thread takes 0.1 s."""
    with engine_server({"ACS_ENGINE_THREADS": "1"}) as url:
        yield url


@pytest.fixture(scope="session")
def weights_dir(vllm_lens) -> str:
    """The weights directory vLLM serves."""
    from testsupport.vllm_lens import weights_directory

    return weights_directory()


@pytest.fixture(scope="session")
def tokenizer_json(weights_dir) -> str:
    """The model's tokenizer.json, from the weights directory vLLM serves."""
    return (Path(weights_dir) / "tokenizer.json").read_text()


@pytest.fixture(scope="session")
def gateway_url(tmp_path_factory, django_db_setup, vllm_lens):
    """The gateway (this process's settings, ACS_ENGINE_TOKEN that of vLLM's --api-key)
    in a thread."""
    from django.conf import settings

    from acs_portal.asgi import application

    settings.ACS_TOKENIZER_CACHE_DIR = str(tmp_path_factory.mktemp("tokenizers"))
    settings.ACS_ENGINE_TOKEN = vllm_lens.token
    connections.settings["default"]["CONN_MAX_AGE"] = 0
    server, thread, url = serve_in_thread(application, lifespan="on")
    yield url
    stop_server(server, thread)


@pytest.fixture
def models(transactional_db, vllm_lens, engine_url, tokenizer_json, weights_dir, redis_client):
    """The two registry rows, their sizes blank: the engine reports them all; vLLM its
    context only, the rest read from config.json in the vLLM row's weights_dir. Yields
    {"vllm": name, "engine": name}."""
    LanguageModel.objects.all().delete()
    LanguageModel.objects.create(
        name=VLLM_MODEL,
        served_model_name=MODEL,
        upstream_urls=[vllm_lens.url],
        activation_upstream_urls=[vllm_lens.url],
        tokenizer_json=tokenizer_json,
        weights_dir=weights_dir,
        is_default=True,
        **ENGINE_MODEL_FIELDS,
    )
    LanguageModel.objects.create(
        name=ENGINE_MODEL,
        served_model_name=MODEL,
        upstream_urls=[engine_url],
        activation_upstream_urls=[engine_url],
        **ENGINE_MODEL_FIELDS,
    )
    registry_clear()
    probes_clear()
    yield {"vllm": VLLM_MODEL, "engine": ENGINE_MODEL}
    registry_clear()


@pytest.fixture
def client(gateway_url, api_secret, models):
    with gateway_client(gateway_url, api_secret, timeout=600) as http:
        yield http


@pytest.fixture
def sent_tasks(monkeypatch):
    """Celery sends recorded, not delivered: a test runs each worker task itself."""
    sent = []
    monkeypatch.setattr(
        celery_app, "send_task", lambda name, args, countdown=None: sent.append((name, args))
    )
    return sent
