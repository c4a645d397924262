"""Capture of one harvest prompt through the model's activation upstream.

A prompt is tokenized by the upstream first (POST /tokenize) and then sent as its token ids,
so the stored `tokens_i` are exactly the positions of the stored activations. Both calls go
through `api.upstream` (round-robin URLs, circuit breaker, the contract's error codes).
"""

import asyncio

import numpy as np

from acs_client.codec import decode_bfloat16_bits
from api import upstream
from api.errors import ApiError
from api.schemas import CAPTURE_MAX_VALUES


async def capture_batch(
    model, *, prompts: list[str], layers: list[int], add_special_tokens: bool, first_index: int
) -> list[tuple[list[int], np.ndarray]]:
    """`(token_ids, bfloat16 bit patterns [layers, tokens, hidden])` for each prompt, sent
    concurrently so the upstream can batch them. `first_index` numbers prompts in errors."""
    return await asyncio.gather(
        *(
            capture_prompt(
                model,
                prompt=prompt,
                layers=layers,
                add_special_tokens=add_special_tokens,
                index=first_index + offset,
            )
            for offset, prompt in enumerate(prompts)
        )
    )


async def capture_prompt(
    model, *, prompt: str, layers: list[int], add_special_tokens: bool, index: int
) -> tuple[list[int], np.ndarray]:
    tokens = await upstream.upstream_tokenize(
        model, prompt=prompt, add_special_tokens=add_special_tokens
    )
    if len(tokens) + 1 > model.max_model_len:
        raise ApiError(
            400,
            "context_length_exceeded",
            f"Prompt {index} has {len(tokens)} tokens; model {model.name} takes at most "
            f"{model.max_model_len - 1} for a capture.",
        )
    if len(layers) * len(tokens) * model.hidden_size > CAPTURE_MAX_VALUES:
        raise ApiError(
            400,
            "activation_prompt_too_long",
            f"Capturing {len(layers)} layers over the {len(tokens)} tokens of prompt {index} "
            f"exceeds the capture limit of {CAPTURE_MAX_VALUES} values; capture fewer layers "
            "or send shorter prompts.",
        )
    body = await upstream.upstream_completion(
        model,
        {
            "prompt": tokens,
            "max_tokens": 1,
            "temperature": 0,
            "output_residual_stream": list(layers),
        },
    )
    try:
        bits = decode_bfloat16_bits(body["activations"]["residual_stream"])
    except (KeyError, TypeError, ValueError) as error:
        raise ApiError(
            502, "capture_incomplete", f"The upstream sent no usable capture for prompt {index}."
        ) from error
    if bits.shape[:2] != (len(layers), len(tokens)) or bits.shape[2] != model.hidden_size:
        raise ApiError(
            502,
            "capture_incomplete",
            f"The capture of prompt {index} has shape {list(bits.shape)}; expected "
            f"[{len(layers)}, {len(tokens)}, {model.hidden_size}].",
        )
    return tokens, bits
