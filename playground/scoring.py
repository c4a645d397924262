"""Two models compared on the same tokens (pure functions of /v1 requests and responses).

A completion's own logprobs score the tokens *that* model sampled, so two runs that diverge
score different texts. To compare a steered model with its baseline, each scores the other's
tokens: a teacher-forced request sends prompt + completion as the prompt (as token ids, so
the scored tokens are exactly the sampled ones) with `prompt_logprobs`, and the entry at
position P + j of its prompt_logprobs is the logprob of the completion's token j.

Units are nats (natural-log probabilities). Δ logprob = log p_steered(token) −
log p_baseline(token): negative where steering made the token less likely. KL(baseline ‖
steered) at a position = Σ_v p_baseline(v) (log p_baseline(v) − log p_steered(v)), over the
whole vocabulary (from `prompt_logprobs: -1`): the extra nats per token the steered model
needs to encode text the baseline would write; 0 when the two distributions agree.
"""

import numpy as np

from acs_client.protocol import XARGS_STEERING
from playground.models import StoredRequest


def teacher_forced_request(
    request: StoredRequest, token_ids: list[int], *, full_vocabulary: bool, steered: bool
) -> dict:
    """The request that scores `token_ids` (prompt then completion) under the model of the
    run `request` came from: the same model and, when `steered`, the same steering; one
    generated token, greedy; `prompt_logprobs` -1 (the full distribution at every position)
    or 0 (the actual token's logprob only)."""
    body = {
        "model": request.model,
        "prompt": list(token_ids),
        "max_tokens": 1,
        "temperature": 0,
        "prompt_logprobs": -1 if full_vocabulary else 0,
    }
    if steered and request.steering:
        body[XARGS_STEERING] = request.steering_body()
    return body


def scored_logprobs(prompt_logprobs: list, token_ids: list[int], first: int) -> np.ndarray:
    """The logprob of `token_ids[j]` at position `first + j` of a choice's prompt_logprobs
    (the contract always lists the actual token), in nats."""
    return np.asarray(
        [
            prompt_logprobs[first + j][str(token_id)]["logprob"]
            for j, token_id in enumerate(token_ids)
        ],
        dtype=np.float64,
    )


def full_distributions(prompt_logprobs: list, first: int, count: int) -> np.ndarray:
    """The log-probabilities `[count, vocabulary]` at positions `first..first+count-1` of a
    choice's full-vocabulary prompt_logprobs (`prompt_logprobs: -1`), by token id."""
    entries = prompt_logprobs[first : first + count]
    size = 1 + max(int(token_id) for entry in entries for token_id in entry)
    rows = np.full((count, size), -np.inf, dtype=np.float64)
    for row, entry in enumerate(entries):
        ids = np.fromiter((int(token_id) for token_id in entry), dtype=np.int64)
        rows[row, ids] = [item["logprob"] for item in entry.values()]
    return rows


def kl_divergence(p_logprobs: np.ndarray, q_logprobs: np.ndarray) -> np.ndarray:
    """KL(p ‖ q) in nats per row of two `[positions, vocabulary]` log-probability arrays."""
    p = np.exp(p_logprobs)
    # Where p is 0 the term is 0, whatever q is.
    terms = np.where(p > 0, p * (p_logprobs - q_logprobs), 0.0)
    return terms.sum(axis=-1)


def delta_logprobs(under_steered: np.ndarray, under_baseline: np.ndarray) -> np.ndarray:
    """Δ logprob (nats) of the same tokens: steered minus baseline."""
    return np.asarray(under_steered) - np.asarray(under_baseline)


# One definition of the mean Δ logprob wherever a page shows one (the steering comparison,
# the sweep and its scrubber, two runs compared).
MEAN_DELTA_DEFINITION = (
    "mean Δ logprob: the mean of Δ logprob over the generated tokens only (the prompt's "
    "tokens are not counted), in nats per token"
)


def mean_generated_delta(deltas, positions, first_generated: int) -> float | None:
    """The mean Δ logprob (MEAN_DELTA_DEFINITION) of `deltas` at `positions`: over those
    from `first_generated` (the prompt's length) on; None when there is none."""
    generated = [
        delta for delta, at in zip(deltas, positions, strict=True) if at >= first_generated
    ]
    return float(np.mean(generated)) if generated else None
