"""Playground forms against a hostile approved user: list fields are capped (and refused
before they are parsed into big lists), duplicates refused, and a form submission creates its
runs once however often the same submission is posted."""

import re
import threading
import uuid

import numpy as np
import pytest
from django.db import connection
from django.urls import reverse

from playground import fields
from playground.models import Run, RunKind
from playground.runs import views
from playground.runs.services import run_create
from playground.vectors import forms as vector_forms
from playground.vectors.services import steering_vector_create

from .conftest import HTMX, MODEL
from .test_patching import word_tokens


@pytest.fixture(autouse=True)
def model_list(monkeypatch):
    monkeypatch.setattr(views, "model_cards", lambda: [MODEL])
    for module in (fields, vector_forms):
        monkeypatch.setattr(
            module, "tokenize", lambda model_id, texts: [word_tokens(t, s) for t, s in texts]
        )


@pytest.fixture
def vector(approved_user):
    return steering_vector_create(
        user=approved_user, name="v", model="smollm2-135m", layer=3, method="contrast_last",
        vector=np.full(576, 2.0, dtype=np.float32), layer_typical_norm=96.0,
    )  # fmt: skip


def steer(client, vector, **fields):
    data = {
        "steer-vector": vector.pk, "steer-prompt": "I think", "steer-scale_unit": "absolute",
        "steer-scales": "4", "steer-max_tokens": 4, "steer-temperature": 0, "steer-seed": 1,
        "steer-logprobs": 2,
    }  # fmt: skip
    data.update({f"steer-{name}": value for name, value in fields.items()})
    return client.post(reverse("playground:steer"), data, **HTMX)


def contrast(client, **fields):
    data = {
        "contrast-name": "love", "contrast-layer": 12, "contrast-positive": "I love",
        "contrast-negative": "I hate", "contrast-method": "contrast_mean",
    }  # fmt: skip
    data.update({f"contrast-{name}": value for name, value in fields.items()})
    return client.post(reverse("playground:vector_contrast"), data, **HTMX)


def complete(client, headers=HTMX, **fields):
    data = {"model": "smollm2-135m", "prompt": "Hello", **fields}
    return client.post(reverse("playground:run_submit"), data, **headers)


# ---------------------------------------------------------------------------------------
# Caps


@pytest.mark.parametrize(
    ("layers", "message"),
    [
        (",".join(["0"] * 5000), "Ensure this value has at most 1000 characters"),
        (",".join(str(i) for i in range(31)), "Layers: at most 30; you gave 31."),
        ("3, 5, 3", "Layers: 3 is listed more than once."),
        ("30", "Layer 30 in &#x27;Layers&#x27; is out of range; this model has layers 0–29."),
    ],
)
def test_steering_layers_are_capped_to_the_model_and_distinct(
    ada, vector, no_enqueue, layers, message
):
    response = steer(ada, vector, layers=layers)
    assert response["HX-Retarget"] == "#steering-box"
    assert message in response.content.decode()
    assert not Run.objects.exists()


@pytest.mark.parametrize(
    ("scales", "message"),
    [
        (",".join(str(i) for i in range(1, 14)), "Scales: at most 12; you gave 13."),
        ("4, 8, 4", "Scales: each scale once"),
        ("4, 1001", "Scales: each within ±1000."),
        ("1" * 2000, "Ensure this value has at most 1000 characters"),
    ],
)
def test_steering_scales_are_capped_and_distinct(ada, vector, no_enqueue, scales, message):
    response = steer(ada, vector, scales=scales)
    assert message in response.content.decode()
    assert not Run.objects.exists()


def test_twelve_distinct_scales_make_a_sweep_of_thirteen_runs(ada, vector, no_enqueue):
    steer(ada, vector, scales=",".join(str(i) for i in range(1, 13)), layers="0, 29")
    assert Run.objects.filter(kind=RunKind.SWEEP).count() == 13


