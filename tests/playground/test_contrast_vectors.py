"""A contrast vector comes from the positions after the first (issue 37, item 5): position 0
is an attention sink whose residual stream is several times the typical norm whatever its
token, so a one-token prompt ("Love") is refused with a field error naming its token (it
built a vector from the sink's row), and the mean method leaves position 0 out. Checked with
numpy on the stored captures."""

import httpx
import numpy as np
import pytest
from django.urls import reverse

from acs_client.codec import decode, encode_vector
from playground.models import Run, RunKind
from playground.runs import views
from playground.runs.execution import run_execute
from playground.vectors import forms as vector_forms
from playground.vectors.services import contrast_runs_create

from .conftest import HTMX, MODEL
from .test_patching import word_tokens

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def stand_ins(monkeypatch):
    monkeypatch.setattr(views, "model_cards", lambda: [MODEL])
    monkeypatch.setattr(
        vector_forms, "tokenize", lambda model_id, texts: [word_tokens(t, s) for t, s in texts]
    )


def contrast(client, headers, **fields):
    data = {
        "contrast-name": "love", "contrast-layer": 12, "contrast-positive": "Love",
        "contrast-negative": "I hate", "contrast-method": "contrast_last",
    }  # fmt: skip
    data.update({f"contrast-{name}": value for name, value in fields.items()})
    return client.post(reverse("playground:vector_contrast"), data, **headers)


ONE_TOKEN = (
    "This prompt is one token, ‘Love’: its only position is 0, the attention sink, so the "
    "vector would be the sink&#x27;s"
)


@pytest.mark.parametrize("headers", [{}, HTMX], ids=["plain", "htmx"])
def test_a_one_token_prompt_is_a_field_error_naming_its_token(ada, no_enqueue, headers):
    response = contrast(ada, headers)
    html = response.content.decode()
    assert response.status_code == (200 if headers else 400)
    assert ONE_TOKEN in html and "Put a word before it" in html
    assert ("<html" in html) != bool(headers)
    assert not Run.objects.exists()


@pytest.mark.parametrize(
    ("method", "expected"),
    [
        ("contrast_last", lambda positive, negative: positive[-1] - negative[-1]),
        ("contrast_mean", lambda positive, negative: positive[1:].mean(0) - negative[1:].mean(0)),
    ],
)
def test_the_vector_leaves_the_first_position_out(
    approved_user, gateway, no_enqueue, method, expected
):
    """The captures' row 0 is 60 times the others', as an attention sink's is: the vector is
    computed from the rows after it only."""
    generator = np.random.default_rng(3)
    captures = {}
    for role in ("positive", "negative"):
        rows = generator.normal(size=(1, 4, 576)).astype(np.float32)
        rows[0, 0] *= 60
        captures[role] = rows
    group = contrast_runs_create(
        user=approved_user, model="smollm2-135m", name="love", layer=12, method=method,
        positive="I love it", negative="I hate it",
    )  # fmt: skip
    for run in Run.objects.filter(group=group, kind=RunKind.CONTRAST):
        rows = captures.get(run.meta["role"], captures["positive"])
        answer = {"choices": [{"index": 0, "text": "x"}], "usage": {"prompt_tokens": 4},
                  "activations": {"residual_stream": encode_vector(rows)}}  # fmt: skip
        gateway.handler = lambda request, answer=answer: httpx.Response(200, json=answer)
        run_execute(run_id=run.id)
    vector = approved_user.steering_vectors.get()
    sent = {role: decode(encode_vector(rows))[0] for role, rows in captures.items()}
    want = expected(sent["positive"].astype(np.float64), sent["negative"].astype(np.float64))
    np.testing.assert_allclose(decode(vector.data), want, rtol=1e-2, atol=1e-2)
    assert vector.norm == pytest.approx(float(np.linalg.norm(want)), rel=1e-3)
    # Against the sink's difference, which the old mean took in: far larger.
    with_sink = sent["positive"].mean(0) - sent["negative"].mean(0)
    assert np.linalg.norm(with_sink) > 3 * np.linalg.norm(want)
