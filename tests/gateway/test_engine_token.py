"""The gateway sends ACS_ENGINE_TOKEN to an upstream that requires it (the stub refusing as the
engine does; tests/engine/test_surface.py holds the engine itself to that refusal): completions
and the tokenizer.json it counts prompt tokens with both work."""

import pytest

from api import tokenizer
from api.models import LanguageModel

pytestmark = pytest.mark.django_db(transaction=True)

TOKEN = "gateway-engine-token-0123456789"


@pytest.fixture
def tokenizers_cleared():
    tokenizer._tokenizers.clear()
    tokenizer._missing_until.clear()
    yield
    tokenizer._tokenizers.clear()
    tokenizer._missing_until.clear()


def test_gateway_sends_the_engine_token(
    settings, tmp_path, client, stub, model, tokenizers_cleared
):
    settings.ACS_TOKENIZER_CACHE_DIR = str(tmp_path)  # fetched from the upstream, not a file
    settings.ACS_ENGINE_TOKEN = TOKEN
    stub.mode["token"] = TOKEN
    body = {"model": model, "prompt": "hello", "max_tokens": 1}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 1
    assert "/tokenizer.json" in stub.paths
    row = LanguageModel.objects.get(name=model)
    loaded = [value for (name, _), value in tokenizer._tokenizers.items() if name == row.name]
    assert loaded and loaded[0] is not None

    settings.ACS_ENGINE_TOKEN = ""
    refused = client.post("/v1/completions", json=body)
    assert refused.status_code == 502, refused.text
    assert refused.json()["error"]["code"] == "upstream_auth"
