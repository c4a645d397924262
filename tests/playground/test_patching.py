"""Activation patching without the engine: the form's errors (prompts of different token
lengths, a target of several tokens, layers that do not exist, too large a grid), the pages
with and without HX-Request, the patched runs built from the two captures (clean row −
corrupted row at exactly one layer and position), cancelling, and the grid's numbers checked
against numpy on the stored /v1 answers. Ada is an approved researcher; Bob is another user.
The real tokenizer, engine and a torch reference are in tests/browser/test_patching.py."""

import datetime as dt
import json
import re

import httpx
import numpy as np
import pytest
from django.urls import reverse
from django.utils import timezone

from acs_client.codec import decode, encode_vector
from api.tokenizer import PromptTokens
from playground import patching, patching_forms, selectors, tasks, views
from playground.models import Run, RunKind, RunStatus

from .test_views import HTMX, MODEL

pytestmark = pytest.mark.django_db

CLEAN = "The capital of France is"
CORRUPTED = "The capital of Italy is"
TARGET = " Paris"
TARGET_ID = 7042
HIDDEN = 576


def word_tokens(text: str, add_special_tokens: bool) -> PromptTokens:
    """A stand-in tokenizer: one token per word (a leading space belongs to its word)."""
    words = re.findall(r" ?\S+", text)
    return PromptTokens(
        ids=[TARGET_ID if w == TARGET else 100 + len(w) for w in words], strings=words
    )


@pytest.fixture(autouse=True)
def tokenizer(monkeypatch):
    monkeypatch.setattr(views, "model_cards", lambda: [MODEL])
    monkeypatch.setattr(
        patching_forms,
        "tokenize",
        lambda model_id, texts: [word_tokens(text, special) for text, special in texts],
    )


@pytest.fixture
def ada(client, approved_user):
    client.force_login(approved_user)
    return client


