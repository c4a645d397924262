"""A model row's sizes (context, layers, hidden size, vocabulary) come from the model: its
upstream's GET /v1/models, else config.json in the row's weights_dir. A row they cannot be
read for is a 503 that says why, never a guess. (A blank row in front of the real engine:
tests/gateway/test_engine_e2e.py.)"""

import asyncio
import io
import json

import pytest
from django.core.management import CommandError, call_command
from django.urls import reverse

from api import selectors
from api.errors import ApiError
from api.models import SIZE_FIELDS, LanguageModel
from tests.accounts.support import logged_in

from .conftest import make_model

pytestmark = pytest.mark.django_db(transaction=True)

BLANK = dict.fromkeys(SIZE_FIELDS)
# What vLLM's GET /v1/models says of a model it serves: its context, no other size.
VLLM_CARD = {"id": "stub-model", "object": "model", "owned_by": "vllm", "max_model_len": 96}
# What the embedded engine's says: every size.
ENGINE_CARD = {
    "id": "stub-model",
    "object": "model",
    "owned_by": "acs",
    "max_model_len": 64,
    "n_layers": 4,
    "hidden_size": 8,
    "vocab_size": 1000,
}
COMPLETION = {"model": "stub-model", "prompt": "hello", "max_tokens": 1}


@pytest.fixture
def blank_model(stub, model):
    """The stub's row, its sizes blank; the stub has no GET /v1/models until a test says."""
    make_model(stub.url, **BLANK)
    return LanguageModel.objects.get(name=model)


def sizes(model) -> dict:
    return {name: getattr(model, name) for name in SIZE_FIELDS}


def sizes_of(card: dict) -> dict:
    return {name: card[name] for name in SIZE_FIELDS}


def weights_dir(folder, **config) -> str:
    """`folder` holding a config.json with these entries."""
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", **config}))
    return str(folder)


async def row_changed(model, **fields) -> None:
    await LanguageModel.objects.filter(pk=model.pk).aupdate(**fields)
    selectors.registry_clear()


def test_an_upstream_reporting_only_its_context_leaves_the_rest_to_weights_dirs_config(
    client, stub, blank_model, tmp_path
):
    stub.mode["models"] = [VLLM_CARD]
    config = weights_dir(
        tmp_path,
        max_position_embeddings=4096,
        num_hidden_layers=6,
        hidden_size=8,
        vocab_size=1000,
    )
    LanguageModel.objects.filter(pk=blank_model.pk).update(weights_dir=config)
    listed = client.get("/v1/models").json()["data"]
    capabilities = next(card for card in listed if card["id"] == "stub-model")["capabilities"]
    # The context the upstream serves, not the one the weights were trained for.
    expected = {"max_model_len": 96, "n_layers": 6, "hidden_size": 8, "vocab_size": 1000}
    assert {name: capabilities[name] for name in SIZE_FIELDS} == expected
    blank_model.refresh_from_db()
    assert sizes(blank_model) == expected
    assert client.post("/v1/completions", json=COMPLETION).status_code == 200


def test_a_row_that_cannot_be_filled_is_a_503_that_says_why(client, stub, blank_model):
    response = client.post("/v1/completions", json=COMPLETION)
    assert response.status_code == 503
    assert response.headers["Retry-After"] == "5"
    error = response.json()["error"]
    assert error["code"] == "model_sizes_unknown"
    assert (
        "The sizes max_model_len, n_layers, hidden_size, vocab_size of model 'stub-model'"
        in (error["message"])
    )
    assert f"{stub.url} answered GET /v1/models with HTTP 404" in error["message"]
    assert "it has no weights_dir to read config.json from" in error["message"]
    assert stub.requests == []
    assert "stub-model" not in [card["id"] for card in client.get("/v1/models").json()["data"]]
    blank_model.refresh_from_db()
    assert sizes(blank_model) == BLANK


