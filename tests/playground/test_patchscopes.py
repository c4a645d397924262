"""Patchscopes without the engine: the form's field errors (an inspection position outside
the prompt or at 0 while generating, a source layer the run did not capture, a target layer
that does not exist), the capture of the inspection prompt and the generations built from it
(each steered at the target layer and the inspection position alone with source − own, as
numpy computes it from the stored rows), the worker and the sweep that queue them,
cancelling, the cost stated, the table and downloads against the stored /v1 answers, and
another user's Patchscope. Ada is an approved researcher. The real tokenizer, engine and a
transformers reference are in test_patchscopes_engine.py."""

import csv
import datetime as dt
import io
import json
import re

import httpx
import numpy as np
import pytest
from django.urls import reverse
from django.utils import timezone

from acs_client.codec import decode, encode_vector
from infra.lifecycle import WorkStatus
from playground import tasks
from playground.models import Run, RunKind
from playground.patchscopes import forms as patchscope_forms
from playground.patchscopes import services
from playground.patchscopes.models import Patchscope
from playground.runs import views

from .conftest import HTMX, MODEL
from .test_patching import word_tokens

pytestmark = pytest.mark.django_db

HIDDEN = 576
SOURCE_PROMPT = "The capital of France is"
SOURCE_LAYERS = [0, 12, 29]
# The stand-in tokenizer's tokens of the default inspection prompt: one per word.
INSPECTION = patchscope_forms.DEFAULT_INSPECTION_PROMPT
INSPECTION_TOKENS = word_tokens(INSPECTION, True)
P = len(INSPECTION_TOKENS.ids)


@pytest.fixture(autouse=True)
def stand_ins(monkeypatch):
    monkeypatch.setattr(views, "model_cards", lambda: [MODEL])
    monkeypatch.setattr("playground.patchscopes.views.model_cards", lambda: [MODEL])
    monkeypatch.setattr(
        patchscope_forms,
        "tokenize",
        lambda model_id, texts: [word_tokens(text, special) for text, special in texts],
    )


def bf16(values: np.ndarray) -> np.ndarray:
    """`values` rounded to bfloat16 as the API sends them (round to nearest even), by hand."""
    bits = np.asarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return rounded.astype(np.uint32).view(np.float32)


@pytest.fixture
def source_run(approved_user):
    """A succeeded capture of SOURCE_PROMPT at SOURCE_LAYERS, its rows random."""
    tokens = word_tokens(SOURCE_PROMPT, True)
    rows = np.random.default_rng(3).normal(size=(3, 5, HIDDEN)).astype(np.float32)
    return Run.objects.create(
        user=approved_user,
        request={
            "model": "smollm2-135m",
            "prompt": SOURCE_PROMPT,
            "max_tokens": 1,
            "output_residual_stream": SOURCE_LAYERS,
        },
        status=WorkStatus.SUCCEEDED,
        response={
            "choices": [{"index": 0, "text": " Paris"}],
            "activations": {"residual_stream": encode_vector(rows)},
            "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
        },
        tokens={
            "prompts": [{"ids": tokens.ids, "strings": tokens.strings}],
            "completions": [{"ids": [7042], "strings": [" Paris"]}],
        },
    )


def form_data(run: Run, **fields) -> dict:
    data = {
        "run": str(run.pk),
        "scope-source_position": "3",
        "scope-source_layers": "",
        "scope-inspection_prompt": INSPECTION,
        "scope-inspection_position": "",
        "scope-target_layer": "",
        "scope-max_tokens": "10",
    }
    data.update({f"scope-{name}": value for name, value in fields.items()})
    return data


