"""Reads of a comparison of two runs: the scoring already asked for, and why one cannot be."""

from playground.compare.differences import run_sequence
from playground.models import Run, RunComparison


def comparison_for_runs(*, run_a: Run, run_b: Run) -> RunComparison | None:
    return RunComparison.objects.filter(run_a=run_a, run_b=run_b).first()


def scoring_unavailable_reason(run_a: Run, run_b: Run) -> str:
    """Why the two runs cannot be scored on each other's tokens ("" when they can)."""
    for side, run in (("A", run_a), ("B", run_b)):
        if run_sequence(run) is None:
            return f"Run {side} has no known tokens (it failed, or its tokenizer was unreachable)."
    if run_a.body.model != run_b.body.model:
        return (
            f"The runs used different models ({run_a.body.model}, {run_b.body.model}): "
            "one model's tokens mean nothing to the other."
        )
    return ""
