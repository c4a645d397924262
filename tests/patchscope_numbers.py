"""A Patchscope's generations (its JSON download) checked against transformers' float32 model
with a forward hook that replaces the residual stream at the target layer and inspection
position by the source state (`tests/engine/patchscope_reference.py`), for the engine
(tests/playground, tests/browser) and vLLM-Lens (tests/vllm). The source states are read by
the caller from the source run's activation download, bfloat16 as the API gives them."""

import json
import subprocess

import numpy as np

from tests.tolerances import TOLERANCES, greedy_divergence_margins
from testsupport.servers import ENGINE_PYTHON, REPO_ROOT


def source_states(download: bytes, *, layers: list[int], position: int) -> np.ndarray:
    """The source run's residual stream at `position` for each of `layers` (`[layers,
    hidden]`), from its activation download (safetensors) read by `acs_client.downloads`."""
    from acs_client.downloads import load_activations

    loaded = load_activations(download)
    [capture] = loaded.captures
    captured = loaded.metadata["layers"]
    return capture.activations[[captured.index(layer) for layer in layers], position]


def reference(document: dict, states: np.ndarray) -> dict:
    """The reference's greedy generations for each row of `document`, in the engine's
    virtualenv (the web virtualenv has no torch)."""
    spec = {
        "inspection_ids": document["inspection_ids"],
        "position": document["inspection_position"],
        "max_tokens": document["max_tokens"],
        "rows": [
            {"target_layer": row["target_layer"], "state": state.tolist()}
            for row, state in zip(document["rows"], states, strict=True)
        ],
    }
    answer = subprocess.run(
        [str(ENGINE_PYTHON), "tests/engine/patchscope_reference.py"],
        input=json.dumps(spec),
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        check=True,
        timeout=600,
    )
    return json.loads(answer.stdout)


def compare_generations(document: dict, expected: dict, compute_dtype: str) -> list[str]:
    """Check each row's greedy tokens against the reference's: equal, or equal up to a step
    where both sides' choices were a near tie (`greedy_divergence_margins` within the
    greedy bound of `compute_dtype`), after which the two continue from different tokens and
    are not compared. Returns a line per row saying which."""
    bound = TOLERANCES[compute_dtype].greedy_margin
    said = []
    for row, reference_row in zip(document["rows"], expected["rows"], strict=True):
        ours, theirs = row["token_ids"], reference_row["ids"]
        assert row["status"] == "ran", row
        assert len(ours) == document["max_tokens"], row
        step = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), None)
        if step is None:
            said.append(f"layer {row['source_layer']}: equal ({row['text']!r})")
            continue
        our_top, their_top = row["top_logprobs"][step], reference_row["top"][step]
        margins = greedy_divergence_margins(
            our_top, their_top, row["tokens"][step], _chosen(their_top)
        )
        assert max(margins) <= bound, (
            f"source layer {row['source_layer']}: step {step} chose {row['tokens'][step]!r}, "
            f"the reference {_chosen(their_top)!r}; margins {margins} beyond {bound} "
            f"({our_top} vs {their_top})"
        )
        said.append(f"layer {row['source_layer']}: near tie at step {step}, margins {margins}")
    return said


def _chosen(top: dict[str, float]) -> str:
    return max(top, key=top.get)
