"""Activation patching without the engine: the form's errors (prompts of different token
lengths, too long a target, a logit difference without a corrupted target, layers that do
not exist, too large a grid), the pages with and without HX-Request, the scoring runs built
from the two captures (the clean baseline, the repeats spread among the cells, each cell
steered by clean row − corrupted row at exactly one layer and position), cancelling (and
what the page then says ran), the metrics (log p of a target of several tokens, the logit
difference) with the noise floor, the downloads and the notebook code, all checked against
numpy on the stored /v1 answers. Ada is an approved researcher; Bob is another user. The
real tokenizer, engine and a torch reference are in tests/browser/test_patching.py."""

import csv
import datetime as dt
import functools
import html as html_module
import io
import json
import re

import httpx
import numpy as np
import pytest
from django.urls import reverse
from django.utils import timezone

from acs_client.client import AcsClient
from acs_client.codec import decode, encode_vector
from api.tokenizer import PromptTokens
from infra.lifecycle import WorkStatus
from playground import tasks
from playground.captures import activations
from playground.models import Run, RunKind
from playground.patching import forms as patching_forms
from playground.patching import metrics as patching_metrics
from playground.patching import services as patching
from playground.runs import selectors, views
from playground.vectors.forms import SaveVectorForm

from .conftest import HTMX, MODEL

pytestmark = pytest.mark.django_db

CLEAN = "The capital of France is"
CORRUPTED = "The capital of Italy is"
TARGET = " Paris"
TARGET_ID = 7042
WRONG = " Rome"
WRONG_ID = 7043
HIDDEN = 576
PROMPT_LENGTH = 5
REPEATS = patching.PATCHING_REPEATS


def word_tokens(text: str, add_special_tokens: bool) -> PromptTokens:
    """A stand-in tokenizer: one token per word (a leading space belongs to its word)."""
    words = re.findall(r" ?\S+", text)
    special = {TARGET: TARGET_ID, WRONG: WRONG_ID}
    return PromptTokens(ids=[special.get(w, 100 + len(w)) for w in words], strings=words)


@pytest.fixture(autouse=True)
def tokenizer(monkeypatch):
    monkeypatch.setattr(views, "model_cards", lambda: [MODEL])
    monkeypatch.setattr(
        patching_forms,
        "tokenize",
        lambda model_id, texts: [word_tokens(text, special) for text, special in texts],
    )


def form_data(**fields) -> dict:
    data = {
        "model": "smollm2-135m",
        "patch-clean_prompt": CLEAN,
        "patch-corrupted_prompt": CORRUPTED,
        "patch-target": TARGET,
        "patch-corrupted_target": "",
        "patch-metric": "logprob",
        "patch-layers": "0, 12",
        "patch-positions": "",
    }
    data.update({f"patch-{name}": value for name, value in fields.items()})
    return data


def errors_of(**fields) -> dict:
    form = patching_forms.PatchingForm(
        form_data(**fields), capabilities=patching_forms.ModelCapabilities(MODEL)
    )
    assert not form.is_valid()
    return form.errors


def test_prompts_of_different_lengths_name_both_counts():
    errors = errors_of(corrupted_prompt="The capital city of Italy is")
    assert errors["corrupted_prompt"] == [
        "The corrupted prompt is 6 tokens and the clean prompt 5; patching needs the same "
        "length. Clean: ‘The’ ‘·capital’ ‘·of’ ‘·France’ ‘·is’. Corrupted: ‘The’ ‘·capital’ "
        "‘·city’ ‘·of’ ‘·Italy’ ‘·is’."
    ]


def test_a_target_of_too_many_tokens_is_refused_showing_its_tokens():
    errors = errors_of(target=" a b c d e f g h i")
    assert errors["target"] == [
        "At most 8 tokens; this is 9: ‘·a’ ‘·b’ ‘·c’ ‘·d’ ‘·e’ ‘·f’ ‘·g’ ‘·h’ ‘·i’."
    ]


def test_the_logit_difference_needs_a_different_corrupted_target():
    assert errors_of(metric="logit_diff")["corrupted_target"] == [
        "The logit difference compares the target with the corrupted target: give it."
    ]
    assert errors_of(metric="logit_diff", corrupted_target=TARGET)["corrupted_target"] == [
        "The corrupted target must differ from the target."
    ]


