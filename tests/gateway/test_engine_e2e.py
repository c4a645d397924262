"""End to end against the real embedded engine (a subprocess of .venv-engine): logprobs,
prompt logprobs, prompt-token counts, capture and steering through the gateway."""

import time

import httpx
import numpy as np
import openai
import pytest

from accounts.services.keys import api_key_create
from acs_client.codec import decode, encode_vector
from api import tokenizer, upstream
from api.models import LanguageModel
from api.selectors import model_get, registry_clear
from tests.conftest import ENGINE_MODEL_FIELDS

from ..bombs import zero_bomb
from .conftest import SETTLED_HOOKS, gateway_client, wait_settled

pytestmark = pytest.mark.django_db(transaction=True)

PROMPT = "The capital of France is"


@pytest.fixture
def engine_model(engine_url, transactional_db, redis_client):
    LanguageModel.objects.all().delete()
    LanguageModel.objects.create(
        name="smollm2-135m",
        upstream_urls=[engine_url],
        **ENGINE_MODEL_FIELDS,
        is_default=True,
    )
    registry_clear()
    yield "smollm2-135m"
    wait_settled()
    registry_clear()


@pytest.fixture
def sdk(gateway_url, api_secret, engine_model):
    return openai.OpenAI(
        base_url=f"{gateway_url}/v1",
        api_key=api_secret,
        max_retries=0,
        timeout=120,
        http_client=httpx.Client(event_hooks=SETTLED_HOOKS, timeout=120),
    )


def test_engine_logprobs_and_prompt_logprobs_through_the_sdk(sdk):
    completion = sdk.completions.create(
        model="smollm2-135m",
        prompt=PROMPT,
        max_tokens=2,
        temperature=0,
        logprobs=3,
        extra_body={"prompt_logprobs": 2},
    )
    choice = completion.choices[0]
    assert choice.text.startswith(" Paris")
    assert len(choice.logprobs.tokens) == 2
    assert all(len(top) >= 3 for top in choice.logprobs.top_logprobs)
    prompt_logprobs = choice.model_extra["prompt_logprobs"]
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == completion.usage.prompt_tokens
    assert all(
        entry["rank"] >= 1 for position in prompt_logprobs[1:] for entry in position.values()
    )


def test_gateway_counts_prompt_tokens_with_the_engines_tokenizer_json(sdk, api_key, exact_budgets):
    from metering.models import BudgetReservation

    tokenizer._tokenizers.clear()
    tokenizer._missing_until.clear()
    prompts = [PROMPT, "Interpretability research reads the residual stream. 🙂 ünïcode"]
    completion = sdk.completions.create(
        model="smollm2-135m", prompt=prompts, max_tokens=1, temperature=0
    )
    reservation = BudgetReservation.objects.get()
    assert reservation.prompt_tokens == completion.usage.prompt_tokens
    assert any(tokenizer._tokenizers.values()), "the gateway fetched /tokenizer.json"


def test_engine_capture_decodes_with_acs_client(client, engine_model):
    response = client.post(
        "/v1/completions",
        json={
            "model": "smollm2-135m",
            "prompt": PROMPT,
            "max_tokens": 2,
            "temperature": 0,
            "output_residual_stream": [1, 5, 29],
        },
        timeout=120,
    )
    assert response.status_code == 200, response.text
    body = response.json()
    residual = body["activations"]["residual_stream"]
    values = decode(residual)
    tokens = body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"] - 1
    assert values.shape == (3, tokens, 576)
    assert np.isfinite(values).all() and np.abs(values).max() > 0
    from metering.models import UsageRecord

    assert UsageRecord.objects.get().activation_layers == [1, 5, 29]


