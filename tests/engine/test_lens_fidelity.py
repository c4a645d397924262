"""The logit lens and direct logit attribution that a run's page shows, computed by
`playground.lens.tables` from an upstream's raw captured rows, hold to transformers' float32 model:
forward hooks read each block's output (reference_model.py) and the model's own final norm and
lm_head turn it into logits. Here for the embedded engine; test_vllm_lens_fidelity.py runs the
same checks on vLLM-Lens.

The bounds are tests/tolerances.py's for an engine computing in bfloat16 (WIDEST) whatever the
upstream computes in: the captured rows are bfloat16 on the wire either way. A lens logprob is
a logprob like any other (WIDEST.logprob), and more: a logit is a dot product with the row,
which the bounds let be off by WIDEST.row_median of its norm, so its error grows with its size
and a token far in the tail may move further (`lens_bound`). `test_the_bounds_catch_*` shows
that a real defect falls outside.
"""

import dataclasses

import numpy as np
import pytest
import torch
from conftest import MODEL
from reference_model import cpu_description

from acs_client.codec import decode
from acs_client.protocol import in_vllm_xargs
from playground.lens import tables as lens
from tests.tolerances import WIDEST, Tolerance

N_LAYERS = 30
REQUEST = {
    "model": MODEL,
    "prompt": "The capital of France is",
    "max_tokens": 4,
    "temperature": 0,
    "ignore_eos": True,
    "logprobs": 5,
    "output_residual_stream": True,
}


@dataclasses.dataclass
class Expected:
    """The reference for one answer: its token ids, the float32 model's block outputs
    [layers, tokens, hidden] at the captured positions, and their lens (log-softmax of
    lm_head(norm(h))) [layers, tokens, vocabulary]."""

    ids: list[int]
    rows: torch.Tensor
    logprobs: np.ndarray


def expected_lens(reference, body: dict) -> Expected:
    prompt_ids = reference.tokenize(REQUEST["prompt"])
    generated = reference.token_ids(prompt_ids, body["choices"][0]["logprobs"]["tokens"])
    ids = prompt_ids + generated
    run = reference.run(ids, capture=list(range(N_LAYERS)))
    tokens = len(ids) - 1
    rows = torch.stack([torch.from_numpy(run.rows[k][:tokens]) for k in range(N_LAYERS)])
    model = reference.model
    with torch.inference_mode():
        logits = model.lm_head(model.model.norm(rows))
    return Expected(ids, rows, torch.log_softmax(logits.double(), dim=-1).numpy())


def reference_attribution(reference, rows: torch.Tensor, target: int, foil: int) -> np.ndarray:
    """Each block's contribution to logit(target) − logit(foil) at one position from the
    float32 block outputs `rows` [layers, hidden], with the model's own norm module's weight
    and epsilon and lm_head's rows."""
    norm, head = reference.model.model.norm, reference.model.lm_head
    rows = rows.double()
    deltas = rows - torch.cat([torch.zeros_like(rows[:1]), rows[:-1]])
    scale = norm.weight.double() / torch.sqrt(rows[-1].pow(2).mean() + norm.variance_epsilon)
    direction = head.weight[target].double() - head.weight[foil].double()
    return ((deltas * scale) @ direction).detach().numpy()


def reported_logprob(top: dict[str, float], token: int, ids_of) -> float:
    """A token's logprob among top logprobs keyed by token string (or "token_id:N")."""
    [value] = [logprob for string, logprob in top.items() if token in ids_of(string)]
    return value


def lens_bound(tolerance: Tolerance, reference_logprobs: np.ndarray) -> np.ndarray:
    """How far (nats) a lens logprob may be from the reference's `reference_logprobs`: the
    bound of any logprob, plus the row's relative bound times the logprob's own size. (vLLM-Lens
    on an AMX CPU: up to 0.32 nats above −10 nats, 0.72 at −25.)"""
    return tolerance.logprob + tolerance.row_median * np.abs(reference_logprobs)