@pytest.mark.parametrize(
    ("fields", "field", "message"),
    [
        (
            {"layers": "0, 30"},
            "layers",
            "Layer 30 in 'Layers' is out of range; this model has layers 0–29.",
        ),
        ({"positions": "5"}, "positions", "No such position: 5. They run from 0 to 4."),
        ({"layers": "a"}, "layers", "Layers: write whole numbers separated by commas."),
        ({"layers": "", "positions": ""}, None, None),
    ],
)
def test_layers_and_positions_are_checked(fields, field, message):
    form = patching_forms.PatchingForm(
        form_data(**fields), capabilities=patching_forms.ModelCapabilities(MODEL)
    )
    if field is None:
        assert form.is_valid(), form.errors
        assert form.cleaned_data["layer_list"] == list(range(30))
        assert form.cleaned_data["position_list"] == [0, 1, 2, 3, 4]
    else:
        assert form.errors[field] == [message]


def test_a_grid_of_more_cells_than_allowed_is_refused():
    prompt = " ".join(["word"] * 20)
    errors = errors_of(clean_prompt=prompt, corrupted_prompt=prompt, layers="")
    assert errors["positions"] == [
        "30 layers × 20 positions is 600 requests; at most 512. Choose fewer."
    ]


def test_page_shows_the_form_and_where_the_grid_will_appear(ada):
    page = ada.get(reverse("playground:patching"))
    assert page.status_code == 200
    assert b"<html" in page.content and b'id="patching-form"' in page.content
    assert b"The grid appears here once you run it." in page.content


PRODUCTION = {**MODEL, "id": "llama-8b", "default": True,
              "capabilities": {**MODEL["capabilities"], "n_layers": 32}}  # fmt: skip


def test_the_registrys_default_model_is_picked_and_any_model_can_be(ada, monkeypatch):
    monkeypatch.setattr(views, "model_cards", lambda: [MODEL, PRODUCTION])
    page = ada.get(reverse("playground:patching")).content.decode()
    assert '<option value="llama-8b" selected>llama-8b</option>' in page
    assert "32 layers; the grid runs on this model." in page
    page = ada.get(reverse("playground:patching"), {"model": "smollm2-135m"}).content.decode()
    assert '<option value="smollm2-135m" selected>smollm2-135m</option>' in page
    assert "30 layers; the grid runs on this model." in page


def test_picking_a_model_with_htmx_redraws_the_form_keeping_what_was_typed(ada, monkeypatch):
    monkeypatch.setattr(views, "model_cards", lambda: [MODEL, PRODUCTION])
    typed = {"model": "smollm2-135m", "patch-clean_prompt": "The Eiffel Tower is in",
             "patch-target": " Paris", "patch-layers": "3, 4"}  # fmt: skip
    response = ada.get(
        reverse("playground:patching"), typed, HTTP_HX_TARGET="patching-form", **HTMX
    )
    html = response.content.decode()
    assert response.status_code == 200 and "<html" not in html
    assert html.lstrip().startswith('<form id="patching-form"')
    assert '<option value="smollm2-135m" selected>' in html
    assert "The Eiffel Tower is in</textarea>" in html
    assert 'value=" Paris"' in html and 'value="3, 4"' in html


def test_invalid_htmx_submit_swaps_the_form_with_its_error(ada, no_enqueue):
    response = ada.post(
        reverse("playground:patching_submit"), form_data(metric="logit_diff"), **HTMX
    )
    assert response.status_code == 200
    assert response["HX-Retarget"] == "#patching-form"
    assert b"<html" not in response.content
    assert "compares the target with the corrupted target" in response.content.decode()
    assert no_enqueue == []


def test_invalid_plain_submit_renders_the_page_with_400(ada, no_enqueue):
    response = ada.post(
        reverse("playground:patching_submit"), form_data(corrupted_prompt="The Italy is")
    )
    assert response.status_code == 400
    assert b"<html" in response.content
    assert "is 3 tokens and the clean prompt 5" in response.content.decode()
    assert Run.objects.count() == 0


@pytest.fixture
def submit(django_capture_on_commit_callbacks):
    """Post the form (the runs' enqueueing, on commit, included)."""

    def post(client, *, htmx: bool, **fields):
        headers = HTMX if htmx else {}
        with django_capture_on_commit_callbacks(execute=True):
            return client.post(
                reverse("playground:patching_submit"), form_data(**fields), **headers
            )

    return post