def test_engine_steering_scale_zero_is_a_no_op_and_large_scale_changes_text(client, engine_model):
    base = {"model": "smollm2-135m", "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    plain = client.post("/v1/completions", json=base, timeout=120).json()
    rng = np.random.default_rng(0)
    vector = rng.standard_normal((1, 576)).astype(np.float32)

    def steered(scale):
        steering = [{"activations": encode_vector(vector), "layer_indices": [10], "scale": scale}]
        response = client.post(
            "/v1/completions", json={**base, "apply_steering_vectors": steering}, timeout=120
        )
        assert response.status_code == 200, response.text
        return response.json()

    assert steered(0.0)["choices"][0]["text"] == plain["choices"][0]["text"]
    assert steered(200.0)["choices"][0]["text"] != plain["choices"][0]["text"]
    wrong = client.post(
        "/v1/completions",
        json={
            **base,
            "apply_steering_vectors": [
                {"activations": encode_vector(np.ones((1, 64))), "layer_indices": [10]}
            ],
        },
    )
    assert wrong.status_code == 400 and "hidden size" in wrong.json()["error"]["message"]


def test_requests_larger_than_the_engine_queue_never_open_the_circuit_for_others(
    client, engine_model, gateway_url, other_user, monkeypatch
):
    """257 sequences are more than the engine's waiting queue holds (256): the engine takes
    such a request in whole, and nothing about it counts against the engine's health. With a
    threshold of one failure (the gateway runs in this process), any such request counted as
    a failure would open the circuit: two requests of 257 sequences show it instead of six."""
    monkeypatch.setattr(upstream, "FAILURE_THRESHOLD", 1)
    body = {"model": "smollm2-135m", "prompt": ["Hi"] * 257, "max_tokens": 1}
    for _ in range(upstream.FAILURE_THRESHOLD + 1):
        response = client.post("/v1/completions", json=body, timeout=300)
        assert response.status_code == 200, response.text
        assert len(response.json()["choices"]) == 257
    _, other_secret = api_key_create(user=other_user, name="other key", acting_user=None)
    with gateway_client(gateway_url, other_secret, timeout=120) as other:
        response = other.post(
            "/v1/completions",
            json={"model": "smollm2-135m", "prompt": PROMPT, "max_tokens": 2, "temperature": 0},
        )
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    ("shape", "values"),
    [
        ([1, 233017, 576], 233017 * 576),  # an 11 KB body of 268 MB of zeros
        ([1, 10**8, 576], 8),  # a tiny body whose shape asks for 115 GB
    ],
)
def test_steering_decompression_bomb_is_refused_by_the_gateway(client, engine_model, shape, values):
    steering = [{"activations": zero_bomb(shape, values), "layer_indices": [10]}]
    response = client.post(
        "/v1/completions",
        json={"model": "smollm2-135m", "prompt": PROMPT, "apply_steering_vectors": steering},
        timeout=120,
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_request"
    assert "apply_steering_vectors.0.activations.shape" in error["message"]


def test_engine_stream_through_the_gateway(sdk):
    stream = sdk.completions.create(
        model="smollm2-135m",
        prompt=PROMPT,
        max_tokens=4,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
    assert text.startswith(" Paris")
    assert chunks[-1].usage.completion_tokens == 4


def test_client_leaving_a_stream_stops_the_engines_generation(client, engine_model, engine_url):
    """The gateway closes its connection to the engine when its client hangs up, and the
    engine drops the sequence instead of generating the other 490 tokens for nobody."""
    body = {"model": "smollm2-135m", "prompt": PROMPT, "max_tokens": 500, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as response:
        frames = 0
        for line in response.iter_lines():
            frames += line.startswith("data:")
            if frames == 10:
                break
    deadline = time.monotonic() + 10
    while httpx.get(f"{engine_url}/health").json()["active_sequences"]:
        assert time.monotonic() < deadline, "the engine still generates for a client gone"
        time.sleep(0.05)
    wait_settled()


def test_engine_model_status_is_warm(client, engine_model):
    assert client.get("/v1/models/smollm2-135m/status").json()["warm"] is True


def test_the_migrations_point_smollm2_at_the_engine_which_fills_its_sizes(
    engine_url, settings, transactional_db, redis_client
):
    """The row the migrations make for the embedded engine has no sizes typed in: the
    registry takes them from the engine's GET /v1/models when it first serves the row."""
    import importlib

    from asgiref.sync import async_to_sync
    from django.apps import apps

    settings.ENGINE_URL = engine_url
    LanguageModel.objects.all().delete()
    for migration, step in [
        ("0002_default_model", "create_default_model"),
        ("0004_model_weights_dir", "engine_weights_dir"),
        ("0005_model_sizes_filled", "blank_engine_sizes"),
    ]:
        getattr(importlib.import_module(f"api.migrations.{migration}"), step)(apps, None)
    model = LanguageModel.objects.get(name="smollm2-135m")
    assert model.upstream_urls == [engine_url]
    assert model.is_default and model.supports_activations and model.status == "live"
    assert model.sizes_missing == ["max_model_len", "n_layers", "hidden_size", "vocab_size"]
    registry_clear()
    served = async_to_sync(model_get)("smollm2-135m")
    model.refresh_from_db()
    # SmolLM2-135M's sizes as its model card publishes them.
    for filled in (served, model):
        assert (filled.max_model_len, filled.n_layers, filled.hidden_size, filled.vocab_size) == (
            8192,
            30,
            576,
            49152,
        )
