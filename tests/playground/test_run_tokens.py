"""Generated tokens are named by the ids the API returns (issue 37, item 5): every run asks
for `return_token_ids`, and a run without logprobs that generated two "\\n" tokens (ids 198,
198) shows two ⏎ positions, downloads ids 198 198, saves a vector described by them, and
compares equal to the same tokens read from logprobs. Re-tokenizing its text gave one "\\n\\n"
(id 1116) and a false difference. The tokenizer here is a stand-in that, like SmolLM2's,
merges "\\n\\n" into one token when it encodes text."""

import httpx
import numpy as np
import pytest
from django.urls import reverse

from acs_client.codec import encode_vector
from acs_client.downloads import load_activations
from api.tokenizer import PromptTokens
from infra.lifecycle import WorkStatus
from playground import tokens as run_tokens
from playground.compare import differences
from playground.models import Run
from playground.runs import views
from playground.runs.execution import run_execute
from playground.runs.services import run_create
from playground.vectors import services as vector_services

from .conftest import MODEL

pytestmark = pytest.mark.django_db

PROMPT = "The capital of France is"
PROMPT_IDS = [504, 3575, 282, 4649, 314]
VOCABULARY = {504: "The", 3575: " capital", 282: " of", 4649: " France", 314: " is",
              198: "\n", 1116: "\n\n"}  # fmt: skip
NEWLINE, TWO_NEWLINES = 198, 1116


@pytest.fixture(autouse=True)
def tokenizer(monkeypatch):
    """The stand-in tokenizer behind `run_tokens` (the model registry is not needed)."""

    async def model_get(name):
        return name

    async def prompt_tokens(model, prompt, *, add_special_tokens):
        return PromptTokens(ids=PROMPT_IDS, strings=[VOCABULARY[i] for i in PROMPT_IDS])

    async def token_strings(model, id_lists):
        return [[VOCABULARY[token] for token in ids] for ids in id_lists]

    async def token_ids_of_strings(model, strings):
        ids = {string: token for token, string in VOCABULARY.items()}
        return [ids[string] for string in strings]

    for name, stand_in in (
        ("model_get", model_get), ("prompt_tokens", prompt_tokens),
        ("token_strings", token_strings), ("token_ids_of_strings", token_ids_of_strings),
    ):  # fmt: skip
        monkeypatch.setattr(run_tokens, name, stand_in)
    monkeypatch.setattr(views, "model_cards", lambda: [MODEL])


def answer(*, logprobs: bool) -> dict:
    """The engine's answer: " Paris" was not it; two newline tokens were, with the capture of
    layers 0 and 4 (5 prompt tokens + 2 generated − 1 rows)."""
    choice = {"index": 0, "text": "\n\n", "finish_reason": "length",
              "prompt_token_ids": PROMPT_IDS, "token_ids": [NEWLINE, NEWLINE]}  # fmt: skip
    if logprobs:
        choice["logprobs"] = {"tokens": ["\n", "\n"], "token_logprobs": [-0.5, -0.7],
                              "top_logprobs": [None, None], "text_offset": [0, 1]}  # fmt: skip
    rows = np.random.default_rng(1).normal(size=(2, 6, 576)).astype(np.float32)
    return {
        "choices": [choice],
        "activations": {"residual_stream": encode_vector(rows)},
        "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
    }


def run_through(user, gateway, *, logprobs: bool) -> Run:
    request = {"model": "smollm2-135m", "prompt": PROMPT, "max_tokens": 2, "temperature": 0,
               "output_residual_stream": [0, 4]}  # fmt: skip
    if logprobs:
        request["logprobs"] = 0
    gateway.handler = lambda sent: httpx.Response(200, json=answer(logprobs=logprobs))
    run = run_create(user=user, request=request)
    return run_execute(run_id=run.id)


def test_a_run_without_logprobs_names_its_tokens_by_the_ids_returned(
    ada, approved_user, gateway, no_enqueue
):
    run = run_through(approved_user, gateway, logprobs=False)
    assert run.status == WorkStatus.SUCCEEDED
    sent = httpx.Response(200, content=gateway.requests[0].content).json()
    assert sent["return_token_ids"] is True
    assert run.tokens["completions"] == [
        {"ids": [NEWLINE, NEWLINE], "strings": ["\n", "\n"], "source": "token_ids"}
    ]
    # The page: the first generated token, fed back, is position 5, one ⏎ (not ⏎⏎).
    page = ada.get(reverse("playground:run_detail", args=[run.id])).content.decode()
    assert '<option value="5" selected>5 ⏎</option>' in page and "⏎⏎" not in page
    # The download.
    download = load_activations(
        ada.get(reverse("playground:run_activations", args=[run.id])).content
    )
    [capture] = download.captures
    assert capture.token_ids.tolist() == [*PROMPT_IDS, NEWLINE]
    assert capture.token_strings == [VOCABULARY[i] for i in PROMPT_IDS] + ["\n"]
    # A vector saved from it says which tokens it averaged.
    vector = vector_services.steering_vector_from_capture(
        user=approved_user, run=run, name="newline", layer=4, positions=[4, 5]
    )
    assert vector.details["source"]["tokens"] == ["4 ·is", "5 ⏎"]


