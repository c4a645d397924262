"""The gateway sends ACS_ENGINE_TOKEN to an engine that requires it (a real engine started with
the same token): completions and the tokenizer.json it counts prompt tokens with both work."""

import httpx
import pytest

from api import tokenizer, upstream
from api.models import LanguageModel
from api.selectors import registry_clear
from tests.conftest import ENGINE_MODEL_FIELDS
from tests.servers import engine_server

from .conftest import SETTLED_HOOKS, wait_settled

pytestmark = pytest.mark.django_db(transaction=True)

TOKEN = "gateway-engine-token-0123456789"


@pytest.fixture(scope="module")
def guarded_engine_url():
    with engine_server({"ACS_ENGINE_TOKEN": TOKEN}) as url:
        yield url


@pytest.fixture
def guarded_model(guarded_engine_url, transactional_db, redis_client):
    LanguageModel.objects.all().delete()
    LanguageModel.objects.create(
        name="smollm2-135m",
        upstream_urls=[guarded_engine_url],
        **ENGINE_MODEL_FIELDS,
        is_default=True,
    )
    registry_clear()
    upstream.circuit_trust_clear()
    tokenizer._tokenizers.clear()
    tokenizer._missing_until.clear()
    yield "smollm2-135m"
    wait_settled()
    registry_clear()
    tokenizer._tokenizers.clear()
    tokenizer._missing_until.clear()


def complete(gateway_url, api_secret) -> httpx.Response:
    with httpx.Client(timeout=120, event_hooks=SETTLED_HOOKS) as http:
        return http.post(
            f"{gateway_url}/v1/completions",
            headers={"Authorization": f"Bearer {api_secret}"},
            json={"model": "smollm2-135m", "prompt": "Hello", "max_tokens": 1},
        )


def test_gateway_sends_the_engine_token(settings, tmp_path, gateway_url, api_secret, guarded_model):
    settings.ACS_TOKENIZER_CACHE_DIR = str(tmp_path)  # fetched from the engine, not a file
    settings.ACS_ENGINE_TOKEN = TOKEN
    response = complete(gateway_url, api_secret)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 1
    model = LanguageModel.objects.get(name=guarded_model)
    assert tokenizer._tokenizers[(model.name, ",".join(model.upstream_urls))] is not None

    settings.ACS_ENGINE_TOKEN = ""
    refused = complete(gateway_url, api_secret)
    assert refused.status_code == 502, refused.text
    assert refused.json()["error"]["code"] == "upstream_auth"
