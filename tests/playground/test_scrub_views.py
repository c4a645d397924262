"""The scrubber of a finished sweep: the page embeds, per scale, what the slider shows (the
run's text, the scale as entered, its same-token figure), with and without HX-Request."""

import json
import re
import uuid

from django.urls import reverse

from infra.lifecycle import WorkStatus
from playground.models import Run, RunKind, SteeringScore
from playground.runs import views

from .conftest import HTMX, recorded


def sweep(user, texts: dict[float, str], *, score_status=WorkStatus.FAILED):
    """A finished sweep whose run at each scale wrote `texts[scale]`."""
    group = uuid.uuid4()
    for scale, text in texts.items():
        response = recorded("completion_logprobs.json")
        response["choices"][0]["text"] = text
        Run.objects.create(
            user=user, kind=RunKind.SWEEP, group=group, scale=scale, status=WorkStatus.SUCCEEDED,
            request={"model": "smollm2-135m", "prompt": "I feel", "max_tokens": 6},
            response=response, meta={"target_token": "", "scale_unit": "absolute"},
        )  # fmt: skip
    SteeringScore.objects.create(group=group, user=user, status=score_status)
    return group


def steps_of(page: str, group) -> list[dict]:
    script = re.search(
        rf'<script id="scrub-steps-{group}" type="application/json">(.*?)</script>', page, re.S
    )
    return json.loads(script.group(1))


def test_sweep_page_embeds_each_scale_for_the_slider(ada, approved_user):
    group = sweep(approved_user, {0.0: " fine", -4.0: " sad", 8.0: " <b>happy</b>"})
    url = reverse("playground:group_detail", args=[group])
    page = ada.get(url).content.decode()
    steps = steps_of(page, group)
    assert [(s["scale"], s["label"], s["text"]) for s in steps] == [
        (-4.0, "-4 (steered)", " sad"),
        (0.0, "0 (baseline)", " fine"),
        (8.0, "8 (steered)", " <b>happy</b>"),
    ]
    runs = {run.scale: run for run in Run.objects.filter(group=group)}
    assert [s["url"] for s in steps] == [
        reverse("playground:run_detail", args=[runs[scale].pk]) for scale in (-4.0, 0.0, 8.0)
    ]
    # The slider opens at the largest scale, its text shown as text.
    assert 'type="range"' in page and 'max="2" step="1" value="2"' in page
    assert 'aria-valuetext="8 (steered)"' in page
    assert 'data-scrub-text aria-live="polite"> &lt;b&gt;happy&lt;/b&gt;</pre>' in page
    assert "js/scrub.js" in page
    partial = ada.get(url, **HTMX).content.decode()
    assert "<html" not in partial and steps_of(partial, group) == steps


def test_the_playground_page_scrubs_the_latest_sweep_too(ada, approved_user, monkeypatch):
    monkeypatch.setattr(views, "model_cards", lambda: [])
    group = sweep(approved_user, {0.0: " fine", 4.0: " glad", 8.0: " happy"})
    page = ada.get(reverse("playground:page")).content.decode()
    assert [s["scale"] for s in steps_of(page, group)] == [0.0, 4.0, 8.0]
    assert "js/scrub.js" in page


def test_a_sweep_still_running_has_no_slider(ada, approved_user):
    group = sweep(approved_user, {0.0: " fine", 4.0: " glad", 8.0: " happy"})
    Run.objects.filter(group=group, scale=8.0).update(status=WorkStatus.RUNNING)
    page = ada.get(reverse("playground:group_detail", args=[group])).content.decode()
    assert 'type="range"' not in page
