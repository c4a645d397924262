"""Reads of a capture run for the vector library: its residual stream decoded, the mean over
chosen positions at one layer (what `services.steering_vector_from_capture` saves), the
default positions, and the positions a run was steered at."""

import numpy as np

from playground import captures, plots
from playground.models import Run


class CaptureError(ValueError):
    """A capture that cannot give the asked-for mean; the message names the problem."""


def steered_positions(run: Run) -> list[str] | None:
    """The positions a run's first steering vector was added at, each "index token" (the
    index alone where the run's tokens are unknown); None when it steered every position."""
    steering = run.body.steering
    positions = steering.position_indices if steering else None
    if not positions:
        return None
    prompt = ((run.tokens or {}).get("prompts") or [{}])[0]
    strings = prompt.get("strings") or []
    return [
        f"{position} {plots.visible_token(strings[position])}"
        if position < len(strings)
        else str(position)
        for position in positions
    ]


def capture_of(run: Run) -> captures.Capture:
    """The run's captured residual stream with its positions' tokens; CaptureError when it
    captured nothing."""
    if not run.response or not (run.response.get("activations") or {}).get("residual_stream"):
        raise CaptureError("This run captured no activations.")
    return captures.activations(run.body, run.response, run.tokens)


def default_positions(count: int) -> list[int]:
    """Every captured position but the first (an attention sink whose norm dwarfs the
    others'), or the only one there is."""
    return list(range(1, count)) or [0]


def capture_mean(capture: captures.Capture, *, layer: int, positions: list[int]) -> np.ndarray:
    """The mean over `positions` of the residual stream at `layer` (float32 `[hidden]`)."""
    if layer not in capture.layers:
        captured = ", ".join(str(captured) for captured in capture.layers)
        raise CaptureError(f"Layer {layer} was not captured (captured: {captured}).")
    count = capture.tensor.shape[1]
    outside = next((p for p in positions if not 0 <= p < count), None)
    if outside is not None:
        raise CaptureError(f"No position {outside}: positions run from 0 to {count - 1}.")
    rows = capture.tensor[capture.layers.index(layer)][positions]
    return rows.astype(np.float32).mean(axis=0)