def test_plain_submit_queues_two_captures_and_redirects_to_the_grid(ada, no_enqueue, submit):
    response = submit(ada, htmx=False)
    captures = list(Run.objects.filter(kind=RunKind.PATCHING_CAPTURE).order_by("created_at"))
    assert response.status_code == 302
    assert response["Location"] == reverse("playground:patching_detail", args=[captures[0].group])
    assert {run.meta["role"] for run in captures} == {"clean", "corrupted"}
    clean = next(run for run in captures if run.meta["role"] == "clean")
    assert clean.request == {
        "model": "smollm2-135m",
        "prompt": [*word_tokens(CLEAN, True).ids, TARGET_ID],
        "max_tokens": 1,
        "temperature": 0,
        "prompt_logprobs": 0,
        "output_residual_stream": [0, 12],
        "return_token_ids": True,
    }
    assert clean.meta["patching"]["metric"] == "logprob"
    assert sorted(no_enqueue) == sorted(str(run.id) for run in captures)


def test_htmx_submit_returns_the_grid_panel_polling(ada, no_enqueue, submit):
    response = submit(ada, htmx=True)
    html = response.content.decode()
    assert response.status_code == 200 and "<html" not in html
    assert 'class="patching-grid"' in html and 'hx-trigger="load delay:700ms"' in html
    # 2 captures, the clean baseline, the repeats and 2 layers × 5 positions.
    assert "0 of 16 requests finished (capturing the clean and corrupted prompts first)" in html
    # The form gets a new one-time token out of band.
    assert 'hx-swap-oob="true"' in html


def test_the_same_submission_twice_makes_one_grid(ada, no_enqueue):
    data = form_data()
    data["patch-submit_token"] = "7f0c2f4e-7d4c-4f59-9b8e-0d3b1f0b4a11"
    ada.post(reverse("playground:patching_submit"), data)
    ada.post(reverse("playground:patching_submit"), data)
    assert Run.objects.filter(kind=RunKind.PATCHING_CAPTURE).count() == 2


def prompt_logprobs(ids: list[int], scored: dict[int, float]) -> list:
    """prompt_logprobs as the API gives them for a prompt of `ids`: None first, then at each
    position its own token (logprob `scored[position]`, else -1.0)."""
    return [None] + [
        {str(token): {"logprob": scored.get(position, -1.0), "rank": 1, "decoded_token": "w"}}
        for position, token in enumerate(ids)
        if position
    ]


def capture_answer(prompt_ids: list[int], rows: np.ndarray, target_logprobs: list[float]) -> dict:
    """A /v1 answer of a capture run (prompt then target tokens): the residual stream
    [layers, tokens, hidden] and the prompt logprobs, the last ones the target's."""
    first = len(prompt_ids) - len(target_logprobs)
    scored = {first + j: value for j, value in enumerate(target_logprobs)}
    return {
        "choices": [
            {"index": 0, "text": "x", "prompt_logprobs": prompt_logprobs(prompt_ids, scored)}
        ],
        "activations": {"residual_stream": encode_vector(rows)},
        "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": 1, "total_tokens": 7},
    }


def scoring_answer(request: dict, target_logprobs: list[list[float]]) -> dict:
    """A /v1 answer of a scoring run: choice i scores prompt i (the prompt, then target i)
    with `target_logprobs[i]` at the target's tokens."""
    choices = []
    for index, (ids, values) in enumerate(zip(request["prompt"], target_logprobs, strict=True)):
        scored = {PROMPT_LENGTH + j: value for j, value in enumerate(values)}
        choices.append(
            {"index": index, "text": "x", "prompt_logprobs": prompt_logprobs(ids, scored)}
        )
    # Choices in another order than the prompts': read by their index.
    return {"choices": choices[::-1], "usage": {"prompt_tokens": 12, "completion_tokens": 2}}


def succeed(run: Run, response: dict) -> None:
    Run.objects.filter(pk=run.pk).update(
        status=WorkStatus.SUCCEEDED, response=response, request_id=f"req-{run.pk.hex[:8]}"
    )


@pytest.fixture
def captured(ada, no_enqueue, submit):
    """Submit a grid of layers 0 and 12 (`fields` change the form) and answer its captures
    with known rows: the clean and corrupted rows differ at position 3 only (the word that
    differs). Returns the group and both captures' rows."""

    def capture(**fields):
        submit(ada, htmx=False, **fields)
        group = Run.objects.first().group
        runs = {
            run.meta["role"]: run
            for run in Run.objects.filter(group=group, kind=RunKind.PATCHING_CAPTURE)
        }
        targets = len(runs["clean"].request["prompt"]) - PROMPT_LENGTH
        generator = np.random.default_rng(7)
        clean_rows = generator.normal(size=(2, PROMPT_LENGTH + targets, HIDDEN))
        clean_rows = clean_rows.astype(np.float32)
        corrupted_rows = clean_rows.copy()
        corrupted_rows[:, 3] = generator.normal(size=(2, HIDDEN))
        for role, rows, value in (
            ("clean", clean_rows, -0.25),
            ("corrupted", corrupted_rows, -7.0),
        ):
            prompt = runs[role].request["prompt"]
            succeed(runs[role], capture_answer(prompt, rows, [value] + [-0.5] * (targets - 1)))
        return group, clean_rows, corrupted_rows

    return capture