@pytest.mark.parametrize(
    ("fields", "field", "message"),
    [
        ({"inspection_position": str(P)}, "inspection_position",
         f"No position {P}: the inspection prompt has {P} tokens, 0–{P - 1}."),
        ({"inspection_position": "0"}, "inspection_position",
         "Position 0 cannot be inspected: Position 0 would also be steered at every generated"),
        ({"source_layers": "0, 5"}, "source_layers",
         "Layer 5 was not captured by the source run; it captured 0, 12, 29."),
        ({"target_layer": "30"}, "target_layer",
         "Layer 30 in 'Target layer' is out of range; this model has layers 0–29."),
        ({"source_position": "9"}, "source_position", "Select a valid choice."),
        ({"max_tokens": "65"}, "max_tokens", "less than or equal to 64"),
    ],
)  # fmt: skip
def test_wrong_positions_and_layers_are_field_errors(ada, source_run, fields, field, message):
    for headers in (HTMX, {}):
        response = ada.post(
            reverse("playground:patchscope_submit"), form_data(source_run, **fields), **headers
        )
        html = response.content.decode()
        assert response.status_code == (200 if headers else 400)
        error = re.search(rf'id="id_scope-{field}".*?<ul class="errorlist"[^>]*>(.*?)</ul>', html,
                          re.S)  # fmt: skip
        assert error and message in error.group(1).replace("&#x27;", "'"), html[-3000:]
    if field == "inspection_position":
        # The error lists the inspection prompt's tokens by position.
        assert "0 ‘cat’ 1 ‘·-&gt;’" in html
    assert not Patchscope.objects.exists() and Run.objects.count() == 1


def stated_cost(html: str) -> int:
    return int(re.search(r"data-cost-tokens>(\d+)<", html).group(1))


def test_the_page_states_the_cost_before_submitting(ada, source_run):
    page = ada.get(reverse("playground:patchscopes"), {"run": source_run.pk}).content.decode()
    # Source positions labelled by their tokens; the last prompt token picked.
    assert '<option value="4" selected>4 ·is</option>' in page
    # One capture (P prompt tokens + 1) and 3 generations of P + 10 tokens.
    assert stated_cost(page) == (P + 1) + 3 * (P + 10)
    cost = ada.get(
        reverse("playground:patchscope_cost"),
        form_data(source_run, source_layers="12", max_tokens="4"),
        **HTMX,
    ).content.decode()
    assert stated_cost(cost) == (P + 1) + (P + 4)
    bad = ada.get(
        reverse("playground:patchscope_cost"), form_data(source_run, target_layer="99"), **HTMX
    ).content.decode()
    assert (
        "The cost is stated once the form is valid: Layer 99 in &#x27;Target layer&#x27; is out "
        "of range" in bad
    )


@pytest.fixture
def submitted(ada, source_run, no_enqueue, django_capture_on_commit_callbacks):
    def submit(**fields) -> Patchscope:
        with django_capture_on_commit_callbacks(execute=True):
            response = ada.post(
                reverse("playground:patchscope_submit"), form_data(source_run, **fields)
            )
        assert response.status_code == 302, response.content.decode()[-2000:]
        scope = Patchscope.objects.get()
        assert response["Location"] == reverse("playground:patchscope_detail", args=[scope.pk])
        return scope

    return submit


def test_submitting_queues_the_capture_of_the_inspection_prompt(submitted, no_enqueue):
    scope = submitted(source_layers="29, 0", target_layer="")
    capture = Run.objects.get(group=scope.pk)
    assert capture.kind == RunKind.PATCHSCOPE_CAPTURE
    assert capture.request == {
        "model": "smollm2-135m",
        "prompt": INSPECTION_TOKENS.ids,
        "max_tokens": 1,
        "temperature": 0,
        "output_residual_stream": [0, 29],
        "return_token_ids": True,
    }
    assert no_enqueue == [str(capture.pk)]
    assert scope.source_layers == [0, 29] and scope.inspection_position == P - 1


def answer_capture(scope: Patchscope, *, seed=5) -> np.ndarray:
    """Succeed the capture with random rows `[target layers, P, hidden]`; returns them."""
    capture = Run.objects.get(group=scope.pk, kind=RunKind.PATCHSCOPE_CAPTURE)
    layers = capture.request["output_residual_stream"]
    rows = np.random.default_rng(seed).normal(size=(len(layers), P, HIDDEN)).astype(np.float32)
    Run.objects.filter(pk=capture.pk).update(
        status=WorkStatus.SUCCEEDED,
        finished_at=timezone.now(),
        response={"choices": [{"index": 0, "text": "x"}],
                  "activations": {"residual_stream": encode_vector(rows)},
                  "usage": {"prompt_tokens": P, "completion_tokens": 1, "total_tokens": P + 1}},
    )  # fmt: skip
    return rows


