"""The run history (issue 21, item 5): filters by kind, prompt text and vector in the query
string, a page at a time, as an htmx partial or the whole page."""

import datetime as dt
import uuid

import numpy as np
import pytest
from django.urls import reverse
from django.utils import timezone

from infra.lifecycle import WorkStatus
from playground.models import Run, RunKind
from playground.runs.history import RUNS_PER_PAGE
from playground.vectors.services import steering_vector_create

from .conftest import HTMX

HISTORY = "playground:run_history"


pytestmark = pytest.mark.usefixtures("listed_model")


def make_run(user, prompt, *, kind=RunKind.COMPLETION, vector=None, minutes_ago=0):
    return Run.objects.create(
        user=user, kind=kind, vector=vector, status=WorkStatus.SUCCEEDED,
        request={"model": "smollm2-135m", "prompt": prompt},
        created_at=timezone.now() - dt.timedelta(minutes=minutes_ago),
    )  # fmt: skip


def shown_prompts(body: str, prompts) -> set[str]:
    return {prompt for prompt in prompts if prompt in body}


def test_filters_by_kind_prompt_text_and_vector(ada, approved_user):
    vector = steering_vector_create(
        user=approved_user, name="honesty", model="smollm2-135m", layer=3, method="upload",
        vector=np.ones(576, dtype=np.float32),
    )  # fmt: skip
    make_run(approved_user, "Paris is the capital")
    make_run(approved_user, "The capital of ITALY", kind=RunKind.SWEEP, vector=vector)
    make_run(approved_user, "Bake a cake", kind=RunKind.SWEEP)
    prompts = ["Paris is the capital", "The capital of ITALY", "Bake a cake"]
    url = reverse(HISTORY)

    by_kind = ada.get(url, {"kind": "sweep"}).content.decode()
    assert shown_prompts(by_kind, prompts) == {"The capital of ITALY", "Bake a cake"}
    by_text = ada.get(url, {"prompt": "CAPITAL"}).content.decode()
    assert shown_prompts(by_text, prompts) == {"Paris is the capital", "The capital of ITALY"}
    by_vector = ada.get(url, {"vector": vector.pk}).content.decode()
    assert shown_prompts(by_vector, prompts) == {"The capital of ITALY"}
    both = ada.get(url, {"kind": "sweep", "prompt": "capital"}).content.decode()
    assert shown_prompts(both, prompts) == {"The capital of ITALY"}
    none = ada.get(url, {"prompt": "zebra"}).content.decode()
    assert "No runs match these filters." in none


def test_a_list_prompt_matches_on_any_of_its_prompts(ada, approved_user):
    make_run(approved_user, ["first prompt", "second one"])
    body = ada.get(reverse(HISTORY), {"prompt": "second"}).content.decode()
    assert "first prompt | second one" in body


def test_pages_hold_25_runs_newest_first_and_keep_the_filters(ada, approved_user):
    for index in range(RUNS_PER_PAGE + 5):
        make_run(approved_user, f"prompt number {index:02d}", minutes_ago=index)
    make_run(approved_user, "a sweep", kind=RunKind.SWEEP)
    first = ada.get(reverse(HISTORY), {"kind": "completion"}).content.decode()
    assert "prompt number 00" in first and "prompt number 24" in first
    assert "prompt number 25" not in first and "a sweep" not in first
    assert "Page 1 of 2 (30 runs)" in first
    assert 'href="/playground/runs/?kind=completion&amp;page=2"' in first
    second = ada.get(reverse(HISTORY), {"kind": "completion", "page": 2}).content.decode()
    assert "prompt number 25" in second and "prompt number 29" in second
    assert "prompt number 24" not in second
    assert 'href="/playground/runs/?kind=completion&amp;page=1"' in second


def test_a_page_past_the_end_shows_the_last(ada, approved_user):
    make_run(approved_user, "only run")
    for page in ("7", "x"):
        response = ada.get(reverse(HISTORY), {"page": page})
        assert response.status_code == 200 and "only run" in response.content.decode()