@pytest.fixture
def captured_grid(captured):
    return captured()


def scoring_runs(group, role: str):
    return Run.objects.filter(group=group, kind=RunKind.PATCHED, meta__role=role)


def test_scoring_runs_are_the_clean_baseline_repeats_and_one_patch_per_cell(captured):
    group, clean_rows, corrupted_rows = captured(corrupted_target=WRONG, metric="logit_diff")
    assert patching.patched_runs_create(group=group) == 1 + REPEATS + 10
    assert patching.patched_runs_create(group=group) == 0, "a second call creates nothing"
    corrupted_ids = word_tokens(CORRUPTED, True).ids
    unpatched = {
        "model": "smollm2-135m",
        "prompt": [[*corrupted_ids, TARGET_ID], [*corrupted_ids, WRONG_ID]],
        "max_tokens": 1,
        "temperature": 0,
        "prompt_logprobs": 0,
        "return_token_ids": True,
    }
    [clean] = scoring_runs(group, "clean")
    clean_ids = word_tokens(CLEAN, True).ids
    assert clean.request == {
        **unpatched,
        "prompt": [[*clean_ids, TARGET_ID], [*clean_ids, WRONG_ID]],
    }
    assert clean.meta["prompt_text"] == f"{CLEAN}{TARGET} | {CLEAN}{WRONG}"
    repeats = scoring_runs(group, "repeat")
    assert [run.request for run in repeats] == [unpatched] * REPEATS
    # Sent in this order: the clean baseline, then the repeats spread among the cells, the
    # first before every cell and the last after them.
    order = [
        run.meta["role"]
        for run in Run.objects.filter(group=group, kind=RunKind.PATCHED).order_by("created_at")
    ]
    assert order == ["clean", "repeat", *["cell"] * 5, "repeat", *["cell"] * 5, "repeat"]
    cells = scoring_runs(group, "cell")
    assert cells.count() == 10
    for run in cells:
        layer, position = run.meta["layer"], run.meta["position"]
        (steering,) = run.request.pop("apply_steering_vectors")
        assert run.request == unpatched
        assert steering["layer_indices"] == [layer]
        assert steering["position_indices"] == [position]
        assert steering["scale"] == 1.0 and steering["norm_match"] is False
        row = [0, 12].index(layer)
        # The rows as the API sent them (bfloat16), subtracted, then sent as bfloat16 again.
        clean_row = decode(encode_vector(clean_rows))[row, position]
        corrupted_row = decode(encode_vector(corrupted_rows))[row, position]
        expected = decode(encode_vector((clean_row - corrupted_row)[None, :]))
        np.testing.assert_array_equal(decode(steering["activations"]), expected)
        if position != 3:
            assert not decode(steering["activations"]).any()


def test_the_worker_creates_the_scoring_runs_when_the_second_capture_succeeds(
    captured_grid, gateway, no_enqueue
):
    group, _, _ = captured_grid
    clean = Run.objects.get(group=group, meta__role="clean", kind=RunKind.PATCHING_CAPTURE)
    answer = dict(clean.response)
    Run.objects.filter(pk=clean.pk).update(status=WorkStatus.QUEUED, response=None)
    gateway.handler = lambda request: httpx.Response(200, json=answer)
    tasks.run_execute_task(str(clean.pk))
    assert Run.objects.filter(group=group, kind=RunKind.PATCHED).count() == 1 + REPEATS + 10


def test_a_grid_whose_patched_runs_cannot_be_built_stops_following_with_a_message(
    ada, captured_grid, gateway, no_enqueue
):
    group, _, _ = captured_grid
    clean = Run.objects.get(group=group, meta__role="clean")
    # Rows of one layer where the grid patches two: nothing to build the patched runs from.
    answer = dict(clean.response)
    one_layer = np.zeros((1, 6, HIDDEN), dtype=np.float32)
    answer["activations"] = {"residual_stream": encode_vector(one_layer)}
    Run.objects.filter(pk=clean.pk).update(status=WorkStatus.QUEUED, response=None)
    gateway.handler = lambda request: httpx.Response(200, json=answer)
    tasks.run_execute_task(str(clean.pk))
    assert not Run.objects.filter(group=group, kind=RunKind.PATCHED).exists()
    html = ada.get(reverse("playground:patching_detail", args=[group]), **HTMX).content.decode()
    assert "Stopped." in html and "submit it again" in html
    assert 'data-finished="true"' in html and "hx-trigger" not in html
    assert "Cancel the grid" not in html


