"""The steering-vector library beyond building from contrast prompts: vectors saved from a
capture run (the mean of its residual stream over chosen positions at one layer, optionally
minus another run's mean there), renamed or deleted, and the `apply_steering_vectors` entry
that adds a library vector to a request."""

import numpy as np
from django.db import transaction

from accounts.models import User
from playground import captures, plots
from playground.models import Run, SteeringVector, VectorMethod
from playground.vectors.services import steering_vector_create


class CaptureError(ValueError):
    """A capture that cannot give the asked-for mean; the message names the problem."""


def steered_positions(run: Run) -> list[str] | None:
    """The positions a run's first steering vector was added at, each "index token" (the
    index alone where the run's tokens are unknown); None when it steered every position."""
    steering = (run.request.get("apply_steering_vectors") or [{}])[0]
    positions = steering.get("position_indices")
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
    return captures.activations(run.request, run.response, run.tokens)


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


def _provenance(run: Run, capture: captures.Capture, positions: list[int]) -> dict:
    return {
        "run": str(run.pk),
        "prompt": run.prompt_preview,
        "positions": positions,
        "tokens": [capture.labels[position] for position in positions],
    }


def steering_vector_from_capture(
    *,
    user: User,
    run: Run,
    name: str,
    layer: int,
    positions: list[int],
    subtract_run: Run | None = None,
) -> SteeringVector:
    """Save the mean of `run`'s residual stream at `layer` over `positions` in the user's
    library, minus the mean of `subtract_run`'s at the same layer over its default positions
    (all but the first) when given. The vector's details record where it came from: the
    runs, the layer, the positions and their tokens."""
    capture = capture_of(run)
    vector = capture_mean(capture, layer=layer, positions=positions)
    details = {"source": _provenance(run, capture, positions), "layer": layer}
    if subtract_run is not None:
        if subtract_run.request.get("model") != run.request.get("model"):
            raise CaptureError("The run to subtract used another model.")
        subtracted = capture_of(subtract_run)
        subtracted_positions = default_positions(subtracted.tensor.shape[1])
        vector = vector - capture_mean(subtracted, layer=layer, positions=subtracted_positions)
        details["subtracted"] = _provenance(subtract_run, subtracted, subtracted_positions)
    return steering_vector_create(
        user=user,
        name=name,
        model=run.request["model"],
        layer=layer,
        method=VectorMethod.CAPTURE_MEAN,
        vector=vector,
        details=details,
    )


def steering_vector_rename(*, vector: SteeringVector, name: str) -> SteeringVector:
    vector.name = name
    vector.save(update_fields=["name"])
    return vector


def steering_vector_delete(*, vector: SteeringVector) -> None:
    """Delete the vector from the library. The runs that used it keep their request (the
    vector's values were sent in it) and are marked with its name, so their pages still say
    what steered them; the foreign key is cleared by the database (SET_NULL)."""
    with transaction.atomic():
        for run in Run.objects.filter(vector=vector).only("pk", "meta"):
            Run.objects.filter(pk=run.pk).update(
                meta={**run.meta, "vector_name": vector.name, "vector_deleted": True}
            )
        vector.delete()
