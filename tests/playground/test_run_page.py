"""The run page's pickers and the request it shows (issue 37, item 5): a window of positions
whose end comes before its start is a field error beside the pickers, with the figures of
the window gone (it was a silent 404 that left the old figures); a steered request is shown
with where to get it whole."""

import json
import re

import pytest
from django.urls import reverse

from infra.lifecycle import WorkStatus
from playground.models import Run

from .conftest import HTMX, recorded

pytestmark = pytest.mark.django_db

PROMPT_STRINGS = ["Hello", " world", ",", " this", " is"]


pytestmark = pytest.mark.usefixtures("listed_model")


@pytest.fixture
def capture_run(approved_user):
    return Run.objects.create(
        user=approved_user,
        request={"model": "smollm2-135m", "prompt": "Hello world, this is", "max_tokens": 1,
                 "output_residual_stream": [0, 4, 8]},
        status=WorkStatus.SUCCEEDED,
        response=recorded("capture.json"),
        tokens={"prompts": [{"ids": [19556, 905, 28, 451, 314], "strings": PROMPT_STRINGS}],
                "completions": [{"ids": [253], "strings": [" a"], "source": "token_ids"}]},
    )  # fmt: skip


WINDOW_ERROR = "From 4 ·is to 2 ,: the end comes before the start. Pick an end at or after 4 ·is."


def test_a_window_ending_before_it_starts_is_a_field_error_without_the_old_figures(
    ada, capture_run
):
    url = reverse("playground:run_figure", args=[capture_run.id, "activations"])
    answer = ada.get(url, {"start": 4, "end": 2}, **HTMX)
    html = answer.content.decode()
    assert answer.status_code == 200 and "<html" not in html
    assert WINDOW_ERROR in html and "data-window-error" in html
    # The views of the window are gone (not the old ones left in place); the pickers keep
    # what was picked, so the error is beside the choice it is about.
    for name in ("heatmap", "cosine", "pca"):
        assert f'data-plot="{name}"' not in html
    assert 'data-plot="norm_by_layer"' in html
    assert '<option value="4" selected>4 ·is</option>' in html
    assert '<option value="2" selected>2 ,</option>' in html
    plain = ada.get(url, {"start": 4, "end": 2})
    assert plain.status_code == 400 and WINDOW_ERROR in plain.content.decode()
    fixed = ada.get(url, {"start": 2, "end": 4}, **HTMX).content.decode()
    assert "data-window-error" not in fixed and 'data-plot="heatmap"' in fixed


def test_a_figure_of_the_window_asked_with_a_backwards_window_says_why(ada, capture_run):
    url = reverse("playground:run_figure", args=[capture_run.id, "heatmap"])
    answer = ada.get(url, {"start": 4, "end": 2, "colour": "log"}, **HTMX)
    assert answer.status_code == 200 and WINDOW_ERROR in answer.content.decode()
    assert ada.get(url, {"start": 4, "end": 2}).status_code == 400


def test_a_steered_request_is_shown_shortened_with_a_download_of_it_whole(ada, approved_user):
    steering = {
        "activations": {"data": "A" * 4000, "dtype": "int16", "original_dtype":
                        "torch.bfloat16", "shape": [1, 576], "compression": "zstd"},
        "layer_indices": [6], "scale": 4.0,
    }  # fmt: skip
    request = {"model": "smollm2-135m", "prompt": "I feel", "max_tokens": 4,
               "apply_steering_vectors": [steering]}  # fmt: skip
    run = Run.objects.create(user=approved_user, request=request, status=WorkStatus.QUEUED)
    page = ada.get(reverse("playground:run_detail", args=[run.id])).content.decode()
    download = reverse("playground:run_request", args=[run.id])
    shown = re.search(r"Request \(exactly as sent\)</summary>\s*<pre>(.*?)</pre>", page, re.S)
    assert "A" * 4000 not in shown.group(1)
    assert "…(4,000 characters: the whole request is in the download below)" in shown.group(1)
    assert f'href="{download}" download' in page
    whole = ada.get(download)
    assert whole["Content-Type"] == "application/json"
    assert whole["Content-Disposition"] == f'attachment; filename="run-{run.id}-request.json"'
    assert json.loads(whole.content) == request