def test_the_sweep_resumes_a_grid_whose_worker_stopped_after_the_captures(captured_grid):
    group, _, _ = captured_grid
    captures = Run.objects.filter(group=group, kind=RunKind.PATCHING_CAPTURE)
    captures.update(finished_at=timezone.now() - dt.timedelta(seconds=30))
    tasks.runs_sweep_task()
    assert not Run.objects.filter(group=group, kind=RunKind.PATCHED).exists(), (
        "its worker may still be queueing them"
    )
    captures.update(finished_at=timezone.now() - patching.STALLED_AFTER * 2)
    tasks.runs_sweep_task()
    assert Run.objects.filter(group=group, kind=RunKind.PATCHED).count() == 1 + REPEATS + 10


def test_cancel_cancels_the_queued_runs_and_says_what_ran_and_what_was_cancelled(
    ada, captured_grid
):
    group, _, _ = captured_grid
    patching.patched_runs_create(group=group)
    [clean] = scoring_runs(group, "clean")
    first_repeat = scoring_runs(group, "repeat").order_by("created_at").first()
    cells = list(scoring_runs(group, "cell").order_by("created_at"))
    succeed(clean, {"choices": []})
    succeed(first_repeat, {"choices": []})
    for run in cells[:3]:
        succeed(run, {"choices": []})
    Run.objects.filter(pk=cells[3].pk).update(status=WorkStatus.RUNNING)
    response = ada.post(reverse("playground:patching_cancel", args=[group]), **HTMX)
    html = response.content.decode()
    assert response.status_code == 200 and "<html" not in html
    assert "Cancel the grid" not in html
    cancelled = Run.objects.filter(group=group, status=WorkStatus.CANCELLED)
    assert cancelled.count() == 6 + 2, "the run already being sent finishes"
    assert set(cancelled.values_list("error_code", flat=True)) == {""}, "a cancel is no error"
    assert Run.objects.get(pk=cells[3].pk).status == WorkStatus.RUNNING
    # What ran and what was cancelled, not "16 of 16 requests finished".
    assert (
        "<strong>Cancelled.</strong> Ran: 2 of 2 captures, 3 of 10 cells, 2 of 4 baseline "
        "requests. Cancelled before they were sent (never billed): 6 cells, 2 baseline "
        "requests. Still finishing: 1 request already sent."
    ) in html
    assert "requests finished" not in html


def test_a_grid_cancelled_while_capturing_creates_no_patched_runs(ada, no_enqueue, submit):
    submit(ada, htmx=False)
    clean = Run.objects.get(meta__role="clean")
    response = ada.post(reverse("playground:patching_cancel", args=[clean.group]))
    assert response.status_code == 302
    assert set(Run.objects.values_list("status", flat=True)) == {WorkStatus.CANCELLED}
    assert patching.patched_runs_create(group=clean.group) == 0
    html = ada.get(response["Location"]).content.decode()
    assert (
        "Ran: 0 of 2 captures. Cancelled before they were sent (never billed): 2 captures. "
        "None of the 10 cells was created."
    ) in html


def test_another_users_grid_is_404_everywhere(ada, other_user, client, no_enqueue, submit):
    submit(ada, htmx=False)
    group = Run.objects.first().group
    client.force_login(other_user)
    for name in ("patching_detail", "patching_json", "patching_csv"):
        assert client.get(reverse(f"playground:{name}", args=[group])).status_code == 404
    assert client.post(reverse("playground:patching_cancel", args=[group])).status_code == 404
    assert not Run.objects.filter(status=WorkStatus.CANCELLED).exists()


# ---------------------------------------------------------------------------------------
# The numbers, against numpy on the stored answers


def answer_grid(group, logprobs_of) -> None:
    """Answer every scoring run of the grid: `logprobs_of(run)` gives, per prompt (target),
    the logprobs of the target's tokens."""
    patching.patched_runs_create(group=group)
    for run in Run.objects.filter(group=group, kind=RunKind.PATCHED):
        succeed(run, scoring_answer(run.request, logprobs_of(run)))


