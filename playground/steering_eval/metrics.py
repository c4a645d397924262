"""The numbers of a steering evaluation, as pure functions of the stored /v1 answers.

Every request of an evaluation sends one sequence, a dataset prompt followed by one of its
completions (the target or the foil) as token ids, with `prompt_logprobs: 1`: the entry at
position P + j holds the logprob of completion token j after the prompt and the completion
tokens before it (teacher-forced, from the full distribution however unlikely the token),
and beside it the most likely token there. A completion's score is the sum of its tokens'
logprobs, log p(completion | prompt) in nats; the top token is the rank-1 token at the first
completion position P (the model's next token after the prompt).
"""

import numpy as np

BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0
CONFIDENCE = 0.95

DEFINITIONS = {
    "target_logprob": (
        "log p(target | prompt) in nats: the sum of the target's token logprobs, each after "
        "the prompt and the target tokens before it (teacher-forced; a multi-token target "
        "is the sum over its tokens)"
    ),
    "logit_diff": (
        "log p(target | prompt) − log p(foil | prompt) in nats; for one-token completions "
        "the two share the last prompt position's normaliser, so this is logit(target) − "
        "logit(foil) there"
    ),
    "unsteered": (
        "a prompt's unsteered value: the mean over its identical unsteered requests (the repeats)"
    ),
    "delta": "steered − unsteered, per prompt, in nats",
    "mean_interval": (
        f"the mean over prompts of the change, with a bootstrap {CONFIDENCE:.0%} interval: "
        f"{BOOTSTRAP_RESAMPLES} resamples of the prompts with replacement (numpy "
        f"default_rng({BOOTSTRAP_SEED}), drawn anew for each scale and metric, prompts in "
        "row order), the 2.5th and 97.5th percentiles of the resampled means (numpy "
        "percentile, linear)"
    ),
    "noise_floor": (
        "for each prompt, the range (max − min) of the metric over its identical unsteered "
        "requests; the noise floor is the largest of these ranges over the prompts, in "
        "nats: how far batching alone moves a number. A mean change within ± the floor "
        "cannot be told from no steering"
    ),
    "flipped": (
        "the share of prompts whose top token at the first completion position, steered, is "
        "none of the top tokens of that prompt's unsteered repeats"
    ),
}


def top_token(response: dict, prompt_length: int) -> tuple[int, str]:
    """The id and text of the most likely token after the prompt (rank 1 at position
    `prompt_length`)."""
    entry = response["choices"][0]["prompt_logprobs"][prompt_length]
    token, details = min(entry.items(), key=lambda item: item[1]["rank"])
    return int(token), details.get("decoded_token") or ""


def bootstrap_interval(values: list[float]) -> tuple[float, float] | None:
    """The bootstrap 95% interval of the mean of `values` (see DEFINITIONS["mean_interval"]);
    None without values."""
    if not values:
        return None
    data = np.asarray(values, dtype=np.float64)
    generator = np.random.default_rng(BOOTSTRAP_SEED)
    picks = generator.integers(0, len(data), size=(BOOTSTRAP_RESAMPLES, len(data)))
    tail = (1 - CONFIDENCE) / 2 * 100
    low, high = np.percentile(data[picks].mean(axis=1), [tail, 100 - tail])
    return float(low), float(high)


def mean_with_interval(values: list[float]) -> dict:
    """How many values, their mean and its bootstrap interval (None where there are none)."""
    interval = bootstrap_interval(values)
    return {
        "n": len(values),
        "mean": float(np.mean(values)) if values else None,
        "ci_low": interval[0] if interval else None,
        "ci_high": interval[1] if interval else None,
    }


def value_range(values: list[float]) -> float | None:
    """max − min of a prompt's repeats (None with fewer than two)."""
    return max(values) - min(values) if len(values) > 1 else None


def noise_floor(ranges: list[float | None]) -> float | None:
    """The largest of the prompts' repeat ranges (None where none was measured)."""
    known = [value for value in ranges if value is not None]
    return max(known) if known else None


def within_floor(mean: float | None, floor: float | None) -> bool:
    """Whether a mean change is no larger than identical requests differ by."""
    return mean is not None and floor is not None and abs(mean) <= floor