def test_the_same_tokens_with_and_without_logprobs_compare_equal(
    ada, approved_user, gateway, no_enqueue
):
    with_logprobs = run_through(approved_user, gateway, logprobs=True)
    without = run_through(approved_user, gateway, logprobs=False)
    a, b = differences.run_sequence(with_logprobs), differences.run_sequence(without)
    assert a.ids == b.ids == [*PROMPT_IDS, NEWLINE, NEWLINE]
    page = ada.get(
        reverse("playground:compare") + f"?a={with_logprobs.id}&b={without.id}"
    ).content.decode()
    assert "data-diff-side" in page and '<span class="tok changed"' not in page


def test_without_a_local_tokenizer_the_ids_returned_name_the_tokens_with_the_logprobs_strings(
    approved_user, gateway, no_enqueue, monkeypatch
):
    """A row whose tokenizer cannot be had here (none attached, none in a weights directory,
    none served): the generated tokens keep the exact ids the answer names, not ids guessed
    back from strings (which left a vLLM row's runs with ids [None, None])."""

    async def no_strings(model, id_lists):
        return [None for _ in id_lists]

    async def no_ids(model, strings):
        return None

    monkeypatch.setattr(run_tokens, "token_strings", no_strings)
    monkeypatch.setattr(run_tokens, "token_ids_of_strings", no_ids)
    run = run_through(approved_user, gateway, logprobs=True)
    assert run.tokens["completions"] == [
        {"ids": [NEWLINE, NEWLINE], "strings": ["\n", "\n"], "source": "token_ids"}
    ]


def test_an_answer_without_token_ids_or_logprobs_leaves_its_tokens_unknown(
    approved_user, gateway, no_enqueue
):
    """Never the returned text encoded again: with neither ids nor logprobs (an upstream that
    ignores `return_token_ids`), the generated tokens are unknown, not guessed."""
    plain = answer(logprobs=False)
    del plain["choices"][0]["token_ids"]
    gateway.handler = lambda sent: httpx.Response(200, json=plain)
    run = run_create(user=approved_user, request={"model": "smollm2-135m", "prompt": PROMPT})
    run = run_execute(run_id=run.id)
    assert run.tokens["completions"] == [None]
    assert run.tokens["prompts"][0]["ids"] == PROMPT_IDS


def test_an_echoed_run_does_not_ask_for_token_ids_and_names_its_tokens_by_logprobs(
    approved_user, gateway, no_enqueue
):
    """The API refuses echo beside `return_token_ids` (vLLM leaves the echoed prompt out of
    the text then): an echoed run asks without them, and its generated tokens are the echoed
    logprobs' strings after the prompt's."""
    echoed = answer(logprobs=True)
    choice = echoed["choices"][0]
    del choice["token_ids"], choice["prompt_token_ids"]
    prompt = [VOCABULARY[i] for i in PROMPT_IDS]
    choice["text"] = PROMPT + "\n\n"
    offsets = [len("".join(prompt[:i])) for i in range(len(prompt))]
    choice["logprobs"] = {
        "tokens": [*prompt, "\n", "\n"],
        "token_logprobs": [None] + [-1.0] * (len(prompt) - 1) + [-0.5, -0.7],
        "top_logprobs": [None] * (len(prompt) + 2),
        "text_offset": [*offsets, len(PROMPT), len(PROMPT) + 1],
    }
    gateway.handler = lambda sent: httpx.Response(200, json=echoed)
    request = {"model": "smollm2-135m", "prompt": PROMPT, "max_tokens": 2, "logprobs": 0,
               "echo": True}  # fmt: skip
    run = run_execute(run_id=run_create(user=approved_user, request=request).id)
    sent = httpx.Response(200, content=gateway.requests[0].content).json()
    assert "return_token_ids" not in sent and sent["echo"] is True
    assert run.tokens["completions"] == [
        {"ids": [NEWLINE, NEWLINE], "strings": ["\n", "\n"], "source": "logprobs"}
    ]