def embedded_numbers(html: str) -> dict:
    return json.loads(re.search(r'id="patching-numbers"[^>]*>(.*?)</script>', html).group(1))


def stored_scores(run: Run, targets: list[list[int]]) -> list[float]:
    """Target i's summed token logprobs, read from the stored answer by hand."""
    choices = {choice["index"]: choice for choice in run.response["choices"]}
    return [
        float(
            np.sum(
                [
                    choices[i]["prompt_logprobs"][PROMPT_LENGTH + j][str(token)]["logprob"]
                    for j, token in enumerate(target)
                ]
            )
        )
        for i, target in enumerate(targets)
    ]


REPEAT_LOGPROBS = ([-7.0, -1.5], [-7.04, -1.52], [-6.97, -1.49])


def logit_difference_answers(run: Run) -> list[list[float]]:
    """The clean baseline strongly for the target; the repeats spread by a few hundredths;
    each cell its own value, the one at layer 12, position 3 within the noise floor."""
    role = run.meta["role"]
    if role == "clean":
        return [[-0.25, -0.1], [-4.0]]
    if role == "repeat":
        target, tail = REPEAT_LOGPROBS[run.meta["repeat"]]
        return [[target, tail], [-0.5]]
    if (run.meta["layer"], run.meta["position"]) == (12, 3):
        return [[-7.01, -1.5], [-0.5]]
    return [[-7.0 + 0.6 * run.meta["position"] + 0.1 * run.meta["layer"], -1.0], [-1.5]]


@pytest.fixture
def logit_difference_grid(captured):
    """A finished grid with a two-token target, " Paris France", and the corrupted target
    " Rome", shown by its logit difference."""
    group, _, _ = captured(target=" Paris France", corrupted_target=WRONG, metric="logit_diff")
    answer_grid(group, logit_difference_answers)
    targets = [[TARGET_ID, 107], [WRONG_ID]]
    runs = {str(run.pk): run for run in Run.objects.filter(group=group)}
    expected = {
        key: stored_scores(run, targets) for key, run in runs.items() if run.kind == "patched"
    }
    return group, runs, expected


def metric_of(scores: list[float], metric: str) -> float:
    return scores[0] - scores[1] if metric == "logit_diff" else scores[0]


def test_logit_difference_and_multi_token_target_numbers_match_numpy(ada, logit_difference_grid):
    group, _, expected = logit_difference_grid
    plain = ada.get(reverse("playground:patching_detail", args=[group]))
    partial = ada.get(reverse("playground:patching_detail", args=[group]), **HTMX)
    assert b"<html" in plain.content and b"<html" not in partial.content
    html = plain.content.decode()
    numbers = embedded_numbers(html)
    assert numbers["metric"] == "logit_diff"
    assert [target["ids"] for target in numbers["targets"]] == [[TARGET_ID, 107], [WRONG_ID]]
    by_role = {}
    for record in numbers["runs"]:
        by_role.setdefault(record["role"], []).append(record)
    for metric in ("logprob", "logit_diff"):
        [clean_record] = by_role["clean"]
        clean = metric_of(expected[clean_record["run"]], metric)
        repeats = np.asarray([metric_of(expected[r["run"]], metric) for r in by_role["repeat"]])
        corrupted = float(repeats.mean())
        floor = float(repeats.max() - repeats.min())
        summary = numbers["metrics"][metric]
        assert summary["clean"] == pytest.approx(clean, abs=1e-12)
        assert summary["corrupted"] == pytest.approx(corrupted, abs=1e-12)
        assert summary["noise_floor"] == pytest.approx(floor, abs=1e-12)
        assert summary["noise_floor_effect"] == pytest.approx(floor / abs(clean - corrupted))
        for record in by_role["cell"]:
            value = metric_of(expected[record["run"]], metric)
            assert record[metric] == pytest.approx(value, abs=1e-12)
            assert record[f"{metric}_effect"] == pytest.approx(
                (value - corrupted) / (clean - corrupted)
            )
            assert record[f"{metric}_within_floor"] == (abs(value - corrupted) <= floor)
    # The logit difference's clean value: (−0.25 − 0.1) − (−4.0).
    assert numbers["metrics"]["logit_diff"]["clean"] == pytest.approx(3.65)
    assert "3.650 nats" in html and "Noise floor" in html
    floor = numbers["metrics"]["logit_diff"]["noise_floor"]
    assert f"<strong>{floor:.3f} nats</strong>" in html
    # The cell at layer 12, position 3 moved less than identical requests do.
    cell = re.search(r'<td [^>]*data-layer="12" data-position="3"[^>]*>(.*?)</td>', html).group(0)
    assert 'class="within-floor"' in cell and ">≈" in cell and "within the noise floor" in cell
    other = re.search(r'<td [^>]*data-layer="0" data-position="4"[^>]*>(.*?)</td>', html).group(0)
    assert "within-floor" not in other and "≈" not in other
    assert "Done: 16 requests." in html and "hx-trigger" not in partial.content.decode()
    # Positions are labelled with their real tokens, the corrupted one where it differs.
    assert '<code>·France</code><br><code class="corrupted-token">·Italy</code>' in html