def test_capture_layers_are_capped_and_distinct(ada, no_enqueue):
    many = ",".join(str(i) for i in range(31))
    for layers, message in ((many, "at most 30"), ("2, 2", "2 is listed more than once")):
        response = complete(ada, capture="layers", capture_layers=layers)
        assert message in response.content.decode()
    assert not Run.objects.exists()


def test_contrast_prompts_are_capped(ada, no_enqueue):
    response = contrast(ada, positive="love " * 500)
    assert "Ensure this value has at most 2000 characters" in response.content.decode()
    assert not Run.objects.exists()


# ---------------------------------------------------------------------------------------
# One submission, one run or group


def test_each_run_form_renders_a_new_one_time_token(ada):
    pages = [ada.get(reverse("playground:page")).content.decode() for _ in range(2)]
    for name in ("submit_token", "steer-submit_token", "contrast-submit_token"):
        tokens = [re.search(rf'name="{name}" value="([0-9a-f-]+)"', page)[1] for page in pages]
        assert tokens[0] != tokens[1]


def test_completion_posted_twice_with_one_token_creates_one_run(ada, no_enqueue):
    token = str(uuid.uuid4())
    first = complete(ada, submit_token=token)
    second = complete(ada, submit_token=token)
    run = Run.objects.get()
    for response in (first, second):
        assert f'data-run-id="{run.id}"' in response.content.decode()
    # The answer gives the form on the page a new token for its next deliberate submission.
    fresh = re.search(
        r'id="id_submit_token" value="([0-9a-f-]+)" hx-swap-oob="true"', first.content.decode()
    )
    assert fresh and fresh[1] != token


def test_plain_completion_posted_twice_with_one_token_redirects_to_one_run(ada, no_enqueue):
    token = str(uuid.uuid4())
    locations = [complete(ada, headers={}, submit_token=token)["Location"] for _ in "12"]
    run = Run.objects.get()
    assert locations == [reverse("playground:run_detail", args=[run.id])] * 2


def test_a_new_token_is_a_new_run(ada, no_enqueue):
    complete(ada, submit_token=str(uuid.uuid4()))
    complete(ada, submit_token=str(uuid.uuid4()))
    assert Run.objects.count() == 2


def test_steering_posted_twice_with_one_token_creates_one_group(ada, vector, no_enqueue):
    token = str(uuid.uuid4())
    responses = [steer(ada, vector, submit_token=token) for _ in range(2)]
    runs = Run.objects.all()
    assert runs.count() == 2 and len({run.group for run in runs}) == 1
    for response in responses:
        assert str(runs[0].group) in response.content.decode()


def test_contrast_posted_twice_with_one_token_creates_one_pair(ada, no_enqueue):
    token = str(uuid.uuid4())
    contrast(ada, submit_token=token)
    contrast(ada, submit_token=token)
    # One pair and its reference captures.
    assert Run.objects.filter(kind=RunKind.CONTRAST).values("group").distinct().count() == 1
    assert Run.objects.filter(kind=RunKind.CONTRAST, meta__role="positive").count() == 1


def test_another_user_with_the_same_token_gets_a_run_of_their_own(
    approved_user, other_user, no_enqueue
):
    token = uuid.uuid4()
    mine = run_create(user=approved_user, request={"prompt": "a"}, submit_token=token)
    theirs = run_create(user=other_user, request={"prompt": "b"}, submit_token=token)
    assert mine.id != theirs.id and theirs.user == other_user


@pytest.mark.django_db(transaction=True)
def test_concurrent_posts_of_one_token_create_one_run(approved_user, no_enqueue):
    token = uuid.uuid4()
    barrier = threading.Barrier(4)
    made = []

    def submit():
        try:
            barrier.wait(timeout=30)
            made.append(run_create(user=approved_user, request={"prompt": "a"}, submit_token=token))
        finally:
            connection.close()

    threads = [threading.Thread(target=submit) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(made) == 4
    assert Run.objects.count() == 1
    assert {run.id for run in made} == {Run.objects.get().id}
