"""Every playground and Jobs page submit while the task queue (Celery's broker, Redis) cannot
be reached: the page says so with 503, keeping what was typed, and nothing is left queued for
a worker that will never hear of it (the rows are failed with the same message, and their
one-time token is freed, so that the same form sent again queues anew).

The broker is a port nothing listens on, as Redis is when it is down: Celery really tries to
publish (retries included) and really fails. Transactional tests: the sends are on-commit hooks,
which run in the view only when its transaction really commits."""

import uuid

import numpy as np
import pytest
from celery import Celery
from django.urls import reverse

from acs_portal.celery import app as celery_app
from infra.lifecycle import WorkStatus
from infra.tasks import TaskQueueUnreachable
from playground import fields
from playground.models import Run, RunComparison, RunKind, SteeringScore
from playground.patching import forms as patching_forms
from playground.runs import views
from playground.steering.services import steering_score_queue
from playground.vectors import forms as vector_forms
from playground.vectors.services import steering_vector_create
from portal.models import JobSubmission
from testsupport.servers import free_port

from .conftest import HTMX, MODEL
from .test_compare_views import finished_run
from .test_patching import form_data, word_tokens

pytestmark = pytest.mark.django_db(transaction=True)

MESSAGE = "The task queue is unreachable; nothing was run or billed — try again in a moment."
HEADERS = pytest.mark.parametrize("headers", [{}, HTMX], ids=["plain", "htmx"])


@pytest.fixture
def broker_unreachable(monkeypatch):
    """The process's Celery app swapped for one whose broker is a closed port."""
    unreachable = Celery(
        "unreachable", broker=f"redis://127.0.0.1:{free_port()}/0", set_as_current=False
    )
    monkeypatch.setattr("infra.tasks.current_app", unreachable)
    yield
    unreachable.close()


@pytest.fixture(autouse=True)
def models(monkeypatch):
    monkeypatch.setattr(views, "model_cards", lambda: [MODEL])
    monkeypatch.setattr("portal.jobs_views.model_cards", lambda: [MODEL])
    for module in (patching_forms, fields, vector_forms):
        monkeypatch.setattr(
            module,
            "tokenize",
            lambda model_id, texts: [word_tokens(text, special) for text, special in texts],
        )


def assert_503_form(response, headers, *, target: str, typed: str):
    """503 with the message in the form, as typed; for htmx the form alone, swapped over its
    old self (base.html swaps a 503 that names its target)."""
    assert response.status_code == 503
    html = response.content.decode()
    assert MESSAGE in html and typed in html
    if headers:
        assert "<html" not in html
        assert response["HX-Retarget"] == target and response["HX-Reswap"] == "outerHTML"
    else:
        assert "<html" in html


def assert_unsent(runs):
    assert runs and all(run.status == WorkStatus.FAILED for run in runs)
    assert {(run.error_code, run.error_message) for run in runs} == {("queue_unreachable", MESSAGE)}
    assert all(run.submit_token is None and run.finished_at for run in runs)


def library_vector(user):
    return steering_vector_create(
        user=user, name="v", model="smollm2-135m", layer=3, method="contrast_last",
        vector=np.full(576, 2.0, dtype=np.float32), layer_typical_norm=96.0,
    )  # fmt: skip


RUN_POST = {"model": "smollm2-135m", "prompt": "Once upon a midnight dreary", "max_tokens": "4"}


@HEADERS
def test_a_run_submitted_while_the_queue_is_unreachable_is_a_503_and_fails_the_run(
    ada, broker_unreachable, headers
):
    response = ada.post(reverse("playground:run_submit"), RUN_POST, **headers)
    assert_503_form(
        response, headers, target="#completion-form", typed="Once upon a midnight dreary"
    )
    assert_unsent(Run.objects.all())


def test_the_same_form_sent_again_once_the_queue_is_back_queues_a_new_run(
    ada, broker_unreachable, no_enqueue, monkeypatch
):
    data = {**RUN_POST, "submit_token": "5b1e3c8e-8f51-4c8e-9d1e-2f5d3c6a7b90"}
    assert ada.post(reverse("playground:run_submit"), data).status_code == 503
    monkeypatch.setattr("infra.tasks.current_app", celery_app)  # the queue is back
    response = ada.post(reverse("playground:run_submit"), data)
    queued = Run.objects.get(status=WorkStatus.QUEUED)
    assert response.status_code == 302 and no_enqueue == [str(queued.id)]
    assert Run.objects.filter(status=WorkStatus.FAILED).count() == 1


def test_a_rerun_while_the_queue_is_unreachable_is_the_runs_page_with_a_503(
    ada, approved_user, broker_unreachable
):
    run = Run.objects.create(
        user=approved_user, request={"model": "smollm2-135m", "prompt": "Hi"},
        status=WorkStatus.SUCCEEDED, response={"choices": []},
    )  # fmt: skip
    response = ada.post(reverse("playground:run_rerun", args=[run.id]))
    assert response.status_code == 503
    assert MESSAGE in response.content.decode() and str(run.id) in response.content.decode()
    assert_unsent(Run.objects.exclude(pk=run.pk))