@pytest.mark.parametrize("target_layer", ["", "12"])
def test_each_generation_injects_source_minus_own_at_one_layer_and_position(
    submitted, source_run, target_layer
):
    scope = submitted(target_layer=target_layer)
    own = answer_capture(scope)
    assert services.patchscope_runs_create(patchscope_id=scope.pk) == 3
    assert services.patchscope_runs_create(patchscope_id=scope.pk) == 0, "once only"
    source = decode(source_run.response["activations"]["residual_stream"])
    targets = [0, 12, 29] if target_layer == "" else [12]
    generations = Run.objects.filter(group=scope.pk, kind=RunKind.PATCHSCOPE)
    assert sorted(run.meta["source_layer"] for run in generations) == SOURCE_LAYERS
    for run in generations:
        source_layer = run.meta["source_layer"]
        target = source_layer if target_layer == "" else 12
        (steering,) = run.request.pop("apply_steering_vectors")
        assert run.request == {
            "model": "smollm2-135m", "prompt": INSPECTION_TOKENS.ids, "max_tokens": 10,
            "temperature": 0, "logprobs": 5, "ignore_eos": True, "return_token_ids": True,
        }  # fmt: skip
        assert steering["layer_indices"] == [target]
        assert steering["position_indices"] == [P - 1]
        assert steering["scale"] == 1.0 and steering["norm_match"] is False
        # The source row (position 3) and the own row at the inspection position, as the
        # API sent them (bfloat16), subtracted, sent as bfloat16 again.
        expected = bf16(
            bf16(source[SOURCE_LAYERS.index(source_layer), 3])
            - bf16(own[targets.index(target), P - 1])
        )
        np.testing.assert_array_equal(decode(steering["activations"])[0], expected)


def test_the_worker_queues_the_generations_when_the_capture_succeeds(
    submitted, gateway, no_enqueue
):
    scope = submitted()
    answer_capture(scope)
    capture = Run.objects.get(group=scope.pk)
    answer = capture.response
    Run.objects.filter(pk=capture.pk).update(status=WorkStatus.QUEUED, response=None)
    gateway.handler = lambda request: httpx.Response(200, json=answer)
    tasks.run_execute_task(str(capture.pk))
    assert Run.objects.filter(group=scope.pk, kind=RunKind.PATCHSCOPE).count() == 3


def test_a_capture_without_the_rows_stops_the_patchscope_with_a_message(ada, submitted):
    scope = submitted()
    answer_capture(scope)
    capture = Run.objects.get(group=scope.pk)
    one_row = encode_vector(np.zeros((1, 2, HIDDEN), dtype=np.float32))
    Run.objects.filter(pk=capture.pk).update(
        response={**capture.response, "activations": {"residual_stream": one_row}}
    )
    assert services.patchscope_runs_create_or_fail(patchscope_id=scope.pk) == 0
    html = ada.get(reverse("playground:patchscope_detail", args=[scope.pk]), **HTMX)
    html = html.content.decode()
    assert "Stopped." in html and "submit it again" in html
    assert 'data-finished="true"' in html and "hx-trigger" not in html


def test_the_sweep_resumes_a_patchscope_whose_worker_stopped_after_the_capture(submitted):
    scope = submitted()
    answer_capture(scope)
    tasks.runs_sweep_task()
    assert not Run.objects.filter(kind=RunKind.PATCHSCOPE).exists(), "its worker may be at it"
    Run.objects.filter(group=scope.pk).update(
        finished_at=timezone.now() - services.STALLED_AFTER - dt.timedelta(seconds=1)
    )
    tasks.runs_sweep_task()
    assert Run.objects.filter(group=scope.pk, kind=RunKind.PATCHSCOPE).count() == 3


