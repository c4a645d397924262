"""Everything checked about a completion body before any upstream work."""

import asyncio
import math
from dataclasses import dataclass

import numpy as np

from acs_client import codec
from acs_client.protocol import (
    FULL_VOCAB_MAX_PROMPT_TOKENS,
    FULL_VOCAB_MAX_PROMPT_TOKENS_WITH_CAPTURE,
    STEERING_MAX_MAGNITUDE,
    STEERING_MAX_VALUES,
    RuleBroken,
    check_capture_request,
    check_layer_list,
    check_logprobs_limit,
    check_max_tokens_given,
    check_non_streaming_max_tokens,
    check_output_work,
    check_steering_positions,
    check_steering_shape,
)

from .errors import ApiError
from .models import LanguageModel
from .schemas import (
    CAPTURE_MAX_VALUES,
    DEFAULT_MAX_TOKENS,
    CompletionRequest,
    parse_body,
)
from .selectors import activation_upstreams_check, model_get
from .tokenizer import count_prompt_tokens, special_token_strings

SUPPORTED_CODEC = {"dtype": "int16", "compression": "zstd", "original_dtype": "torch.bfloat16"}


@dataclass
class ValidCompletion:
    """A completion body that passed every check, with what the budgets need."""

    request: CompletionRequest
    payload: dict
    model: LanguageModel
    prompt_tokens: int
    max_tokens: int
    completions: int
    capture_layers: list[int] | None
    # The model's special tokens, where the answer reports logprobs (`dialect.public_offsets`).
    special_tokens: frozenset[str] = frozenset()

    @property
    def activation(self) -> bool:
        return self.request.is_activation_request

    @property
    def urls(self) -> list[str]:
        return self.model.urls_for(activation=self.activation)


def _invalid(message: str) -> ApiError:
    return ApiError("invalid_request", message)


async def validate_completion(payload: object) -> ValidCompletion:
    """Check a decoded completion body against the contract's limits and the model registry;
    raise ApiError with the contract's code for the first problem found."""
    request = parse_body(CompletionRequest, payload)
    model = await model_get(request.model)
    prompts = request.prompts()
    _check_prompts(prompts, model)
    try:
        request.check_rules()
    except RuleBroken as error:
        raise _invalid(str(error)) from None
    try:
        check_max_tokens_given(max_tokens=request.max_tokens, prompts=len(prompts), n=request.n)
    except RuleBroken as error:
        raise _invalid(str(error)) from None
    if request.n > 1 and request.temperature == 0:
        # vLLM refuses it; the engine would return n copies of one completion.
        raise _invalid(
            f"n = {request.n} with temperature 0 (greedy sampling) would return {request.n} "
            "copies of one completion; send n: 1, or a temperature above 0."
        )
    max_tokens = request.max_tokens or DEFAULT_MAX_TOKENS
    completions = len(prompts) * request.n
    try:
        check_output_work(sequences=completions, max_tokens=max_tokens)
    except RuleBroken as error:
        raise _invalid(str(error)) from None
    try:
        check_non_streaming_max_tokens(stream=request.stream, max_tokens=max_tokens)
    except RuleBroken as error:
        raise ApiError("deadline_infeasible", str(error)) from None
    if request.stream_options is not None and not request.stream:
        raise _invalid("'stream_options' is only allowed with stream: true.")
    try:
        check_logprobs_limit(
            logprobs=request.logprobs,
            prompt_logprobs=request.prompt_logprobs,
            max_logprobs=model.max_logprobs,
        )
    except RuleBroken as error:
        raise _invalid(str(error)) from None
    if request.is_activation_request and not model.supports_activations:
        raise ApiError(
            "activation_engine_unconfigured",
            f"The model '{model.name}' serves no activations (capture or steering).",
        )
    capture_layers = request.capture_layers(model.n_layers)
    if capture_layers is not None:
        _check_capture(request, prompts, capture_layers, model)
    counts = await count_prompt_tokens(
        model, prompts, add_special_tokens=request.add_special_tokens
    )
    for index, count in enumerate(counts):
        if count + max_tokens > model.max_model_len:
            where = f"Prompt {index} has" if len(counts) > 1 else "The prompt has"
            raise ApiError(
                "context_length_exceeded",
                f"{where} {count} tokens; with max_tokens {max_tokens} that exceeds the "
                f"model's context of {model.max_model_len} tokens.",
            )
    if request.apply_steering_vectors:
        await _check_steering(request.apply_steering_vectors, model, max(counts) + max_tokens)
        _check_steering_positions(request.apply_steering_vectors, min(counts), max_tokens)
    prompt_tokens = sum(counts)
    if request.prompt_logprobs == -1:
        limit = (
            FULL_VOCAB_MAX_PROMPT_TOKENS_WITH_CAPTURE
            if capture_layers is not None
            else FULL_VOCAB_MAX_PROMPT_TOKENS
        )
        if prompt_tokens * request.n > limit:
            raise ApiError(
                "full_vocab_prompt_too_long",
                f"prompt_logprobs: -1 allows at most {limit} prompt tokens × n per request; "
                f"this request has {prompt_tokens * request.n}.",
            )
    if capture_layers is not None:
        values = len(capture_layers) * (prompt_tokens + max_tokens - 1) * model.hidden_size
        if values > CAPTURE_MAX_VALUES:
            raise ApiError(
                "activation_prompt_too_long",
                f"Capturing {len(capture_layers)} layers over {prompt_tokens + max_tokens - 1} "
                f"tokens exceeds the capture limit of {CAPTURE_MAX_VALUES} values; capture "
                "fewer layers or send a shorter prompt.",
            )
    if request.is_activation_request:
        await activation_upstreams_check(model)
    special_tokens = frozenset()
    if request.logprobs is not None:
        special_tokens = await special_token_strings(model)
    return ValidCompletion(
        request=request,
        payload=payload,
        model=model,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        completions=completions,
        capture_layers=capture_layers,
        special_tokens=special_tokens,
    )


