"""The upstream dialect: what the gateway sends an upstream for a valid public request, and
the public answer it makes of the reply. Upstreams speak vLLM-Lens's dialect (the embedded
engine takes exactly the same), and where vLLM-Lens and the engine behave differently the
public behaviour is one:

- capture and steering travel inside `vllm_xargs` (`acs_client.protocol.in_vllm_xargs`): vLLM
  ignores them at the top level without an error;
- capture layers are sent in ascending order, the order vLLM-Lens returns them in, and the
  rows are put back in the request's order;
- a 2-D vector with `position_indices` is sent as the 3-D vector it means (one row per
  position): vLLM-Lens ignores the positions of a 2-D vector and adds it everywhere;
- an answer without the capture the request asked for is 502 `capture_incomplete` (the
  caller bills no activation request for it);
- an answer carries the contract's fields only (`public_fields`);
- `text_offset` maps each token into `text` (`public_offsets`): vLLM counts a generated
  special token at its full length though `text` leaves it out;
- a seed is sent hashed (`upstream_seed`): vLLM's samples of neighbouring seeds overlap;
- a steered request of several sequences is sent one sequence per request (`api.fanout`):
  vLLM-Lens steers only a request's first sequence.

Validation refuses what no upstream can do alike (`api.validation`: greedy n > 1, steering
by position outside the prompt or at position 0 of a generating request, steering whose
values times scale could overflow).
"""

import numpy as np

from acs_client.codec import (
    b64decode_data,
    check_frame_size,
    check_header,
    decode_bfloat16_bits,
    encode_bfloat16_bits,
)
from acs_client.protocol import in_vllm_xargs

from .errors import ApiError


def upstream_body(valid, *, max_tokens: int) -> dict:
    """The body to send the upstream for `valid` (an `api.validation.ValidCompletion`),
    generating at most `max_tokens` (the budget may have lowered it)."""
    body = {**valid.payload, "model": valid.model.upstream_model_name, "max_tokens": max_tokens}
    if valid.request.seed is not None:
        body["seed"] = upstream_seed(valid.request.seed)
    if valid.request.stream:
        # The gateway always needs the final usage to settle the budget.
        body["stream_options"] = {"include_usage": True}
    if valid.capture_layers is not None:
        body["output_residual_stream"] = sorted(valid.capture_layers)
    steering = valid.payload.get("apply_steering_vectors")
    if steering:
        body["apply_steering_vectors"] = [_positioned(vector) for vector in steering]
    return in_vllm_xargs(body)


# 2**64 / the golden ratio, and the two multipliers of splitmix64's finaliser.
_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_WORD = 2**64 - 1


def upstream_seed(seed: int) -> int:
    """The seed sent upstream for the public `seed`: splitmix64's hash of it, below 2**62.
    vLLM draws sample j of a request with n > 1 with seed + j, so that public seeds s and s + 1
    would share all but one of their samples; hashed, neighbouring seeds are far apart and
    their samples independent on every upstream (the engine's too). Below 2**62, seed + j
    stays a signed 64-bit integer, as vLLM requires."""
    z = (seed + _GOLDEN) & _WORD
    z = ((z ^ (z >> 30)) * _MIX1) & _WORD
    z = ((z ^ (z >> 27)) * _MIX2) & _WORD
    return (z ^ (z >> 31)) >> 2


def capture_body(model, *, tokens: list[int], layers: list[int], max_tokens: int) -> dict:
    """The upstream body of a greedy capture of `layers` over the token ids `tokens` (a
    harvest prompt, the registry's probe)."""
    body = {"model": model.upstream_model_name, "prompt": tokens, "max_tokens": max_tokens}
    return in_vllm_xargs({**body, "temperature": 0, "output_residual_stream": sorted(layers)})


def _positioned(vector: dict) -> dict:
    """A steering vector as sent upstream: a 2-D one with positions becomes 3-D."""
    positions = vector.get("position_indices")
    if positions is None or len(vector["activations"]["shape"]) != 2:
        return vector
    rows = decode_bfloat16_bits(vector["activations"])
    per_position = np.repeat(rows[:, np.newaxis, :], len(positions), axis=1)
    return {**vector, "activations": encode_bfloat16_bits(per_position)}


# The contract's fields (acs_client.responses): vLLM adds its own (`system_fingerprint`,
# `kv_transfer_params`, `metrics`, per choice `routed_experts`, and `token_ids`,
# `prompt_token_ids` and `prompt_logprobs` nobody asked for), which the engine has not.
ANSWER_FIELDS = ("id", "object", "created", "model", "choices", "usage", "activations")
CHOICE_FIELDS = ("index", "text", "logprobs", "finish_reason", "stop_reason")
USAGE_FIELDS = ("prompt_tokens", "completion_tokens", "total_tokens")