@pytest.mark.parametrize(
    ("cards", "config", "reasons"),
    [
        (
            [{**ENGINE_CARD, "id": "other-model"}],
            None,
            ["does not serve 'stub-model' (its GET /v1/models lists 'other-model')"],
        ),
        (
            [VLLM_CARD],
            {"num_hidden_layers": 6, "vocab_size": 1000},
            [
                "reports max_model_len of its sizes",
                "its weights_dir's config.json gives no hidden_size",
            ],
        ),
        ([VLLM_CARD], "not json", ["its weights_dir's config.json is not JSON"]),
    ],
)
async def test_each_reason_a_size_stays_blank_is_named(
    async_db_connections_closed, stub, blank_model, tmp_path, cards, config, reasons
):
    stub.mode["models"] = cards
    if config is not None:
        if isinstance(config, dict):
            weights_dir(tmp_path, **config)
        else:
            (tmp_path / "config.json").write_text(config)
    await row_changed(blank_model, weights_dir=str(tmp_path))
    with pytest.raises(ApiError) as refused:
        await selectors.model_get("stub-model")
    assert refused.value.code == "model_sizes_unknown"
    for reason in reasons:
        assert reason in refused.value.message


async def test_sizes_given_on_the_row_are_kept(async_db_connections_closed, stub, blank_model):
    await row_changed(blank_model, max_model_len=32)
    stub.mode["models"] = [ENGINE_CARD]
    served = await selectors.model_get("stub-model")
    assert sizes(served) == {**sizes_of(ENGINE_CARD), "max_model_len": 32}
    stored = await LanguageModel.objects.aget(pk=blank_model.pk)
    assert sizes(stored) == sizes(served)


async def test_a_failed_fill_stays_the_answer_for_a_few_seconds(stub, blank_model, monkeypatch):
    with pytest.raises(ApiError):
        await selectors.model_get("stub-model")
    stub.mode["models"] = [ENGINE_CARD]
    with pytest.raises(ApiError, match="HTTP 404"):
        await selectors.model_get("stub-model")
    assert stub.paths.count("/v1/models") == 1
    monkeypatch.setattr(selectors, "SIZES_RETRY_S", 0.0)
    assert sizes(await selectors.model_get("stub-model")) == sizes_of(ENGINE_CARD)


async def test_requests_that_find_a_row_blank_share_one_fill(stub, blank_model):
    stub.mode["models"] = [ENGINE_CARD]
    served = await asyncio.gather(*(selectors.model_get("stub-model") for _ in range(16)))
    assert {tuple(sizes(model).values()) for model in served} == {
        tuple(sizes_of(ENGINE_CARD).values())
    }
    assert stub.paths.count("/v1/models") == 1


def test_staff_saving_a_blank_row_fill_it_or_are_told_why(staff_user, stub, blank_model):
    staff_user.is_superuser = True
    staff_user.save()
    browser = logged_in(staff_user)
    url = reverse("admin:api_languagemodel_change", args=[blank_model.pk])
    fields = {
        "name": "stub-model",
        "served_model_name": "",
        "upstream_urls": f'["{stub.url}"]',
        "activation_upstream_urls": "[]",
        "max_logprobs": 100,
        "status": "live",
    }
    page = browser.post(url, fields, follow=True).content.decode()
    assert "could not be filled" in page
    assert "its requests get 503 model_sizes_unknown" in page
    blank_model.refresh_from_db()
    assert sizes(blank_model) == BLANK
    stub.mode["models"] = [ENGINE_CARD]
    assert browser.post(url, fields).status_code == 302
    blank_model.refresh_from_db()
    assert sizes(blank_model) == sizes_of(ENGINE_CARD)


def test_the_command_fills_blank_rows_and_names_those_it_cannot(stub, blank_model):
    stub.mode["models"] = [ENGINE_CARD]
    out = io.StringIO()
    call_command("acs_model_sizes", stdout=out)
    assert out.getvalue() == (
        "stub-model: max_model_len=64 n_layers=4 hidden_size=8 vocab_size=1000\n"
    )
    make_model(stub.url, name="unlisted", is_default=False, **BLANK)
    with pytest.raises(CommandError, match="of model 'unlisted' are blank"):
        call_command("acs_model_sizes", "unlisted", "stub-model", stdout=io.StringIO())
    with pytest.raises(CommandError, match="No model is called 'nope'"):
        call_command("acs_model_sizes", "nope")