def test_the_metric_is_picked_on_the_page_with_and_without_htmx(ada, logit_difference_grid):
    group, _, expected = logit_difference_grid
    url = reverse("playground:patching_detail", args=[group])
    partial = ada.get(url + "?metric=logprob", **HTMX)
    html = partial.content.decode()
    assert partial.status_code == 200 and "<html" not in html
    assert 'data-metric="logprob"' in html
    assert f'hx-get="{url}?metric=logprob" hx-trigger' not in html, "a finished grid stops"
    # The other metric is a link with href beside hx-get.
    assert f'href="{url}?metric=logit_diff" hx-get="{url}?metric=logit_diff"' in html
    numbers = embedded_numbers(html)
    clean = next(record for record in numbers["runs"] if record["role"] == "clean")
    assert numbers["metrics"]["logprob"]["clean"] == pytest.approx(
        expected[clean["run"]][0], abs=1e-12
    )
    assert ada.get(url + "?metric=logprob").content.decode().count("<html") == 1
    bad = ada.get(url + "?metric=kl")
    assert bad.status_code == 400
    assert bad.content.decode() == "metric must be one of logprob, logit_diff for this grid."


def test_a_grid_without_a_corrupted_target_offers_no_logit_difference(ada, captured_grid):
    group, _, _ = captured_grid
    url = reverse("playground:patching_detail", args=[group])
    response = ada.get(url + "?metric=logit_diff")
    assert response.status_code == 400
    assert "(it has no corrupted target)" in response.content.decode()
    assert "the logit difference needs a corrupted target" in ada.get(url).content.decode()


def test_the_downloads_hold_every_number_as_json_and_csv(ada, logit_difference_grid):
    group, runs, expected = logit_difference_grid
    as_json = ada.get(reverse("playground:patching_json", args=[group]))
    assert as_json["Content-Disposition"] == f'attachment; filename="patching-{group}.json"'
    document = json.loads(as_json.content)
    as_csv = ada.get(reverse("playground:patching_csv", args=[group]))
    assert as_csv["Content-Type"] == "text/csv; charset=utf-8"
    rows = list(csv.DictReader(io.StringIO(as_csv.content.decode())))
    assert len(rows) == len(document["runs"]) == 1 + REPEATS + 10
    corrupted = np.mean([metric_of(expected[row["run"]], "logit_diff") for row in rows
                         if row["role"] == "repeat"])  # fmt: skip
    clean = metric_of(expected[next(row["run"] for row in rows if row["role"] == "clean")],
                      "logit_diff")  # fmt: skip
    for row in rows:
        scores = expected[row["run"]]
        assert float(row["logprob"]) == pytest.approx(scores[0], abs=1e-12)
        assert float(row["corrupted_target_logprob"]) == pytest.approx(scores[1], abs=1e-12)
        assert float(row["logit_diff"]) == pytest.approx(scores[0] - scores[1], abs=1e-12)
        assert row["request_id"] == runs[row["run"]].request_id
        if row["role"] == "cell":
            assert float(row["logit_diff_effect"]) == pytest.approx(
                (scores[0] - scores[1] - corrupted) / (clean - corrupted)
            )
    assert document["metrics"]["logit_diff"]["definition"].startswith("log p(target | prompt)")
    assert document["clean_tokens"] == ["The", " capital", " of", " France", " is"]


