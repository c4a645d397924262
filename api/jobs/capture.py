"""Capture of harvest prompts through the model's activation upstream, in two steps per batch.

A batch is tokenized by the upstream first (POST /tokenize), so the worker knows its token
counts, and so its worst-case cost, before it reserves that against the budgets; then each
prompt is sent as its token ids, so the stored `tokens_i` are exactly the positions of the
stored activations. Both calls go through `api.upstream` (round-robin URLs, circuit breaker,
the contract's error codes).
"""

import asyncio
from dataclasses import dataclass

import numpy as np

from acs_client.codec import decode_bfloat16_bits
from api import dialect, upstream
from api.errors import ApiError
from api.schemas import CAPTURE_MAX_VALUES

# A capture asks the upstream for one generated token (the capture covers the prompt's
# positions; `tokens = prompt + generated - 1`).
CAPTURE_MAX_TOKENS = 1


@dataclass
class Capture:
    """One prompt's token ids, its activations as bfloat16 bit patterns [layers, tokens,
    hidden], and the usage the upstream reported for it."""

    tokens: list[int]
    bits: np.ndarray
    prompt_tokens: int
    completion_tokens: int


async def tokenize_batch(
    model, *, prompts: list[str], layers: list[int], add_special_tokens: bool, first_index: int
) -> list[list[int]]:
    """The token ids of each prompt, checked against the context and capture limits before
    any capture is paid for. `first_index` numbers prompts in errors."""
    token_lists = await asyncio.gather(
        *(
            upstream.upstream_tokenize(model, prompt=prompt, add_special_tokens=add_special_tokens)
            for prompt in prompts
        )
    )
    for offset, tokens in enumerate(token_lists):
        _check_capturable(model, tokens=tokens, layers=layers, index=first_index + offset)
    return token_lists


def _check_capturable(model, *, tokens: list[int], layers: list[int], index: int) -> None:
    if len(tokens) + CAPTURE_MAX_TOKENS > model.max_model_len:
        raise ApiError(
            "context_length_exceeded",
            f"Prompt {index} has {len(tokens)} tokens; model {model.name} takes at most "
            f"{model.max_model_len - CAPTURE_MAX_TOKENS} for a capture.",
        )
    if len(layers) * len(tokens) * model.hidden_size > CAPTURE_MAX_VALUES:
        raise ApiError(
            "activation_prompt_too_long",
            f"Capturing {len(layers)} layers over the {len(tokens)} tokens of prompt {index} "
            f"exceeds the capture limit of {CAPTURE_MAX_VALUES} values; capture fewer layers "
            "or send shorter prompts.",
        )


async def capture_batch(
    model, *, token_lists: list[list[int]], layers: list[int], first_index: int, tenant: str
) -> list[Capture]:
    """The capture of each tokenized prompt, sent concurrently so the upstream can batch
    them (for `tenant`, `upstream.tenant_of` the job's account). `first_index` numbers
    prompts in errors."""
    return await asyncio.gather(
        *(
            capture_prompt(
                model, tokens=tokens, layers=layers, index=first_index + offset, tenant=tenant
            )
            for offset, tokens in enumerate(token_lists)
        )
    )


async def capture_prompt(
    model, *, tokens: list[int], layers: list[int], index: int, tenant: str
) -> Capture:
    body = dialect.capture_body(model, tokens=tokens, layers=layers, max_tokens=CAPTURE_MAX_TOKENS)
    reply = await upstream.send_completion(model.urls_for(activation=True), body, tenant=tenant)
    body = reply.body
    try:
        bits = decode_bfloat16_bits(body["activations"]["residual_stream"])
    except (KeyError, TypeError, ValueError) as error:
        raise dialect.incomplete(
            f"The upstream sent no usable capture for prompt {index}."
        ) from error
    if bits.shape != (len(layers), len(tokens), model.hidden_size):
        raise dialect.incomplete(
            f"The capture of prompt {index} has shape {list(bits.shape)}; expected "
            f"[{len(layers)}, {len(tokens)}, {model.hidden_size}].",
        )
    usage = body.get("usage")
    if isinstance(usage, dict) and "prompt_tokens" in usage:
        prompt_tokens, completion_tokens = usage["prompt_tokens"], usage.get("completion_tokens")
    else:
        # An upstream that reports no usage is charged the capture's worst case.
        prompt_tokens, completion_tokens = len(tokens), CAPTURE_MAX_TOKENS
    return Capture(
        tokens=tokens,
        bits=dialect.rows_in_request_order(bits, layers),
        prompt_tokens=int(prompt_tokens or 0),
        completion_tokens=int(completion_tokens or 0),
    )
