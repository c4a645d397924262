"""A patching grid's numbers (the `#patching-numbers` JSON its page embeds) checked against
transformers' float32 model with forward hooks (`tests/engine/patching_reference.py`), for
the browser suite's grid on the engine and tests/vllm's on vLLM-Lens."""

import json
import subprocess
from dataclasses import dataclass, field

from testsupport.servers import ENGINE_PYTHON, REPO_ROOT

# How far a page's logprobs may sit from the float32 reference: an upstream computing in
# bfloat16 (tests/engine/test_fidelity.py, TOLERANCES: up to 0.46 nats measured for reported
# logprobs) or float32 (1e-3, plus the patch vector sent as bfloat16, relative step 2**-8 of
# clean − corrupted).
LOGPROB_TOLERANCE = {"bfloat16": 0.5, "float32": 0.02}


def reference_grid(numbers: dict) -> dict:
    """The grid from transformers' float32 model with forward hooks, in the engine's
    virtualenv (the web virtualenv has no torch)."""
    spec = {key: numbers[key] for key in ("clean_ids", "corrupted_ids", "layers", "positions")}
    spec["targets"] = [target["ids"] for target in numbers["targets"]]
    answer = subprocess.run(
        [str(ENGINE_PYTHON), "tests/engine/patching_reference.py"],
        input=json.dumps(spec),
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        check=True,
        timeout=600,
    )
    return json.loads(answer.stdout)


def metrics(scores: list[float]) -> dict[str, float]:
    """log p(target) and the logit difference from the two targets' scores."""
    return {"logprob": scores[0], "logit_diff": scores[0] - scores[1]}


@dataclass
class GridComparison:
    """The largest differences of a grid's values and effects from the reference's, and
    each cell's effect by metric: {metric: {(layer, position): effect}}."""

    value_errors: list[float] = field(default_factory=list)
    effect_errors: list[float] = field(default_factory=list)
    effects: dict = field(default_factory=lambda: {"logprob": {}, "logit_diff": {}})

    def describe(self) -> str:
        return (
            f"max |Δ value| {max(self.value_errors):.4f} nats, "
            f"max |Δ effect| {max(self.effect_errors):.4f}"
        )


def compare_grid(numbers: dict, reference: dict, tolerance: float) -> GridComparison:
    """Check every baseline and cell of `numbers` against `reference` within `tolerance` per
    logprob (twice that for the logit difference, a difference of two), and each cell's
    effect within what dividing such differences by the clean − corrupted gap allows."""
    clean, corrupted = metrics(reference["clean"]), metrics(reference["corrupted"])
    assert clean["logprob"] - corrupted["logprob"] > 3, "the prompts must differ in the target"
    assert clean["logit_diff"] - corrupted["logit_diff"] > 3
    found = GridComparison()
    for metric, bound in (("logprob", tolerance), ("logit_diff", 2 * tolerance)):
        summary = numbers["metrics"][metric]
        assert abs(summary["clean"] - clean[metric]) <= bound, metric
        assert abs(summary["corrupted"] - corrupted[metric]) <= bound, metric
        gap = clean[metric] - corrupted[metric]
        for record in (r for r in numbers["runs"] if r["role"] == "cell"):
            where = (metric, record["layer"], record["position"])
            value = metrics(reference["cells"][f"{record['layer']},{record['position']}"])[metric]
            found.value_errors.append(abs(record[metric] - value))
            assert found.value_errors[-1] <= bound, where
            effect = record[f"{metric}_effect"]
            found.effect_errors.append(abs(effect - (value - corrupted[metric]) / gap))
            # The effect divides differences of values each within `bound` by the gap.
            assert found.effect_errors[-1] <= 3 * bound / gap, where
            found.effects[metric][record["layer"], record["position"]] = effect
    return found


def assert_causal_tracing_picture(effects: dict, last_layer: int) -> None:
    """Causal tracing's picture for "The capital of France/Italy is", by either metric: in
    early and middle layers the country's position (3) carries the answer; by the last
    layer only the last position (4) can."""
    for metric, effect in effects.items():
        assert effect[0, 3] > 0.8 and effect[12, 3] > 0.8 and effect[last_layer, 3] < 0.1, metric
        assert effect[last_layer, 4] > 0.8 and effect[0, 4] < 0.2, metric