def test_htmx_gets_the_list_partial_and_a_history_restore_the_page(ada, approved_user):
    make_run(approved_user, "Paris is the capital")
    url = reverse(HISTORY)
    partial = ada.get(url, {"kind": "completion"}, **HTMX)
    body = partial.content.decode()
    assert "<html" not in body and body.lstrip().startswith('<div id="history">')
    assert 'hx-push-url="true"' in body and "Paris is the capital" in body
    assert "HX-Request" in partial["Vary"]
    restored = ada.get(url, HTTP_HX_HISTORY_RESTORE_REQUEST="true", **HTMX)
    assert "<html" in restored.content.decode()
    full = ada.get(url, {"kind": "completion"})
    assert "<html" in full.content.decode() and '<option value="completion" selected>' in (
        full.content.decode()
    )


def test_a_patching_grids_cells_are_listed_only_when_asked_for_by_kind(ada, approved_user):
    group = uuid.uuid4()
    for kind, prompt in [
        (RunKind.PATCHING_CAPTURE, "Paris capture"),
        (RunKind.PATCHED, "One patched cell"),
    ]:
        Run.objects.create(user=approved_user, kind=kind, group=group, request={"prompt": prompt})
    make_run(approved_user, "Bake a cake")
    prompts = ["Paris capture", "One patched cell", "Bake a cake"]
    everything = ada.get(reverse(HISTORY)).content.decode()
    assert shown_prompts(everything, prompts) == {"Paris capture", "Bake a cake"}
    assert reverse("playground:patching_detail", args=[group]) in everything
    recent = ada.get(reverse(HISTORY), HTTP_HX_TARGET="recent-runs", **HTMX)
    assert shown_prompts(recent.content.decode(), prompts) == {"Paris capture", "Bake a cake"}
    cells = ada.get(reverse(HISTORY), {"kind": RunKind.PATCHED}).content.decode()
    assert shown_prompts(cells, prompts) == {"One patched cell"}


def test_the_playground_pages_recent_runs_box_has_no_filters(ada, approved_user):
    make_run(approved_user, "Paris is the capital")
    body = ada.get(reverse(HISTORY), HTTP_HX_TARGET="recent-runs", **HTMX).content.decode()
    assert "Paris is the capital" in body and "All runs, with filters" in body
    assert 'name="kind"' not in body
    page = ada.get(reverse("playground:page")).content.decode()
    assert 'id="recent-runs"' in page and "All runs, with filters" in page


@pytest.mark.parametrize(
    "query, message",
    [({"kind": "nonsense"}, "Select a valid choice"), ({"vector": "abc"}, "Select a valid")],
)
def test_bad_filters_are_field_errors(ada, query, message):
    response = ada.get(reverse(HISTORY), query)
    assert response.status_code == 400 and message in response.content.decode()


def test_another_users_runs_and_vectors_are_not_shown(ada, approved_user, other_user):
    theirs = steering_vector_create(
        user=other_user, name="theirs", model="smollm2-135m", layer=3, method="upload",
        vector=np.ones(576, dtype=np.float32),
    )  # fmt: skip
    make_run(other_user, "someone else's prompt", vector=theirs)
    body = ada.get(reverse(HISTORY)).content.decode()
    assert "someone else" not in body and "theirs" not in body
    response = ada.get(reverse(HISTORY), {"vector": theirs.pk})
    assert response.status_code == 400 and "someone else" not in response.content.decode()


def test_a_steered_run_shows_its_scale_as_entered_with_its_unit(ada, approved_user):
    """A scale entered as 4 × the layer's typical norm is sent as 0.843 (the vector's norm
    differs from the typical norm): the history says what was entered, as the run's page."""
    Run.objects.create(
        user=approved_user, kind=RunKind.SWEEP, status=WorkStatus.SUCCEEDED, scale=0.843213,
        meta={"scale_unit": "typical", "scale_entered": 4.0},
        request={"model": "smollm2-135m", "prompt": "I feel"},
    )  # fmt: skip
    Run.objects.create(
        user=approved_user, kind=RunKind.SWEEP, status=WorkStatus.SUCCEEDED, scale=-12.5,
        request={"model": "smollm2-135m", "prompt": "I think"},
    )  # fmt: skip
    body = ada.get(reverse(HISTORY)).content.decode()
    assert "Scale sweep (scale 4 × typical norm)" in body and "0.843" not in body
    assert "Scale sweep (scale -12.5)" in body