def test_cancel_fails_the_queued_runs_and_says_what_ran(ada, submitted):
    scope = submitted()
    answer_capture(scope)
    services.patchscope_runs_create(patchscope_id=scope.pk)
    first, second, third = Run.objects.filter(kind=RunKind.PATCHSCOPE).order_by("created_at")
    Run.objects.filter(pk=first.pk).update(status=WorkStatus.SUCCEEDED, response={
        "choices": [{"index": 0, "text": " Paris"}]})  # fmt: skip
    Run.objects.filter(pk=second.pk).update(status=WorkStatus.RUNNING)
    response = ada.post(reverse("playground:patchscope_cancel", args=[scope.pk]), **HTMX)
    html = response.content.decode()
    assert response.status_code == 200 and "<html" not in html
    assert Run.objects.get(pk=third.pk).status == WorkStatus.CANCELLED
    assert Run.objects.get(pk=second.pk).status == WorkStatus.RUNNING, "already sent: finishes"
    assert (
        "<strong>Cancelled.</strong> Ran: 2 of 4 requests. Never sent (never billed): 1. "
        "Still finishing: 1 already sent."
    ) in html
    assert "Cancel the Patchscope" not in html


def test_cancelled_while_capturing_creates_no_generation(ada, submitted):
    scope = submitted()
    response = ada.post(reverse("playground:patchscope_cancel", args=[scope.pk]))
    assert response.status_code == 302
    answer_capture(scope)
    assert services.patchscope_runs_create(patchscope_id=scope.pk) == 0
    html = ada.get(response["Location"]).content.decode()
    assert "Ran: 1 of 4 requests. Never sent (never billed): 3." in html


def generation_answer(run: Run, words: list[str]) -> dict:
    ids = [1000 + index for index, _ in enumerate(words)]
    return {
        "choices": [
            {
                "index": 0,
                "text": "".join(words),
                "token_ids": ids,
                "finish_reason": "length",
                "logprobs": {
                    "tokens": words,
                    "token_logprobs": [-0.1 * (i + 1) for i in range(len(words))],
                    "top_logprobs": [{word: -0.1, "x": -3.0} for word in words],
                    "text_offset": [],
                },
            }
        ],
        "usage": {
            "prompt_tokens": P,
            "completion_tokens": len(words),
            "total_tokens": P + len(words),
        },
    }


WORDS = {0: [" ->", " The", ";"], 12: [" ->", " France", ";"], 29: [" ->", " Paris", "\n"]}


@pytest.fixture
def finished(submitted):
    scope = submitted(max_tokens="3")
    answer_capture(scope)
    services.patchscope_runs_create(patchscope_id=scope.pk)
    for run in Run.objects.filter(group=scope.pk, kind=RunKind.PATCHSCOPE):
        words = WORDS[run.meta["source_layer"]]
        Run.objects.filter(pk=run.pk).update(
            status=WorkStatus.SUCCEEDED,
            response=generation_answer(run, words),
            usage=generation_answer(run, words)["usage"],
            request_id=f"req-{run.meta['source_layer']}",
            tokens={"completions": [{"ids": [1000, 1001, 1002], "strings": words}]},
        )
    Run.objects.filter(group=scope.pk, kind=RunKind.PATCHSCOPE_CAPTURE).update(
        usage={"total_tokens": P + 1}
    )
    return scope


def test_the_table_shows_each_source_layers_generation_by_its_tokens(ada, finished):
    html = ada.get(reverse("playground:patchscope_detail", args=[finished.pk])).content.decode()
    assert "Done: 4 requests." in html and "hx-trigger" not in html
    assert '<code class="source-position">3 ·France</code>' in html
    assert f'<code class="inspection-position">{P - 1} ·?</code>' in html
    for layer, words in WORDS.items():
        row = re.search(rf'<tr data-source-layer="{layer}".*?</tr>', html, re.S).group(0)
        assert f"{layer} → {layer}" in row
        shown = re.findall(r"<li><code>(.*?)</code></li>", row)
        assert shown == [w.replace(" ", "·").replace("\n", "⏎").replace(">", "&gt;")
                         for w in words]  # fmt: skip
    # Stated and billed agree: every generation produced all its tokens.
    stated = (P + 1) + 3 * (P + 3)
    assert f"<span data-stated-tokens>{stated}</span>" in html
    assert f"<span data-billed-tokens>{stated}</span>" in html