@HEADERS
def test_a_contrast_vector_while_the_queue_is_unreachable_fails_all_its_captures(
    ada, broker_unreachable, headers
):
    response = ada.post(
        reverse("playground:vector_contrast"),
        {"contrast-name": "love", "contrast-layer": 12, "contrast-positive": "I love",
         "contrast-negative": "I hate", "contrast-method": "contrast_mean"},
        **headers,
    )  # fmt: skip
    assert_503_form(response, headers, target="#vectors", typed='value="love"')
    # The pair and the reference prompts: the sends after the first refused one never ran.
    assert_unsent(Run.objects.filter(kind=RunKind.CONTRAST))
    assert Run.objects.count() == 6


@HEADERS
def test_a_steering_sweep_while_the_queue_is_unreachable_fails_all_its_runs(
    ada, approved_user, broker_unreachable, headers
):
    vector = library_vector(approved_user)
    response = ada.post(
        reverse("playground:steer"),
        {"steer-vector": vector.pk, "steer-prompt": "I think about", "steer-scale_unit": "absolute",
         "steer-scales": "2, 4, 8", "steer-max_tokens": 4, "steer-temperature": 0,
         "steer-seed": 11, "steer-logprobs": 2},
        **headers,
    )  # fmt: skip
    assert_503_form(response, headers, target="#steering-box", typed="I think about")
    assert_unsent(Run.objects.all())
    assert Run.objects.count() == 4


@HEADERS
def test_a_patching_grid_while_the_queue_is_unreachable_fails_both_captures(
    ada, broker_unreachable, headers
):
    response = ada.post(reverse("playground:patching_submit"), form_data(), **headers)
    assert_503_form(response, headers, target="#patching-form", typed="The capital of Italy is")
    assert_unsent(Run.objects.filter(kind=RunKind.PATCHING_CAPTURE))
    assert Run.objects.count() == 2


@HEADERS
def test_a_same_token_scoring_while_the_queue_is_unreachable_shows_it_failed_with_a_503(
    ada, approved_user, broker_unreachable, headers
):
    a = finished_run(approved_user, completion=[(7042, " Paris")])
    b = finished_run(approved_user, completion=[(24196, " Lyon")])
    response = ada.post(reverse("playground:compare_score"), {"a": a.id, "b": b.id}, **headers)
    assert response.status_code == 503
    html = response.content.decode()
    assert f"<code>queue_unreachable</code> {MESSAGE}" in html and "Score again" in html
    if headers:
        assert response["HX-Retarget"] == "#comparison" and "<html" not in html
    comparison = RunComparison.objects.get()
    assert comparison.status == WorkStatus.FAILED and comparison.error_message == MESSAGE


def test_a_steering_score_the_queue_cannot_take_is_failed_not_left_queued(
    approved_user, broker_unreachable
):
    """Queued by the worker of a comparison's last run: the run's task fails loudly, and the
    comparison's page stops waiting for its score."""
    group = uuid.uuid4()
    for kind, scale in ((RunKind.STEERING_BASELINE, 0.0), (RunKind.STEERING_STEERED, 4.0)):
        Run.objects.create(
            user=approved_user, kind=kind, group=group, scale=scale, request={},
            status=WorkStatus.SUCCEEDED,
        )  # fmt: skip
    with pytest.raises(TaskQueueUnreachable):
        steering_score_queue(group=group)
    score = SteeringScore.objects.get(group=group)
    assert score.status == WorkStatus.FAILED and score.error_code == "queue_unreachable"


JOB_POSTS = {
    "completion": {
        "completion-model": "smollm2-135m",
        "completion-prompt": "Once upon a midnight dreary",
        "completion-max_tokens": "4",
    },
    "harvest": {
        "harvest-model": "smollm2-135m",
        "harvest-layers": ["7"],
        "harvest-prompts": "Once upon a midnight dreary",
    },
}


@HEADERS
@pytest.mark.parametrize("kind", ["completion", "harvest"])
def test_a_job_submitted_while_the_queue_is_unreachable_is_a_503_and_refused(
    ada, approved_user, broker_unreachable, kind, headers
):
    response = ada.post(f"/jobs/{kind}/", JOB_POSTS[kind], **headers)
    assert_503_form(response, headers, target="#job-forms", typed="Once upon a midnight dreary")
    submission = JobSubmission.objects.get(user=approved_user)
    assert submission.status == WorkStatus.FAILED
    assert (submission.error_code, submission.error_message) == ("queue_unreachable", MESSAGE)
    assert submission.submit_token is None
