"""Writes of the steering-vector library: uploaded vectors, vectors built from a contrast
pair's captures or saved from a capture run (a mean of its residual stream, optionally minus
another run's), renamed and deleted; and the `apply_steering_vectors` entry that adds a
library vector to a request."""

import io
import uuid

import numpy as np
from django.db import IntegrityError, transaction

from accounts.models import User
from acs_client.codec import (
    bfloat16_bits_to_float32,
    decode,
    encode_vector,
    float32_to_bfloat16_bits,
)
from acs_client.protocol import XARGS_CAPTURE
from infra.lifecycle import WorkStatus
from playground.captures import TYPICAL_NORM_DEFINITION, Capture, typical_norm
from playground.models import Run, RunKind, SteeringVector, VectorMethod
from playground.runs.services import run_enqueue, submitted_once
from playground.vectors.captures import CaptureError, capture_mean, capture_of, default_positions


class VectorError(ValueError):
    """An uploaded or built vector that cannot be used; the message names the problem."""


# The largest finite bfloat16, as which vectors are stored and sent.
BFLOAT16_MAX = float(bfloat16_bits_to_float32(np.array([0x7F7F], dtype=np.uint16))[0])


# The .npy header readers of the format versions numpy.save writes for a vector (3.0 only
# for field names beyond Latin-1, which a vector has none of).
NPY_HEADER_READERS = {
    (1, 0): np.lib.format.read_array_header_1_0,
    (2, 0): np.lib.format.read_array_header_2_0,
}


def vector_from_npy(data: bytes, *, hidden_size: int) -> np.ndarray:
    """The vector of an uploaded .npy file holding `[hidden]` or `[1, hidden]` numbers, as
    float32 `[hidden]`. The header is checked first: reading the data allocates the array the
    header claims, whatever its size, so only a shape of the model's hidden size and a numeric
    dtype (at most 16 bytes a value) get that far. Every value must be finite and fit the
    bfloat16 the vector is stored and sent as."""
    stream = io.BytesIO(data)
    not_npy = VectorError("This is not a .npy file (numpy.save format).")
    try:
        version = np.lib.format.read_magic(stream)
    except ValueError:
        raise not_npy from None
    read_header = NPY_HEADER_READERS.get(version)
    if read_header is None:
        raise VectorError(
            f"This .npy file has format version {version[0]}.{version[1]}; "
            "save the vector with numpy.save."
        )
    try:
        shape, _, dtype = read_header(stream)
    except ValueError:
        raise not_npy from None
    if not (np.issubdtype(dtype, np.floating) or np.issubdtype(dtype, np.integer)):
        raise VectorError(f"The array has dtype {dtype}; upload float values.")
    if shape not in ((hidden_size,), (1, hidden_size)):
        raise VectorError(
            f"The array has shape {list(shape)}; this model needs [{hidden_size}] "
            f"or [1, {hidden_size}]."
        )
    stream.seek(0)
    try:
        array = np.load(stream, allow_pickle=False).reshape(hidden_size)
    except ValueError:
        raise VectorError(
            f"The file holds fewer values than its header's shape {list(shape)} says."
        ) from None
    _check_storable(array)
    return array.astype(np.float32)


def _check_storable(array: np.ndarray) -> None:
    """VectorError naming the first value that is NaN or infinite, or that becomes infinite
    stored as bfloat16 (float64's 1e300, say)."""
    bad = np.flatnonzero(~np.isfinite(array))
    if bad.size:
        index = int(bad[0])
        raise VectorError(f"Value {index} is {array[index]}; every value must be finite.")
    with np.errstate(over="ignore"):  # the overflow is what is looked for
        stored = bfloat16_bits_to_float32(float32_to_bfloat16_bits(array.astype(np.float32)))
    bad = np.flatnonzero(~np.isfinite(stored))
    if bad.size:
        index = int(bad[0])
        raise VectorError(
            f"Value {index} is {array[index]:g}, beyond the ±{BFLOAT16_MAX:.4g} that bfloat16 "
            "(how vectors are stored and sent) holds."
        )


def steering_vector_create(
    *,
    user: User,
    name: str,
    model: str,
    layer: int,
    method: str,
    vector: np.ndarray,
    details: dict | None = None,
    layer_typical_norm: float | None = None,
    source_group: uuid.UUID | None = None,
) -> SteeringVector:
    """Save a `[hidden]` vector in the user's library (stored in the API's codec)."""
    return SteeringVector.objects.create(
        user=user,
        name=name,
        model=model,
        layer=layer,
        method=method,
        details=details or {},
        hidden_size=int(vector.shape[0]),
        norm=float(np.linalg.norm(vector)),
        layer_typical_norm=layer_typical_norm,
        data=encode_vector(vector),
        source_group=source_group,
    )


# The fixed reference prompts whose residual norms define a layer's typical norm: ordinary
# sentences of different kinds, so the median describes ordinary tokens at that layer.
REFERENCE_PROMPTS = (
    "The museum opens at nine in the morning and closes at five.",
    "She poured the coffee, sat down by the window and read the letter again.",
    "Rainfall in the valley was lower than usual this spring.",
    "To install the package, run the command below and restart the server.",
)


