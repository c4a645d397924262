"""A run's activation download: the harvest shards' format (`acs_client.downloads`), so that
one loader reads both: `prompt_0` (bfloat16, exactly the captured values), `tokens_0` and the
metadata (token strings, prompt and generated positions, model, request id, steering)."""

import numpy as np

from acs_client.codec import decode_bfloat16_bits
from acs_client.downloads import UNKNOWN_TOKEN_ID, capture_metadata, file_metadata
from api.jobs.storage import Tensor, safetensors_bytes
from playground import captures
from playground.models import Run


def steering_applied(run: Run) -> list[dict]:
    """The steering of the run's request, each vector described instead of its values: its
    layers, scale, norm_match, positions, and the library vector it came from."""
    applied = []
    for item in run.body.apply_steering_vectors or []:
        described = {
            "layer_indices": item.layer_indices,
            "scale": item.scale,
            "norm_match": item.norm_match,
            "position_indices": item.position_indices,
            "shape": item.activations.get("shape"),
        }
        if run.vector is not None:
            described["vector"] = vector_provenance(run.vector)
        applied.append(described)
    return applied


def vector_provenance(vector) -> dict:
    """Where a library vector came from, in words and ids."""
    return {
        "id": vector.pk,
        "name": vector.name,
        "layer": vector.layer,
        "method": vector.get_method_display(),
        "norm": vector.norm,
        "details": vector.details,
    }


def run_activations_bytes(run: Run) -> bytes:
    """The safetensors file of a succeeded run's capture (see the module's docstring)."""
    bits = decode_bfloat16_bits(run.response["activations"]["residual_stream"])
    capture = captures.activations(run.body, run.response, run.tokens)
    token_ids = [UNKNOWN_TOKEN_ID if row.token_id is None else row.token_id for row in capture.rows]
    metadata = file_metadata(
        kind="run",
        model=run.body.model,
        layers=capture.layers,
        captures=[
            capture_metadata(
                index=0,
                token_strings=[row.token for row in capture.rows],
                prompt_length=capture.prompt_length,
                request_id=run.request_id,
            )
        ],
        steering=steering_applied(run),
        run_id=str(run.id),
        hidden_size=int(bits.shape[2]),
        prompt=run.body.prompt,
        completion=run.response["choices"][0].get("text"),
    )
    tensors = {
        "prompt_0": Tensor.bfloat16(bits),
        "tokens_0": Tensor.from_array(np.asarray(token_ids, dtype=np.int32)),
    }
    return safetensors_bytes(tensors, metadata)
