"""Every number the comparison page draws, recomputed with numpy from the raw /v1 responses
(the two runs' and the two teacher-forced requests'), never with `playground.compare`,
`figures` or `scoring`. The runs and the scoring go through the real path: the worker (in this
process) calls the live gateway in front of the real embedded engine, a recording transport
keeps every raw request and answer."""

import difflib
import functools
import re

import numpy as np
import pytest
from django.urls import reverse

from acs_client.client import AcsClient
from acs_client.codec import encode_vector
from infra.lifecycle import WorkStatus
from playground.compare import services as compare
from tests.tolerances import WIDEST

from . import test_figure_numbers
from .test_figure_numbers import (
    MODEL,
    PROMPT,
    close,
    embedded,
    prompt_pieces,
    residual_stream,
    run_through,
    sampled_ids,
)

pytestmark = pytest.mark.django_db(transaction=True)

STEERED_LAYER = 6
# The live engine and gateway with a recording transport, and a logged-in client.
science = test_figure_numbers.science
page_client = test_figure_numbers.page_client


@pytest.fixture
def recorder(science, monkeypatch):
    recorder, tokenizer = science
    monkeypatch.setattr(
        "playground.compare.services.AcsClient", functools.partial(AcsClient, transport=recorder)
    )
    return recorder, tokenizer


def test_comparison_numbers_match_numpy_from_the_raw_answers(recorder, approved_user, page_client):
    recorder, tokenizer = recorder
    plain = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "logprobs": 2,
             "output_residual_stream": True}  # fmt: skip
    vector = np.random.default_rng(0).standard_normal((1, 576)).astype(np.float32) * 2
    steered = {
        **plain,
        "apply_steering_vectors": [
            {"activations": encode_vector(vector), "layer_indices": [STEERED_LAYER], "scale": 8.0}
        ],
    }
    run_a, run_b = run_through(approved_user, plain), run_through(approved_user, steered)
    raw_a, raw_b = recorder.answer_to(plain), recorder.answer_to(steered)
    assert raw_a["choices"][0]["text"] != raw_b["choices"][0]["text"]
    comparison = compare.comparison_queue(user=approved_user, run_a=run_a, run_b=run_b)
    comparison = compare.comparison_execute(comparison_id=comparison.pk)
    assert comparison.status == WorkStatus.SUCCEEDED, comparison.error_message

    prompt_ids, _ = prompt_pieces(tokenizer, PROMPT)
    ids = {
        "a": prompt_ids + sampled_ids(tokenizer, raw_a),
        "b": prompt_ids + sampled_ids(tokenizer, raw_b),
    }
    scoring = [
        (sent, answer)
        for sent, answer in recorder.exchanges
        if sent["prompt"] == [ids["a"], ids["b"]] and sent["prompt_logprobs"] == 0
    ]
    assert len(scoring) == 2
    under = {
        "a" if "apply_steering_vectors" not in sent else "b": answer for sent, answer in scoring
    }
    assert [sent.get("apply_steering_vectors") for sent, _ in scoring].count(
        steered["apply_steering_vectors"]
    ) == 1

    def logprobs(answer, index, side):
        entries = answer["choices"][index]["prompt_logprobs"]
        return np.asarray([entries[p][str(t)]["logprob"] for p, t in enumerate(ids[side]) if p])

    page = page_client.get(
        reverse("playground:compare") + f"?a={run_a.id}&b={run_b.id}"
    ).content.decode()
    figures = embedded(page)
    assert "data-same-settings" not in page
    assert "the mean of Δ logprob over the generated tokens only" in page
    for index, side in enumerate(("a", "b")):
        delta = logprobs(under["b"], index, side) - logprobs(under["a"], index, side)
        [bars] = figures[f"logprob-{side}"]["data"]
        assert bars["x"] == list(range(1, len(ids[side])))
        assert close(bars["y"], delta, 1e-9)
        # The mean over the generated tokens only (positions from the prompt's length on),
        # as the steering page's.
        assert f"{delta[len(prompt_ids) - 1 :].mean():.3f} nats/token" in page
        assert figures[f"logprob-{side}"]["layout"]["xaxis"]["ticktext"][0] == "1 ·quick"
    # The unsteered model scores the plain run's own tokens as the run reported them, within
    # twice the bfloat16 bound: a batch of two prompts against one sequence decoded alone,
    # each within one bound of the float32 model.
    reported = raw_a["choices"][0]["logprobs"]["token_logprobs"]
    scored = logprobs(under["a"], 0, "a")[-len(reported) :]
    assert np.allclose(scored, reported, atol=2 * WIDEST.logprob)

    # Activations: the norm of the difference at every layer × aligned position.
    capture_a, capture_b = residual_stream(raw_a), residual_stream(raw_b)
    count = min(capture_a.shape[1], capture_b.shape[1])
    norms = np.linalg.norm(capture_a[:, :count] - capture_b[:, :count], axis=-1)
    [heatmap] = figures["activation-difference"]["data"]
    assert heatmap["y"] == [str(layer) for layer in range(capture_a.shape[0])]
    assert close(heatmap["z"], norms, 1e-4)
    # Steering at block 6 leaves the blocks before it untouched on the shared prompt.
    assert np.all(norms[:STEERED_LAYER, : len(prompt_ids)] == 0)
    assert np.all(norms[STEERED_LAYER:, 1 : len(prompt_ids)] > 0)

    # The diff: highlighted are the tokens in no block difflib matches between the raw ids;
    # the shared prompt is one such block.
    blocks = difflib.SequenceMatcher(None, ids["a"], ids["b"], autojunk=False).get_matching_blocks()
    for index, side in enumerate(("a", "b")):
        shared = {p for block in blocks for p in range(block[index], block[index] + block.size)}
        expected = [p for p in range(len(ids[side])) if p not in shared]
        block = re.search(rf'data-diff-side="{side}">(.*?)</pre>', page, re.S).group(1)
        changed = [int(p) for p in re.findall(r'class="tok changed" title="position (\d+)', block)]
        assert changed == expected and min(changed) >= len(prompt_ids)