def contrast_runs_create(
    *,
    user: User,
    model: str,
    name: str,
    layer: int,
    method: str,
    positive: str,
    negative: str,
    submit_token: uuid.UUID | None = None,
) -> uuid.UUID:
    """Queue the two capture runs of a contrast vector and the captures of the reference
    prompts at the same layer (for the layer's typical norm); the vector is saved when they
    have finished (`steering_vector_from_contrast`). Returns the pair's group id (that of the
    first pair, when `submit_token` was submitted before)."""

    def capture(prompt: str) -> dict:
        return {
            "model": model,
            "prompt": prompt,
            "max_tokens": 1,
            "temperature": 0,
            XARGS_CAPTURE: [layer],
        }

    def create() -> uuid.UUID:
        group = uuid.uuid4()
        meta = {"vector_name": name, "layer": layer, "method": method}
        with transaction.atomic():
            for role, prompt in (("positive", positive), ("negative", negative)):
                run_enqueue(
                    user=user,
                    kind=RunKind.CONTRAST,
                    group=group,
                    vector=None,
                    request=capture(prompt),
                    meta={"role": role, **meta},
                    submit_token=submit_token if role == "positive" else None,
                )
            for index, prompt in enumerate(REFERENCE_PROMPTS):
                run_enqueue(
                    user=user,
                    kind=RunKind.CONTRAST,
                    group=group,
                    vector=None,
                    request=capture(prompt),
                    meta={"role": "reference", "reference": index, **meta},
                    submit_token=None,
                )
        return group

    return submitted_once(
        user=user, submit_token=submit_token, create=create, existing=lambda run: run.group
    )


def contrast_difference(positive: np.ndarray, negative: np.ndarray, *, method: str) -> np.ndarray:
    """The steering direction from two `[tokens, hidden]` captures at one layer, from the
    positions after the first: position 0 is an attention sink whose row is several times
    the typical norm whatever its token, so a difference taken there is the sink's. The last
    token is the last position; the mean is over positions 1 onwards. Each capture has two
    positions or more (`forms.ContrastVectorForm`)."""
    if method == VectorMethod.CONTRAST_MEAN:
        return positive[1:].mean(axis=0) - negative[1:].mean(axis=0)
    return positive[-1] - negative[-1]


def steering_vector_from_contrast(*, group) -> SteeringVector | None:
    """Build and save the vector of a contrast pair once both captures have succeeded and
    the reference captures have finished; idempotent (the pair's `group` is unique among
    vectors). Its typical layer norm comes from the reference captures that succeeded
    (None if none did)."""
    runs = list(Run.objects.filter(group=group))
    by_role = {run.meta.get("role"): run for run in runs}
    positive, negative = by_role.get("positive"), by_role.get("negative")
    references = [run for run in runs if run.meta.get("role") == "reference"]
    if not positive or not negative:
        return None
    if positive.status != WorkStatus.SUCCEEDED or negative.status != WorkStatus.SUCCEEDED:
        return None
    if not all(run.is_finished for run in references):
        return None
    existing = SteeringVector.objects.filter(source_group=group).first()
    if existing:
        return existing
    captures = [
        decode(run.response["activations"]["residual_stream"])[0] for run in (positive, negative)
    ]
    meta = positive.meta
    vector = contrast_difference(*captures, method=meta["method"])
    measured = [run for run in references if run.status == WorkStatus.SUCCEEDED]
    typical = None
    details = {
        "positive": positive.body.prompt,
        "negative": negative.body.prompt,
        "runs": [str(positive.id), str(negative.id)],
    }
    if measured:
        typical, positions = typical_norm(
            [decode(run.response["activations"]["residual_stream"])[0] for run in measured]
        )
        details["typical_norm"] = {
            "definition": TYPICAL_NORM_DEFINITION,
            "layer": meta["layer"],
            "prompts": [run.body.prompt for run in measured],
            "positions": positions,
            "runs": [str(run.id) for run in measured],
        }
    try:
        with transaction.atomic():
            created = steering_vector_create(
                user=positive.user,
                name=meta["vector_name"],
                model=positive.body.model,
                layer=meta["layer"],
                method=meta["method"],
                vector=vector,
                details=details,
                layer_typical_norm=typical,
                source_group=group,
            )
    except IntegrityError:
        # Another capture's worker saved it first.
        return SteeringVector.objects.get(source_group=group)
    Run.objects.filter(group=group).update(vector=created)
    return created


def steering_entry(
    vector: SteeringVector, *, layers: list[int], scale: float, positions: list[int] | None = None
) -> dict:
    """The `apply_steering_vectors` entry adding `scale` × `vector` to the outputs of blocks
    `layers`, at `positions` (None: at every position)."""
    entry = {
        "activations": steering_activations(vector, layers),
        "layer_indices": layers,
        "scale": scale,
    }
    if positions:
        entry["position_indices"] = positions
    return entry


def steering_activations(vector: SteeringVector, layers: list[int]) -> dict:
    """The vector as the codec object of an `apply_steering_vectors` entry: one row of it
    per layer in `layers` (shape [len(layers), hidden])."""
    return encode_vector(np.tile(decode(vector.data)[None, :], (len(layers), 1)))


def _provenance(run: Run, capture: Capture, positions: list[int]) -> dict:
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
        if subtract_run.body.model != run.body.model:
            raise CaptureError("The run to subtract used another model.")
        subtracted = capture_of(subtract_run)
        subtracted_positions = default_positions(subtracted.tensor.shape[1])
        vector = vector - capture_mean(subtracted, layer=layer, positions=subtracted_positions)
        details["subtracted"] = _provenance(subtract_run, subtracted, subtracted_positions)
    return steering_vector_create(
        user=user,
        name=name,
        model=run.body.model,
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