def test_the_downloads_carry_the_tokens_own_text_not_the_pages_visible_whitespace(
    ada, logit_difference_grid
):
    """The page labels a position's token with its whitespace made visible (·Italy); the
    downloads hold the token itself ( Italy), as the API returned it."""
    group, _, _ = logit_difference_grid
    page = ada.get(reverse("playground:patching_detail", args=[group])).content.decode()
    assert "<code>·capital</code>" in page
    document = json.loads(ada.get(reverse("playground:patching_json", args=[group])).content)
    as_csv = ada.get(reverse("playground:patching_csv", args=[group])).content.decode()
    clean = ["The", " capital", " of", " France", " is"]
    corrupted = ["The", " capital", " of", " Italy", " is"]
    for rows in (document["runs"], list(csv.DictReader(io.StringIO(as_csv)))):
        cells = [row for row in rows if row["role"] == "cell"]
        assert cells
        for row in cells:
            position = int(row["position"])
            assert (row["clean_token"], row["corrupted_token"]) == (
                clean[position],
                corrupted[position],
            )


def test_the_notebook_code_computes_the_same_grid(ada, logit_difference_grid, monkeypatch):
    """The page's acs_client code, run against the grid's own stored answers (matched by
    the request body), gives the baselines, noise floor and effects the page shows."""
    group, runs, _ = logit_difference_grid
    html = ada.get(reverse("playground:patching_detail", args=[group])).content.decode()
    code = re.search(r'<pre id="notebook-[^"]+">(.*?)</pre>', html, re.S).group(1)
    answers = {}
    for run in sorted(runs.values(), key=lambda run: run.created_at):
        # The grid asks for token ids to label its runs; the notebook needs none.
        request = {key: value for key, value in run.request.items() if key != "return_token_ids"}
        answers.setdefault(json.dumps(request, sort_keys=True), []).append(run.response)

    def handler(request: httpx.Request) -> httpx.Response:
        stored = answers[json.dumps(json.loads(request.content), sort_keys=True)]
        return httpx.Response(200, json=stored.pop(0) if len(stored) > 1 else stored[0])

    transport = httpx.MockTransport(handler)
    monkeypatch.setattr(
        "acs_client.client.AcsClient", functools.partial(AcsClient, transport=transport)
    )
    monkeypatch.setenv("ACS_API_KEY", "acs-test")
    namespace = {}
    exec(compile(html_module.unescape(code), "notebook", "exec"), namespace)
    numbers = embedded_numbers(html)
    summary = numbers["metrics"]["logit_diff"]
    assert namespace["clean"] == pytest.approx(summary["clean"])
    assert namespace["corrupted"] == pytest.approx(summary["corrupted"])
    assert namespace["noise_floor"] == pytest.approx(summary["noise_floor"])
    for record in numbers["runs"]:
        if record["role"] == "cell":
            row, column = [0, 12].index(record["layer"]), record["position"]
            assert namespace["effect"][row, column] == pytest.approx(record["logit_diff_effect"])


@pytest.mark.parametrize(
    ("effect", "colour"),
    [(1.0, "#ef8a62"), (2.5, "#ef8a62"), (0.0, "#ffffff"), (-1.0, "#67a9cf"), (None, "#e5e5e5")],
)
def test_effect_colours_clip_to_the_legend(effect, colour):
    assert patching_metrics.effect_colour(effect) == colour


# ---------------------------------------------------------------------------------------
# Patching runs elsewhere in the playground


def test_history_and_the_save_vector_form_show_patching_runs_by_their_text(
    ada, approved_user, captured_grid
):
    group, _, _ = captured_grid
    page = ada.get(reverse("playground:run_history")).content.decode()
    assert f"{CLEAN}{TARGET}" in page and f"{CORRUPTED}{TARGET}" in page
    assert "100 | " not in page and str(TARGET_ID) not in page
    clean = Run.objects.get(group=group, meta__role="clean", kind=RunKind.PATCHING_CAPTURE)
    corrupted = Run.objects.get(group=group, meta__role="corrupted")
    form = SaveVectorForm(run=clean, capture=activations(clean.body, clean.response))
    labels = [label for _, label in form.fields["subtract_run"].choices]
    assert any(label.startswith(f"{CORRUPTED}{TARGET} (") for label in labels), labels
    assert corrupted.prompt_preview == f"{CORRUPTED}{TARGET}"


def test_the_playground_page_does_not_take_a_grid_for_a_steering_comparison(
    ada, approved_user, no_enqueue, submit
):
    submit(ada, htmx=False)
    assert selectors.latest_group_for_user(user=approved_user) is None
    page = ada.get(reverse("playground:page")).content.decode()
    assert "Steered vs baseline" not in page and "What each arm sent" not in page
    assert 'href="/playground/patching/"' in page


def test_a_grid_is_no_steering_comparison_at_the_comparison_url(ada, no_enqueue, submit):
    submit(ada, htmx=False)
    group = Run.objects.first().group
    assert ada.get(reverse("playground:group_detail", args=[group])).status_code == 404