def form_data(**fields) -> dict:
    data = {
        "model": "smollm2-135m",
        "patch-clean_prompt": CLEAN,
        "patch-corrupted_prompt": CORRUPTED,
        "patch-target": TARGET,
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


def test_a_target_of_several_tokens_is_refused_showing_its_tokens():
    errors = errors_of(target=" Paris France")
    assert errors["target"] == ["The target must be one token; it is 2: ‘·Paris’ ‘·France’."]


@pytest.mark.parametrize(
    ("fields", "field", "message"),
    [
        ({"layers": "0, 30"}, "layers", "No such layer: 30. They run from 0 to 29."),
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


def test_invalid_htmx_submit_swaps_the_form_with_its_error(ada, no_enqueue):
    response = ada.post(
        reverse("playground:patching_submit"), form_data(target=" Paris France"), **HTMX
    )
    assert response.status_code == 200
    assert response["HX-Retarget"] == "#patching-form"
    assert b"<html" not in response.content
    assert "The target must be one token; it is 2" in response.content.decode()
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
    captures = list(Run.objects.filter(kind=RunKind.PATCHING_CAPTURE).order_by("queued_at"))
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
    }
    assert sorted(no_enqueue) == sorted(str(run.id) for run in captures)


def test_htmx_submit_returns_the_grid_panel_polling(ada, no_enqueue, submit):
    response = submit(ada, htmx=True)
    html = response.content.decode()
    assert response.status_code == 200 and "<html" not in html
    assert 'class="patching-grid"' in html and 'hx-trigger="load delay:700ms"' in html
    assert "0 of 12 requests finished (capturing the clean and corrupted prompts first)" in html
    # The form gets a new one-time token out of band.
    assert 'hx-swap-oob="true"' in html


def test_the_same_submission_twice_makes_one_grid(ada, no_enqueue):
    data = form_data()
    data["patch-submit_token"] = "7f0c2f4e-7d4c-4f59-9b8e-0d3b1f0b4a11"
    ada.post(reverse("playground:patching_submit"), data)
    ada.post(reverse("playground:patching_submit"), data)
    assert Run.objects.filter(kind=RunKind.PATCHING_CAPTURE).count() == 2


def capture_answer(prompt_ids: list[int], rows: np.ndarray, target_logprob: float) -> dict:
    """A /v1 answer of a capture run: the residual stream [layers, tokens, hidden] and the
    prompt logprobs, the last entry the target's."""
    entries = [None] + [
        {str(token): {"logprob": -1.0, "rank": 1, "decoded_token": "w"}} for token in prompt_ids[1:]
    ]
    entries[-1] = {str(TARGET_ID): {"logprob": target_logprob, "rank": 3, "decoded_token": TARGET}}
    return {
        "choices": [{"index": 0, "text": "x", "prompt_logprobs": entries}],
        "activations": {"residual_stream": encode_vector(rows)},
        "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": 1, "total_tokens": 7},
    }


def succeed(run: Run, response: dict) -> None:
    Run.objects.filter(pk=run.pk).update(status=RunStatus.SUCCEEDED, response=response)


@pytest.fixture
def captured_grid(ada, no_enqueue, submit):
    """A grid of layers 0 and 12 whose captures have succeeded with known rows: the clean and
    corrupted rows differ at position 3 only (the word that differs)."""
    submit(ada, htmx=False)
    runs = {run.meta["role"]: run for run in Run.objects.filter(kind=RunKind.PATCHING_CAPTURE)}
    generator = np.random.default_rng(7)
    clean_rows = generator.normal(size=(2, 6, HIDDEN)).astype(np.float32)
    corrupted_rows = clean_rows.copy()
    corrupted_rows[:, 3] = generator.normal(size=(2, HIDDEN))
    succeed(runs["clean"], capture_answer(runs["clean"].request["prompt"], clean_rows, -0.25))
    succeed(
        runs["corrupted"],
        capture_answer(runs["corrupted"].request["prompt"], corrupted_rows, -7.0),
    )
    return runs["clean"].group, clean_rows, corrupted_rows


def test_patched_runs_steer_one_layer_and_position_by_clean_minus_corrupted(captured_grid):
    group, clean_rows, corrupted_rows = captured_grid
    assert patching.patched_runs_create(group=group) == 10
    assert patching.patched_runs_create(group=group) == 0, "a second call creates nothing"
    patched = Run.objects.filter(group=group, kind=RunKind.PATCHED)
    assert patched.count() == 10
    corrupted = Run.objects.get(group=group, meta__role="corrupted")
    for run in patched:
        layer, position = run.meta["layer"], run.meta["position"]
        (steering,) = run.request.pop("apply_steering_vectors")
        assert run.request == {
            key: value
            for key, value in corrupted.request.items()
            if key != "output_residual_stream"
        }
        assert steering["layer_indices"] == [layer]
        assert steering["position_indices"] == [position]
        assert steering["scale"] == 1.0 and steering["norm_match"] is False
        row = [0, 12].index(layer)
        # The rows as the API sent them (bfloat16), subtracted, then sent as bfloat16 again.
        clean = decode(encode_vector(clean_rows))[row, position]
        corrupted_row = decode(encode_vector(corrupted_rows))[row, position]
        expected = decode(encode_vector((clean - corrupted_row)[None, :]))
        np.testing.assert_array_equal(decode(steering["activations"]), expected)
        if position != 3:
            assert not decode(steering["activations"]).any()


def test_the_worker_creates_the_patched_runs_when_the_second_capture_succeeds(
    captured_grid, gateway, no_enqueue
):
    group, _, _ = captured_grid
    clean = Run.objects.get(group=group, meta__role="clean")
    answer = dict(clean.response)
    Run.objects.filter(pk=clean.pk).update(status=RunStatus.QUEUED, response=None)
    gateway.handler = lambda request: httpx.Response(200, json=answer)
    tasks.run_execute_task(str(clean.pk))
    assert Run.objects.filter(group=group, kind=RunKind.PATCHED).count() == 10


def test_a_grid_whose_patched_runs_cannot_be_built_stops_following_with_a_message(
    ada, captured_grid, gateway, no_enqueue
):
    group, _, _ = captured_grid
    clean = Run.objects.get(group=group, meta__role="clean")
    # Rows of one layer where the grid patches two: nothing to build the patched runs from.
    answer = dict(clean.response)
    one_layer = np.zeros((1, 6, HIDDEN), dtype=np.float32)
    answer["activations"] = {"residual_stream": encode_vector(one_layer)}
    Run.objects.filter(pk=clean.pk).update(status=RunStatus.QUEUED, response=None)
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
    assert Run.objects.filter(group=group, kind=RunKind.PATCHED).count() == 10


def test_cancel_fails_the_queued_runs_and_stops_the_grid(ada, captured_grid):
    group, _, _ = captured_grid
    patching.patched_runs_create(group=group)
    first = Run.objects.filter(group=group, kind=RunKind.PATCHED).first()
    Run.objects.filter(pk=first.pk).update(status=RunStatus.RUNNING)
    response = ada.post(reverse("playground:patching_cancel", args=[group]), **HTMX)
    html = response.content.decode()
    assert response.status_code == 200 and "<html" not in html
    assert "Cancelled." in html and "Cancel the grid" not in html
    cancelled = Run.objects.filter(group=group, error_code=patching.CANCELLED_CODE)
    assert cancelled.count() == 9, "the run already being sent finishes"
    assert Run.objects.get(pk=first.pk).status == RunStatus.RUNNING


def test_a_grid_cancelled_while_capturing_creates_no_patched_runs(ada, no_enqueue, submit):
    submit(ada, htmx=False)
    clean = Run.objects.get(meta__role="clean")
    response = ada.post(reverse("playground:patching_cancel", args=[clean.group]))
    assert response.status_code == 302
    assert set(Run.objects.values_list("error_code", flat=True)) == {"cancelled"}
    assert patching.patched_runs_create(group=clean.group) == 0


def test_another_users_grid_is_404_everywhere(ada, other_user, client, no_enqueue, submit):
    submit(ada, htmx=False)
    group = Run.objects.first().group
    client.force_login(other_user)
    assert client.get(reverse("playground:patching_detail", args=[group])).status_code == 404
    assert client.post(reverse("playground:patching_cancel", args=[group])).status_code == 404
    assert not Run.objects.filter(error_code="cancelled").exists()


def test_grid_numbers_match_numpy_on_the_stored_answers(ada, captured_grid):
    group, _, _ = captured_grid
    patching.patched_runs_create(group=group)
    patched_logprobs = {}
    for index, run in enumerate(Run.objects.filter(group=group, kind=RunKind.PATCHED)):
        logprob = -7.0 + 0.7 * index
        patched_logprobs[str(run.pk)] = logprob
        answer = capture_answer(run.request["prompt"], np.zeros((1, 6, HIDDEN)), logprob)
        del answer["activations"]
        succeed(run, answer)

    plain = ada.get(reverse("playground:patching_detail", args=[group]))
    partial = ada.get(reverse("playground:patching_detail", args=[group]), **HTMX)
    assert b"<html" in plain.content and b"<html" not in partial.content
    html = plain.content.decode()
    numbers = json.loads(re.search(r'id="patching-numbers"[^>]*>(.*?)</script>', html).group(1))
    runs = {str(run.pk): run for run in Run.objects.filter(group=group)}

    def stored_logprob(run_id):
        entry = runs[run_id].response["choices"][0]["prompt_logprobs"][-1]
        return entry[str(TARGET_ID)]["logprob"]

    clean = stored_logprob(str(Run.objects.get(group=group, meta__role="clean").pk))
    corrupted = stored_logprob(str(Run.objects.get(group=group, meta__role="corrupted").pk))
    assert (numbers["clean_logprob"], numbers["corrupted_logprob"]) == (clean, corrupted)
    assert len(numbers["cells"]) == 10
    for cell in numbers["cells"]:
        patched = stored_logprob(cell["run"])
        assert cell["logprob"] == patched
        assert cell["effect"] == pytest.approx((patched - corrupted) / (clean - corrupted))
        assert f'href="/playground/runs/{cell["run"]}/"' in html
    assert "Done: 12 requests." in html and "hx-trigger" not in partial.content.decode()
    assert "−0.250 nats" in html or "-0.250 nats" in html
    # Positions are labelled with their real tokens, the corrupted one where it differs.
    assert '<code>·France</code><br><code class="corrupted-token">·Italy</code>' in html


@pytest.mark.parametrize(
    ("effect", "colour"),
    [(1.0, "#ef8a62"), (2.5, "#ef8a62"), (0.0, "#ffffff"), (-1.0, "#67a9cf"), (None, "#e5e5e5")],
)
def test_effect_colours_clip_to_the_legend(effect, colour):
    assert patching.effect_colour(effect) == colour


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
