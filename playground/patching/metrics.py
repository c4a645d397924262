"""The numbers of an activation patching grid, as pure functions of the stored /v1 answers.

Every scoring request of a grid sends, as its prompts, the prompt followed by each target's
tokens (token ids, teacher-forced) with `prompt_logprobs: 0`, so the entry at position
P + j of a choice's prompt_logprobs holds the logprob of target token j after the prompt and
the target tokens before it, from the full distribution however unlikely the token is. A
target's score is the sum of its tokens' logprobs: log p(target | prompt), in nats.

Metrics (both in nats):

- `logprob`: log p(target | prompt);
- `logit_diff`: log p(target | prompt) − log p(corrupted target | prompt). For one-token
  targets both logprobs come from the same next-token distribution and share its
  normaliser, so this is logit(target) − logit(corrupted target) at the last prompt
  position; for longer targets it is the difference of the two sums (the log-odds of the two
  continuations).

The normalised effect of a cell is (patched − corrupted) / (clean − corrupted) of the metric.
The noise floor is the range (max − min) of the metric over repeats of the same unpatched
corrupted request sent among the grid's requests: what batching alone moves a number by
(bfloat16 kernels round differently with the batch's shape).
"""

import statistics

METRICS = {
    "logprob": "log p(target)",
    "logit_diff": "logit difference, target − corrupted target",
}
# How each metric is defined, in words, for the grid's legend and its downloads.
METRIC_DEFINITIONS = {
    "logprob": (
        "log p(target | prompt) in nats: the sum of the target's token logprobs, each after "
        "the prompt and the target tokens before it (teacher-forced)"
    ),
    "logit_diff": (
        "log p(target | prompt) − log p(corrupted target | prompt) in nats; for one-token "
        "targets the two logprobs share the last position's normaliser, so this is "
        "logit(target) − logit(corrupted target) there; for longer targets the difference "
        "of the sums of their token logprobs"
    ),
}
# |clean − corrupted| below this many nats leaves nothing to restore: no normalised effect.
MIN_METRIC_GAP = 1e-3


def target_scores(response: dict, prompt_length: int, targets: list[list[int]]) -> list[float]:
    """The score (summed token logprobs, nats) of target i in choice i of a scoring answer
    whose prompt i was the prompt (`prompt_length` tokens) followed by `targets[i]`; as many
    as the answer has choices (a capture scored the first target only)."""
    choices = sorted(response["choices"], key=lambda choice: choice["index"])
    return [
        sum(
            choice["prompt_logprobs"][prompt_length + j][str(token)]["logprob"]
            for j, token in enumerate(target)
        )
        for choice, target in zip(choices, targets, strict=False)
    ]


def metric_value(scores: list[float], metric: str) -> float | None:
    """The `metric` (see METRICS) from a request's target scores; None when the request did
    not score what it needs."""
    if metric == "logprob":
        return scores[0] if scores else None
    return scores[0] - scores[1] if len(scores) > 1 else None


def normalised_effect(patched: float | None, clean: float | None, corrupted: float | None):
    """(patched − corrupted) / (clean − corrupted), None where a value is missing or clean and
    corrupted are too close for the ratio to mean anything."""
    if patched is None or clean is None or corrupted is None:
        return None
    if abs(clean - corrupted) < MIN_METRIC_GAP:
        return None
    return (patched - corrupted) / (clean - corrupted)


def baseline(values: list[float]) -> float | None:
    """The corrupted baseline: the mean of the repeats' values (None without any)."""
    return statistics.fmean(values) if values else None


def noise_floor(values: list[float]) -> float | None:
    """The range of the metric over identical requests (None with fewer than two)."""
    return max(values) - min(values) if len(values) > 1 else None


def within_floor(value: float | None, corrupted: float | None, floor: float | None) -> bool:
    """Whether a patched value differs from the corrupted baseline by no more than identical
    requests differ from each other."""
    if value is None or corrupted is None or floor is None:
        return False
    return abs(value - corrupted) <= floor


# Diverging colours, light at the ends so the dark number on every cell stays readable:
# blue for −1 (patching moves the metric further from the clean one), white for 0, red for 1.
EFFECT_COLOURS = ((-1.0, (103, 169, 207)), (0.0, (255, 255, 255)), (1.0, (239, 138, 98)))
NO_EFFECT_COLOUR = "#e5e5e5"


def effect_colour(effect: float | None) -> str:
    """The cell's background: the effect clipped to [−1, 1] on EFFECT_COLOURS; grey when
    there is none."""
    if effect is None:
        return NO_EFFECT_COLOUR
    value = max(-1.0, min(1.0, effect))
    (low, low_rgb), (high, high_rgb) = EFFECT_COLOURS[:2] if value < 0 else EFFECT_COLOURS[1:]
    share = (value - low) / (high - low)
    rgb = [round(a + (b - a) * share) for a, b in zip(low_rgb, high_rgb, strict=True)]
    return "#" + "".join(f"{channel:02x}" for channel in rgb)