def _check_prompts(prompts: list, model: LanguageModel) -> None:
    if not prompts:
        raise _invalid("'prompt' must not be empty.")
    for index, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise _invalid(f"'prompt' {index} is empty.")
        if isinstance(prompt, list):
            bad = next((t for t in prompt if t < 0 or t >= model.vocab_size), None)
            if bad is not None:
                raise _invalid(
                    f"Token id {bad} in 'prompt' is outside the vocabulary "
                    f"(0–{model.vocab_size - 1})."
                )


def _check_layers(field: str, layers: list[int], model: LanguageModel) -> None:
    try:
        check_layer_list(layers, n_layers=model.n_layers, field=field)
    except RuleBroken as error:
        raise _invalid(str(error)) from None


def _check_capture(request, prompts, layers, model) -> None:
    try:
        check_capture_request(prompts=len(prompts), n=request.n, stream=request.stream)
    except RuleBroken as error:
        raise _invalid(f"'output_residual_stream': {error}") from None
    _check_layers("output_residual_stream", layers, model)


async def _check_steering(vectors, model: LanguageModel, sequence_tokens: int) -> None:
    """Every steering vector's full shape, positions and data size, from the codec object and
    the zstd frame header before anything is decompressed; then its values, decoded within
    those bounds in a worker thread (up to STEERING_MAX_VALUES of them). `sequence_tokens`:
    the longest prompt's tokens + max_tokens."""
    shapes = [
        _steering_shape(index, vector, model, sequence_tokens)
        for index, vector in enumerate(vectors)
    ]
    values = sum(math.prod(shape) for shape in shapes)
    if values > STEERING_MAX_VALUES:
        raise _invalid(
            f"'apply_steering_vectors' hold {values} values together; at most "
            f"{STEERING_MAX_VALUES} are allowed."
        )
    await asyncio.to_thread(_check_steering_values, vectors, shapes)


def _check_steering_positions(vectors, prompt_tokens: int, max_tokens: int) -> None:
    """Each vector's positions as every upstream steers them alike
    (`acs_client.protocol.check_steering_positions`); `prompt_tokens`: the shortest
    prompt's."""
    for index, vector in enumerate(vectors):
        try:
            check_steering_positions(
                vector.position_indices or [], prompt_tokens=prompt_tokens, max_tokens=max_tokens
            )
        except RuleBroken as error:
            field = f"apply_steering_vectors.{index}.position_indices"
            raise ApiError("position_steering_unavailable", f"'{field}': {error}") from None


def _steering_shape(index: int, vector, model: LanguageModel, sequence_tokens: int):
    """One steering vector's shape, checked with its layers, codec fields and frame size."""
    field = f"apply_steering_vectors.{index}"
    _check_layers(f"{field}.layer_indices", vector.layer_indices, model)
    tensor = vector.activations
    for name, expected in SUPPORTED_CODEC.items():
        if getattr(tensor, name) != expected:
            raise _invalid(f"'{field}.activations.{name}' must be '{expected}'.")
    try:
        shape = check_steering_shape(
            field=field,
            shape=tensor.shape,
            layer_indices=vector.layer_indices,
            position_indices=vector.position_indices,
            hidden_size=model.hidden_size,
            sequence_tokens=sequence_tokens,
        )
    except ValueError as error:
        raise _invalid(str(error)) from None
    try:
        codec.check_frame_size(codec.b64decode_data(tensor.data), shape)
    except ValueError as error:
        raise _invalid(f"'{field}.activations.data': {error}.") from None
    return shape


def _check_steering_values(vectors, shapes) -> None:
    for index, (vector, shape) in enumerate(zip(vectors, shapes, strict=True)):
        field = f"apply_steering_vectors.{index}"
        try:
            values = codec.decode(vector.activations.model_dump(), max_values=math.prod(shape))
        except ValueError as error:
            raise _invalid(f"'{field}.activations.data': {error}.") from None
        _check_magnitude(field, values, vector)


def _check_magnitude(field: str, values, vector) -> None:
    """Refuse a vector that could overflow the residual stream (STEERING_MAX_MAGNITUDE)."""
    if not np.isfinite(values).all():
        raise _invalid(f"'{field}.activations' holds NaN or infinite values.")
    largest = abs(vector.scale) * (1.0 if vector.norm_match else float(np.abs(values).max()))
    if largest > STEERING_MAX_MAGNITUDE:
        what = "scale (with norm_match)" if vector.norm_match else "values × scale"
        raise _invalid(
            f"'{field}': its {what} reach {largest:.3g}; at most {STEERING_MAX_MAGNITUDE:g} "
            "is allowed. Steering that large overflows the residual stream."
        )
