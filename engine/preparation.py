"""Turn a parsed request into the engine's work description, validating it all up front.

Everything that could fail because of the request (token ids, lengths, layers, steering vector
shapes, codec data) fails here with a RequestError, before any model work starts.
"""

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from acs_client.codec import check_header
from acs_client.codec import decode as decode_tensor
from acs_client.protocol import (
    FULL_VOCAB_MAX_PROMPT_TOKENS,
    FULL_VOCAB_MAX_PROMPT_TOKENS_WITH_CAPTURE,
    STEERING_MAX_VALUES,
    XARGS_STEERING,
    RuleBroken,
    check_capture_request,
    check_output_work,
    check_steering_shape,
)
from engine.loader import LoadedModel
from engine.protocol import CompletionRequest, RequestError, TokenizeRequest


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and what to report for them; see CompletionRequest for meanings."""

    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    stop: tuple[str, ...]
    ignore_eos: bool
    logprobs: int | None
    prompt_logprobs: int | None
    echo: bool
    return_token_ids: bool

    @property
    def needs_prompt_scores(self) -> bool:
        """Whether the prompt's own token logprobs are reported (prompt_logprobs, echo+logprobs)."""
        return self.prompt_logprobs is not None or (self.echo and self.logprobs is not None)


@dataclass(frozen=True)
class SteeringAddition:
    """One vector row added to one block's output: `vector` is [hidden] (every position, or
    each of `positions`) or [len(positions), hidden] (row p at absolute position positions[p])."""

    vector: torch.Tensor
    scale: float
    norm_match: bool
    positions: tuple[int, ...] | None


@dataclass
class PreparedRequest:
    prompts: list[list[int]]
    n: int
    params: SamplingParams
    seed: int | None
    stream: bool
    include_usage: bool
    capture_layers: list[int] | None
    steering: dict[int, list[SteeringAddition]] = field(default_factory=dict)

    @property
    def sequence_count(self) -> int:
        return len(self.prompts) * self.n


def prepare_completion(request: CompletionRequest, loaded: LoadedModel) -> PreparedRequest:
    """Validate `request` against the model and build the work description (RequestError if bad)."""
    check_model_id(request.model, loaded)
    stop = request.stop_strings()
    try:
        request.check_rules()
    except RuleBroken as error:
        raise RequestError(str(error)) from None
    if request.stream_options is not None and not request.stream:
        raise RequestError("'stream_options' is only allowed with 'stream': true")
    prompts = tokenize_prompts(request.prompt, request.add_special_tokens, loaded)
    try:
        check_output_work(sequences=len(prompts) * request.n, max_tokens=request.max_tokens)
    except RuleBroken as error:
        # A request's sequences are queued and run whatever their number (see the
        # scheduler), so the output-work cap is what bounds one request's work.
        raise RequestError(str(error)) from None
    check_lengths(prompts, request.max_tokens, loaded.max_model_len)
    capture_layers = capture_layer_list(request, len(prompts), loaded.n_layers)
    check_full_vocab_limit(request, prompts, capture_layers is not None)
    return PreparedRequest(
        prompts=prompts,
        n=request.n,
        params=SamplingParams(
            max_tokens=request.max_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            top_k=request.top_k if request.top_k > 0 else 0,
            min_p=request.min_p,
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            repetition_penalty=request.repetition_penalty,
            stop=tuple(stop),
            ignore_eos=request.ignore_eos,
            logprobs=request.logprobs,
            prompt_logprobs=request.prompt_logprobs,
            echo=request.echo,
            return_token_ids=request.return_token_ids,
        ),
        seed=request.seed,
        stream=request.stream,
        include_usage=bool(request.stream_options and request.stream_options.include_usage),
        capture_layers=capture_layers,
        steering=steering_additions(
            request, loaded, max(len(ids) for ids in prompts) + request.max_tokens
        ),
    )


def prepare_tokenize(request: TokenizeRequest, loaded: LoadedModel) -> list[int]:
    if request.model is not None:
        check_model_id(request.model, loaded)
    return tokenize_prompts(request.prompt, request.add_special_tokens, loaded)[0]


def check_model_id(model: str, loaded: LoadedModel) -> None:
    if model != loaded.model_id:
        raise RequestError(
            f"model {model!r} does not exist; this engine serves {loaded.model_id!r}",
            code="model_not_found",
        )


def tokenize_prompts(prompt, add_special_tokens: bool, loaded: LoadedModel) -> list[list[int]]:
    """Token ids for each prompt; token-id prompts are checked against the vocabulary."""
    single = isinstance(prompt, str) or (prompt and isinstance(prompt[0], int))
    prompt_list = [prompt] if single else prompt
    if not prompt_list:
        raise RequestError("'prompt' must not be empty")
    tokenized = []
    for index, item in enumerate(prompt_list):
        if isinstance(item, str):
            ids = loaded.tokenizer(item, add_special_tokens=add_special_tokens)["input_ids"]
        else:
            ids = list(item)
            bad = [token for token in ids if not 0 <= token < loaded.vocab_size]
            if bad:
                raise RequestError(
                    f"prompt {index} has token id {bad[0]} outside the vocabulary "
                    f"[0, {loaded.vocab_size})"
                )
        if not ids:
            raise RequestError(f"prompt {index} is empty")
        tokenized.append(ids)
    return tokenized