def test_the_downloads_hold_every_generation(ada, finished):
    as_json = ada.get(reverse("playground:patchscope_json", args=[finished.pk]))
    document = json.loads(as_json.content)
    assert as_json["Content-Disposition"] == (
        f'attachment; filename="patchscope-{finished.pk}.json"'
    )
    rows = {row["source_layer"]: row for row in document["rows"]}
    generations = {
        run.meta["source_layer"]: run for run in Run.objects.filter(kind=RunKind.PATCHSCOPE)
    }
    for layer, words in WORDS.items():
        choice = generations[layer].response["choices"][0]
        assert rows[layer]["text"] == choice["text"] and rows[layer]["tokens"] == words
        assert rows[layer]["token_logprobs"] == choice["logprobs"]["token_logprobs"]
        assert rows[layer]["request_id"] == f"req-{layer}"
    assert document["inspection_position"] == P - 1 and document["source_token"] == " France"
    assert document["cost"]["tokens"] == (P + 1) + 3 * (P + 3)
    as_csv = ada.get(reverse("playground:patchscope_csv", args=[finished.pk])).content.decode()
    records = list(csv.DictReader(io.StringIO(as_csv)))
    assert [int(r["source_layer"]) for r in records] == SOURCE_LAYERS
    assert [json.loads(r["tokens"]) for r in records] == [WORDS[layer] for layer in SOURCE_LAYERS]


def test_another_users_patchscope_and_run_are_404(ada, finished, other_user, client, source_run):
    client.force_login(other_user)
    for name in ("patchscope_detail", "patchscope_json", "patchscope_csv"):
        assert client.get(reverse(f"playground:{name}", args=[finished.pk])).status_code == 404
    cancel = client.post(reverse("playground:patchscope_cancel", args=[finished.pk]))
    assert cancel.status_code == 404
    submit = client.post(reverse("playground:patchscope_submit"), form_data(source_run))
    assert submit.status_code == 404


def test_an_htmx_submit_shows_the_table_and_redraws_the_form_without_old_errors(
    ada, source_run, no_enqueue
):
    bad = ada.post(
        reverse("playground:patchscope_submit"),
        form_data(source_run, inspection_position="99"),
        **HTMX,
    )
    assert "No position 99" in bad.content.decode()
    response = ada.post(
        reverse("playground:patchscope_submit"), form_data(source_run, max_tokens="4"), **HTMX
    )
    html = response.content.decode()
    assert response.status_code == 200 and "<html" not in html
    assert 'class="patchscope"' in html and 'hx-trigger="load delay:700ms"' in html
    assert "Running: 0 of 4 requests finished (capturing the inspection prompt first)" in html
    # The form out of band: as typed, no error, a new one-time token, the cost of what it says.
    form = html[html.index('<form id="patchscope-form"') :]
    assert 'hx-swap-oob="true"' in form and "errorlist" not in form
    assert 'name="scope-max_tokens" value="4"' in form
    assert stated_cost(form) == (P + 1) + 3 * (P + 4)


def test_the_run_picker_redraws_the_form_for_the_run_picked(ada, source_run, approved_user):
    other = Run.objects.create(
        user=approved_user,
        request={**source_run.request, "prompt": "Hello world"},
        status=WorkStatus.SUCCEEDED,
        response={**source_run.response, "activations": {"residual_stream": encode_vector(
            np.ones((3, 2, HIDDEN), dtype=np.float32))}},
        tokens={"prompts": [{"ids": [1, 2], "strings": ["Hello", " world"]}]},
    )  # fmt: skip
    page = ada.get(reverse("playground:patchscopes")).content.decode()
    assert '<option value="1" selected>1 ·world</option>' in page, "the latest capture run"
    response = ada.get(
        reverse("playground:patchscopes"),
        {"run": source_run.pk},
        HTTP_HX_TARGET="patchscope-form",
        **HTMX,
    )
    html = response.content.decode()
    assert html.lstrip().startswith('<form id="patchscope-form"')
    assert f'name="run" value="{source_run.pk}"' in html and other.prompt_preview not in html
    assert '<option value="3">3 ·France</option>' in html


def test_without_a_capture_run_the_page_says_how_to_make_one(ada):
    page = ada.get(reverse("playground:patchscopes")).content.decode()
    assert "run a completion with “Capture residual stream”</a> first" in page
    assert 'id="patchscope-form"' not in page
