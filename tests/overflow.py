"""Steering that overflows the residual stream, and a JSON reader that refuses what that used
to put in responses (NaN, ±Infinity), for the engine, gateway, job and playground suites
(plain Python + numpy, importable from both virtualenvs)."""

import json

import numpy as np

from acs_client.codec import encode_vector

# bfloat16's largest values are ~3.4e38: these are finite, and their product overflows.
OVERFLOW_VALUE = 3e38
OVERFLOW_SCALE = 1e30


def overflowing_steering(hidden_size: int, *, layer: int = 3, **spec) -> list[dict]:
    """`apply_steering_vectors` of one finite vector whose values times its scale overflow
    bfloat16 and float32 (the model's logits then come out NaN)."""
    vector = np.full((1, hidden_size), OVERFLOW_VALUE, dtype=np.float32)
    return [
        {
            "activations": encode_vector(vector),
            "layer_indices": [layer],
            "scale": OVERFLOW_SCALE,
            **spec,
        }
    ]


def _refuse(constant: str):
    raise AssertionError(f"{constant} in a response body is not JSON")


def strict_json(text: str | bytes):
    """json.loads that fails on NaN and ±Infinity, as every JSON parser but Python's does."""
    return json.loads(text, parse_constant=_refuse)


def sse_payloads(text: str) -> list:
    """The decoded `data:` payloads of an SSE body (strictly), `[DONE]` as the string."""
    payloads = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            payloads.append(data if data == "[DONE]" else strict_json(data))
    return payloads