def check_lengths(prompts: list[list[int]], max_tokens: int, max_model_len: int) -> None:
    for index, ids in enumerate(prompts):
        if len(ids) + max_tokens > max_model_len:
            raise RequestError(
                f"prompt {index} has {len(ids)} tokens and max_tokens is {max_tokens}: "
                f"{len(ids) + max_tokens} is more than the context length of {max_model_len}",
                code="context_length_exceeded",
            )


def capture_layer_list(request: CompletionRequest, prompt_count: int, n_layers: int):
    """The layers to capture, in ascending order as vLLM-Lens returns them, or None when there
    is no capture."""
    wanted = request.output_residual_stream
    if wanted is None or wanted is False:
        return None
    try:
        check_capture_request(prompts=prompt_count, n=request.n, stream=request.stream)
    except RuleBroken as error:
        raise RequestError(f"output_residual_stream: {error}") from None
    if wanted is True:
        return list(range(n_layers))
    if not wanted:
        raise RequestError("output_residual_stream must be true or a non-empty list of layers")
    check_layers(wanted, n_layers, "output_residual_stream")
    if len(set(wanted)) != len(wanted):
        raise RequestError("output_residual_stream lists a layer more than once")
    return sorted(wanted)


def check_layers(layers: list[int], n_layers: int, what: str) -> None:
    for layer in layers:
        if not 0 <= layer < n_layers:
            raise RequestError(
                f"{what}: layer {layer} is out of range; layers are 0..{n_layers - 1}"
            )


def check_full_vocab_limit(request: CompletionRequest, prompts, with_capture: bool) -> None:
    if request.prompt_logprobs != -1:
        return
    limit = (
        FULL_VOCAB_MAX_PROMPT_TOKENS_WITH_CAPTURE if with_capture else FULL_VOCAB_MAX_PROMPT_TOKENS
    )
    tokens = sum(len(ids) for ids in prompts) * request.n
    if tokens > limit:
        raise RequestError(
            f"prompt_logprobs: -1 allows at most {limit} prompt tokens x n; "
            f"this request has {tokens}",
            code="full_vocab_prompt_too_long",
        )


def steering_additions(request: CompletionRequest, loaded: LoadedModel, sequence_tokens: int):
    """Decode and check every steering vector; group the rows by the layer they are added to.
    Shapes are checked before any data is decompressed, and all vectors together may hold at
    most STEERING_MAX_VALUES values. `sequence_tokens`: the longest prompt + max_tokens."""
    by_layer: dict[int, list[SteeringAddition]] = {}
    values = 0
    for index, spec in enumerate(request.steering_vectors()):
        what = f"vllm_xargs.{XARGS_STEERING}.{index}"
        check_layers(spec.layer_indices, loaded.n_layers, what)
        if not math.isfinite(spec.scale):
            raise RequestError(f"{what}: scale must be a finite number")
        shape = steering_shape(spec, loaded.hidden_size, sequence_tokens, what)
        values += math.prod(shape)
        if values > STEERING_MAX_VALUES:
            raise RequestError(
                f"apply_steering_vectors hold more than {STEERING_MAX_VALUES} values together"
            )
        vectors = decode_steering_tensor(spec, shape, what)
        if spec.scale == 0:
            continue  # an exact no-op, so the forward pass stays bit-identical
        positions = tuple(spec.position_indices) if spec.position_indices is not None else None
        for row, layer in enumerate(spec.layer_indices):
            by_layer.setdefault(layer, []).append(
                SteeringAddition(
                    vector=torch.from_numpy(vectors[row].copy()),
                    scale=spec.scale,
                    norm_match=spec.norm_match,
                    positions=positions,
                )
            )
    return by_layer


def steering_shape(spec, hidden_size: int, sequence_tokens: int, what: str) -> tuple[int, ...]:
    """The steering vector's shape, checked against its layers, positions and the model from
    the codec header alone (its data is not touched)."""
    try:
        header_shape = check_header(spec.activations, max_values=STEERING_MAX_VALUES)
    except ValueError as error:
        raise RequestError(f"'{what}.activations': {error}") from None
    try:
        return check_steering_shape(
            field=what,
            shape=header_shape,
            layer_indices=spec.layer_indices,
            position_indices=spec.position_indices,
            hidden_size=hidden_size,
            sequence_tokens=sequence_tokens,
        )
    except ValueError as error:
        raise RequestError(str(error)) from None


def decode_steering_tensor(spec, shape: tuple[int, ...], what: str) -> np.ndarray:
    """Decode a vector whose `shape` was checked: no more than that is ever decompressed."""
    try:
        vectors = decode_tensor(spec.activations, max_values=math.prod(shape))
    except ValueError as error:
        raise RequestError(f"{what}.activations: {error}") from None
    if not np.isfinite(vectors).all():
        raise RequestError(f"{what}: activations contain inf or nan")
    return vectors