def public_answer(body: dict, valid) -> bool:
    """Make the upstream's completion `body` the public answer to `valid`, in place: only the
    contract's fields; raise ApiError `capture_incomplete` where it lacks the capture asked
    for; return whether `body` changed (the upstream's bytes can be relayed as they are
    otherwise)."""
    changed = public_fields(body, valid, chunk=False)
    if valid.capture_layers is None:
        return changed
    return _public_capture(body, valid.capture_layers, valid.model.hidden_size) or changed


def public_fields(body: dict, valid, *, chunk: bool) -> bool:
    """Keep in `body` (an answer, or a stream `chunk`) only the contract's fields for the
    request of `valid`, in place: each choice's prompt logprobs only where asked (a whole
    answer always has the key), its token ids only with `return_token_ids`, its text offsets
    into its text (`public_offsets`). Returns whether `body` changed."""
    request = valid.request
    wanted = list(CHOICE_FIELDS)
    if request.prompt_logprobs is not None or not chunk:
        wanted.append("prompt_logprobs")
    if request.return_token_ids:
        wanted += ["prompt_token_ids", "token_ids"]
    changed = _keep(body, ANSWER_FIELDS)
    if isinstance(body.get("usage"), dict):
        changed = _keep(body["usage"], USAGE_FIELDS) or changed
    for choice in body.get("choices") or ():
        changed = _keep(choice, wanted) or changed
        if request.prompt_logprobs is None and choice.get("prompt_logprobs") is not None:
            choice["prompt_logprobs"] = None
            changed = True
        if request.logprobs is not None:
            changed = public_offsets(choice, valid.special_tokens) or changed
    return changed


def public_offsets(choice: dict, special_tokens: frozenset[str]) -> bool:
    """Make the `text_offset` of `choice` (an answer's, or a stream chunk's, whose offsets
    count from the start of the whole text) the position of each token in its text, in
    place: the first token where the upstream put it, each next one after the previous
    token's string, a special token that the text leaves out taking no room. Returns whether
    the offsets changed."""
    logprobs = choice.get("logprobs")
    if not isinstance(logprobs, dict):
        return False
    tokens, offsets = logprobs.get("tokens"), logprobs.get("text_offset")
    if not tokens or not offsets or len(tokens) != len(offsets):
        return False
    text, start = choice.get("text") or "", offsets[0]
    mapped = [start]
    for token in tokens[:-1]:
        at = mapped[-1]
        left_out = token in special_tokens and not text.startswith(token, at - start)
        mapped.append(at if left_out else at + len(token))
    if mapped == offsets:
        return False
    logprobs["text_offset"] = mapped
    return True


def _keep(fields: dict, names) -> bool:
    extra = [name for name in fields if name not in names]
    for name in extra:
        del fields[name]
    return bool(extra)


def _public_capture(body: dict, layers: list[int], hidden_size: int) -> bool:
    """Check the capture in `body` against the request's `layers` and the tokens the upstream
    reports, and put its layers back in the request's order. Raises capture_incomplete."""
    activations = body.get("activations")
    capture = activations.get("residual_stream") if isinstance(activations, dict) else None
    if capture is None:
        raise incomplete(
            "The upstream answered without the capture it was asked for; its operator should "
            "check that it runs the vLLM-Lens plugin."
        )
    usage = body.get("usage") if isinstance(body.get("usage"), dict) else {}
    tokens = int(usage.get("prompt_tokens") or 0) + int(usage.get("completion_tokens") or 0) - 1
    expected = (len(layers), tokens, hidden_size)
    try:
        shape = check_header(capture)
        check_frame_size(b64decode_data(capture.get("data")), shape)
    except ValueError as error:
        raise incomplete(f"The upstream sent no usable capture: {error}.") from None
    if shape != expected:
        raise incomplete(
            f"The upstream's capture has shape {list(shape)}; the request needs "
            f"{list(expected)} (layers, prompt + generated tokens - 1, hidden)."
        )
    changed = set(activations) != {"residual_stream"}
    body["activations"] = {"residual_stream": capture}
    if layers != sorted(layers):
        body["activations"]["residual_stream"] = in_request_order(capture, layers)
        changed = True
    return changed


def in_request_order(capture: dict, layers: list[int]) -> dict:
    """A capture whose rows are `sorted(layers)` (as upstreams send them), its rows reordered
    to `layers`."""
    return encode_bfloat16_bits(rows_in_request_order(decode_bfloat16_bits(capture), layers))


def rows_in_request_order(rows: np.ndarray, layers: list[int]) -> np.ndarray:
    """Rows of `sorted(layers)`, in the order of `layers`."""
    ascending = sorted(layers)
    return rows[[ascending.index(layer) for layer in layers]]


def incomplete(message: str) -> ApiError:
    return ApiError("capture_incomplete", message)