def lens_problems(body: dict, reference, weights: lens.LensWeights, tolerance: Tolerance):
    """Everything in the lens and attribution of `body`'s capture that the float32 reference
    does not bear out within `tolerance` (see `lens_bound`); the attribution's shares within
    its logprob bound."""
    tensor = decode(body["activations"]["residual_stream"])
    expected = expected_lens(reference, body)
    tokens = tensor.shape[1]
    problems = []
    table = lens.lens_table(tensor, list(range(N_LAYERS)), weights)
    assert table.first == 0 and table.top_ids.shape == (N_LAYERS, tokens, lens.LENS_TOP)
    reference_at_top = np.take_along_axis(expected.logprobs, table.top_ids, axis=-1)
    off = np.abs(table.top_logprobs - reference_at_top)
    outside = (off > lens_bound(tolerance, reference_at_top)).any(axis=-1)
    problems += [
        f"layer {layer}, position {position}: top logprobs {table.top_logprobs[layer, position]}"
        f", reference {reference_at_top[layer, position]}"
        for layer, position in zip(*np.nonzero(outside), strict=True)
    ]
    best = expected.logprobs.max(axis=-1)
    missed = best - reference_at_top[:, :, 0]
    problems += [
        f"layer {layer}, position {position}: the lens's top token is {missed[layer, position]:.3f}"
        " nats below the reference's"
        for layer, position in zip(*np.nonzero(missed > lens_bound(tolerance, best)), strict=True)
    ]
    # The default target: the token that comes next at each position.
    following = np.array(expected.ids[1 : tokens + 1])
    got = lens.token_logprobs(tensor, table.log_normaliser, weights, following)
    want = expected.logprobs[:, np.arange(tokens), following]
    problems += [
        f"layer {layer}, position {position}: next token's logprob {got[layer, position]:.4f}, "
        f"reference {want[layer, position]:.4f}"
        for layer, position in zip(
            *np.nonzero(np.abs(got - want) > lens_bound(tolerance, want)), strict=True
        )
    ]
    # Its rank by layer, at every position: within the ranks the reference gives it once
    # logprobs within the bound of its own count as ties either way.
    for position in range(tokens):
        ranks = lens.token_ranks(tensor[:, position], weights, int(following[position]))
        own = want[:, position, None]
        bound = lens_bound(tolerance, own)
        lowest = 1 + (expected.logprobs[:, position] > own + bound).sum(axis=-1)
        highest = (expected.logprobs[:, position] >= own - bound).sum(axis=-1)
        problems += [
            f"position {position}, layer {layer}: rank {ranks[layer]}, reference "
            f"{lowest[layer]}–{highest[layer]}"
            for layer in np.nonzero((ranks < lowest) | (ranks > highest))[0]
        ]
    problems += attribution_problems(body, reference, weights, tensor, expected, tolerance)
    print(
        f"lens of {tokens} positions × {N_LAYERS} layers: top logprobs off by at most "
        f"{off.max():.4f} nats, the next token's by {np.abs(got - want).max():.4f}"
    )
    return problems


def attribution_problems(body, reference, weights, tensor, expected, tolerance) -> list[str]:
    """The attribution at the last position, of the last generated token against the
    reference's runner-up there: each block's share, and the sum against the logit difference
    the upstream reported (its residue)."""
    target = expected.ids[-1]
    final = expected.logprobs[-1, -1]
    foil = int(next(token for token in np.argsort(-final) if token != target))
    got = lens.direct_logit_attribution(tensor[:, -1], weights, target, foil)
    want = reference_attribution(reference, expected.rows[:, -1], target, foil)
    problems = [
        f"block {block}: {got[block]:.4f} nats, reference {want[block]:.4f}"
        for block in np.nonzero(np.abs(got - want) > tolerance.logprob)[0]
    ]
    # The definition is exact on the reference: its shares add up to its logit difference.
    reference_difference = final[target] - final[foil]
    assert want.sum() == pytest.approx(reference_difference, abs=1e-3)
    top = body["choices"][0]["logprobs"]["top_logprobs"][-1]
    measured = reported_logprob(top, target, reference.ids_of) - reported_logprob(
        top, foil, reference.ids_of
    )
    residue = measured - got.sum()
    if abs(residue) > lens.RESIDUE_BOUND:
        problems.append(
            f"residue {residue:.4f} nats (sum {got.sum():.4f}, measured {measured:.4f})"
        )
    print(
        f"attribution of {target} − {foil}: largest share off by {np.abs(got - want).max():.4f} "
        f"nats, sum {got.sum():.4f} (reference {want.sum():.4f}), residue {residue:.4f}"
    )
    return problems


def test_the_engines_lens_and_attribution_hold_to_the_float32_model(
    client, float32_reference, lens_weights
):
    response = client.post("/v1/completions", json=in_vllm_xargs(REQUEST))
    assert response.status_code == 200, response.text
    problems = lens_problems(response.json(), float32_reference, lens_weights, WIDEST)
    assert not problems, (
        f"{len(problems)} discrepancies on {cpu_description()} (bounds: {WIDEST}):\n"
        + "\n".join(problems[:20])
    )


def test_the_bounds_catch_a_lens_without_the_norms_weight(client, float32_reference, lens_weights):
    response = client.post("/v1/completions", json=in_vllm_xargs(REQUEST))
    plain = dataclasses.replace(lens_weights, norm_weight=np.ones_like(lens_weights.norm_weight))
    problems = lens_problems(response.json(), float32_reference, plain, WIDEST)
    assert any("top logprobs" in problem for problem in problems)
    assert any("next token's logprob" in problem for problem in problems)
    assert any(problem.startswith("block") for problem in problems)
