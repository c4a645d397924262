"""The wire format of POST /v1/completions, shared by the gateway (`api.schemas`) and the
embedded engine (`engine.protocol`): vLLM's completions protocol plus the ACS activation
fields (at the top level publicly, inside `vllm_xargs` upstream), as strict pydantic models
(JSON types must match, unknown fields are errors), the limits both sides enforce, and where
a validation error points. Needs pydantic.
"""

import json

from pydantic import BaseModel, ConfigDict, Field

MAX_N = 16
MAX_STOP_STRINGS = 4
# vLLM refuses a temperature above this (and so does OpenAI's API).
MAX_TEMPERATURE = 2.0
MAX_LOGPROBS = 100
MAX_STEERING_VECTORS = 8
# prompt_count × n × max_tokens of one request: the most output work a request may ask for.
OUTPUT_WORK_CAP = 32_000
# A non-streaming request must finish within the 14-minute limit.
NON_STREAMING_MAX_TOKENS = 15_600
# Values (layers × positions × hidden) of all of a request's steering vectors together, checked
# from their shapes before any is decompressed: 32 MiB of bfloat16, four times what an 8 MiB
# body of incompressible vectors can carry.
STEERING_MAX_VALUES = 16 * 1024 * 1024
# The most a steering vector may add to one value of the residual stream: |value| × |scale|,
# or |scale| alone with norm_match (the vector is then the hidden state's norm long). Far
# beyond any model's activations (SmolLM2's largest is ~2e4), and far below what overflows:
# an infinite residual value makes NaN logits, and on vLLM-Lens NaN keys and values that stay
# in its KV cache and fail every later request until it restarts.
STEERING_MAX_MAGNITUDE = 1e6
# Full-vocabulary prompt logprobs (prompt_logprobs=-1) are ~3 MB of JSON per position: at
# most this many prompt tokens (× n), and fewer with a residual-stream capture.
FULL_VOCAB_MAX_PROMPT_TOKENS = 256
FULL_VOCAB_MAX_PROMPT_TOKENS_WITH_CAPTURE = 16
# POST /v1/harvest: the most prompts one job takes.
MAX_HARVEST_PROMPTS = 4096


def quartile_layers(n_layers: int) -> list[int]:
    """The layers a harvest captures by default: a quarter, half and three quarters deep."""
    return sorted({n_layers // 4, n_layers // 2, 3 * n_layers // 4})


def harvest_layers(requested: "list[int] | str | None", *, n_layers: int) -> list[int]:
    """The layers a harvest of a model of `n_layers` captures: the quartile layers when none
    are named, every layer for "all", else the list named (`check_layer_list`: RuleBroken
    naming what is wrong)."""
    if requested is None:
        return quartile_layers(n_layers)
    if requested == "all":
        return list(range(n_layers))
    check_layer_list(requested, n_layers=n_layers, field="layers")
    return list(requested)


class Strict(BaseModel):
    # strict: JSON types must match (no "5" for 5, no true for 1); unknown fields are errors.
    # Python's json reads NaN, Infinity and 1e999 as floats: no sampler or scale takes them.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(Strict):
    include_usage: bool = False


class SteeringFields(Strict):
    """One entry of `apply_steering_vectors`. `activations` is the codec object, taken as a
    plain dict here; the gateway narrows it to its codec model."""

    activations: dict
    layer_indices: list[int] = Field(min_length=1)
    scale: float = 1.0
    norm_match: bool = False
    position_indices: list[int] | None = None


Prompt = str | list[str] | list[int] | list[list[int]]


class SamplingFields(Strict):
    """The body of POST /v1/completions without the activation fields: what the gateway and
    the upstreams (vLLM, the embedded engine) take alike. Redefined fields keep their place,
    so errors are reported in this order on every side."""

    model: str | None = None
    prompt: Prompt
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    # vLLM's range (a signed 64-bit integer); the engine takes the same.
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    prompt_logprobs: int | None = Field(default=None, ge=-1, le=MAX_LOGPROBS)
    echo: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    add_special_tokens: bool = True
    ignore_eos: bool = False
    # vLLM's: each choice also carries `prompt_token_ids` and the generated `token_ids` (in a
    # stream, the prompt's in the first chunk and each chunk's new ids): the tokens exactly,
    # where text or logprobs strings can name several tokenizations. Not with echo
    # (check_field_pairs).
    return_token_ids: bool = False
    user: str | None = None

    def prompts(self) -> list:
        """The prompt as a list of prompts (each a string or a token-id list)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and isinstance(prompt[0], int):
            return [prompt]
        return list(prompt)

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def check_rules(self) -> None:
        """The rules on these fields both sides enforce (`check_stop_strings`,
        `check_field_pairs`); RuleBroken naming the first one broken."""
        check_stop_strings(self.stop_strings())
        check_field_pairs(
            stream=self.stream,
            prompt_logprobs=self.prompt_logprobs,
            echo=self.echo,
            return_token_ids=self.return_token_ids,
        )


class CompletionFields(SamplingFields):
    """The body of POST /v1/completions as the gateway takes it (`model` and `max_tokens`
    optional): the activation fields at the top level, as the cheatsheet has them; the
    gateway narrows the codec object of each steering vector."""

    output_residual_stream: bool | list[int] | None = None
    apply_steering_vectors: list[SteeringFields] | None = Field(
        default=None, max_length=MAX_STEERING_VECTORS
    )

    def capture_layers(self, n_layers: int) -> list[int] | None:
        """The layers to capture, or None without a capture."""
        if self.output_residual_stream is True:
            return list(range(n_layers))
        if isinstance(self.output_residual_stream, list):
            return list(self.output_residual_stream)
        return None


# The upstream dialect, vLLM-Lens's: vLLM passes per-request extra arguments to its plugins
# only inside `vllm_xargs` (strings, numbers and lists of those) and ignores unknown top-level
# fields without an error, so capture and steering travel there, the vectors as one JSON
# string. The gateway sends this; the embedded engine takes exactly this.
XARGS_CAPTURE = "output_residual_stream"
XARGS_STEERING = "apply_steering_vectors"
# Marks the gateway's capture probes of its upstreams (vLLM ignores it; logs and test
# upstreams can tell them from users' requests).
PROBE_HEADER = "x-acs-probe"


def in_vllm_xargs(body: dict) -> dict:
    """A completion body with the activation fields at the top level (as the gateway takes
    it) in the upstream dialect: `output_residual_stream` (true or a list of layers) and
    `apply_steering_vectors` (a list of plain dicts) moved into `vllm_xargs`."""
    capture, steering = body.get(XARGS_CAPTURE), body.get(XARGS_STEERING)
    upstream = {k: v for k, v in body.items() if k not in (XARGS_CAPTURE, XARGS_STEERING)}
    xargs = {}
    if capture is not None and capture is not False:
        xargs[XARGS_CAPTURE] = capture
    if steering:
        xargs[XARGS_STEERING] = json.dumps(steering, separators=(",", ":"))
    if xargs:
        upstream["vllm_xargs"] = xargs
    return upstream


class VllmXargs(Strict):
    """`vllm_xargs` as the embedded engine takes it: only the two keys vLLM-Lens reads."""

    output_residual_stream: bool | list[int] | None = None
    apply_steering_vectors: str | None = None


class RuleBroken(ValueError):
    """A request that breaks one of the limits both sides enforce; `field` is the request
    field it is about (a form puts the message there)."""

    def __init__(self, message: str, *, field: str):
        super().__init__(message)
        self.field = field


def check_output_work(*, sequences: int, max_tokens: int) -> None:
    """prompt_count × n (`sequences`) × max_tokens within the output-work cap, the most
    output one request may ask for; RuleBroken naming the product otherwise."""
    if sequences * max_tokens > OUTPUT_WORK_CAP:
        raise RuleBroken(
            f"prompt_count × n × max_tokens = {sequences * max_tokens:,} exceeds the "
            f"output-work cap of {OUTPUT_WORK_CAP:,}.",
            field="max_tokens",
        )


def check_max_tokens_given(*, max_tokens: int | None, prompts: int, n: int) -> None:
    """`max_tokens` named whenever a request asks for several sequences (a prompt list, or
    n > 1): the default of 16 tokens each is rarely what such a request means, and the
    output-work cap is reckoned on it; RuleBroken otherwise."""
    if max_tokens is None and (prompts > 1 or n > 1):
        raise RuleBroken(
            "Set 'max_tokens' explicitly when sending a prompt list or n > 1.", field="max_tokens"
        )


def check_non_streaming_max_tokens(*, stream: bool, max_tokens: int) -> None:
    """Without streaming, at most NON_STREAMING_MAX_TOKENS tokens: a whole answer must be
    generated within the request's deadline, which a stream resets with every token;
    RuleBroken otherwise (the gateway answers it as `deadline_infeasible`)."""
    if not stream and max_tokens > NON_STREAMING_MAX_TOKENS:
        raise RuleBroken(
            f"A non-streaming request may set max_tokens to at most {NON_STREAMING_MAX_TOKENS};"
            " lower max_tokens or set stream: true.",
            field="max_tokens",
        )


def check_logprobs_limit(
    *, logprobs: int | None, prompt_logprobs: int | None, max_logprobs: int
) -> None:
    """`logprobs` and `prompt_logprobs` within the model's own limit (`max_logprobs` of its
    /v1/models entry, at most MAX_LOGPROBS); RuleBroken naming the first over it."""
    for field, value in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
        if value is not None and value > max_logprobs:
            raise RuleBroken(
                f"'{field}' may be at most {max_logprobs} for this model.", field=field
            )


def check_layer_list(layers: list[int], *, n_layers: int, field: str) -> None:
    """`layers` (the request's `field`: a capture's, a steering vector's, a harvest's) names
    at least one layer, each of the model's `n_layers` once; RuleBroken otherwise."""
    if not layers:
        raise RuleBroken(f"'{field}' must name at least one layer.", field=field)
    bad = next((layer for layer in layers if not 0 <= layer < n_layers), None)
    if bad is not None:
        raise RuleBroken(
            f"Layer {bad} in '{field}' is out of range; this model has layers 0–{n_layers - 1}.",
            field=field,
        )
    if len(set(layers)) != len(layers):
        raise RuleBroken(f"'{field}' names a layer twice.", field=field)


def check_stop_strings(stop: list[str]) -> None:
    """At most MAX_STOP_STRINGS, none empty (vLLM refuses an empty one); RuleBroken otherwise."""
    if len(stop) > MAX_STOP_STRINGS:
        raise RuleBroken(
            f"'stop' may hold at most {MAX_STOP_STRINGS} strings; it has {len(stop)}.",
            field="stop",
        )
    if any(not string for string in stop):
        raise RuleBroken(
            "'stop' holds an empty string; every stop string needs text.", field="stop"
        )


def check_field_pairs(
    *, stream: bool, prompt_logprobs: int | None, echo: bool, return_token_ids: bool
) -> None:
    """Fields vLLM does not answer together: prompt logprobs come with a whole answer only
    (vLLM refuses them with stream: true), and under `return_token_ids` vLLM leaves the echoed
    prompt out of `text` (its ids are in `prompt_token_ids`), where echo promises it in front;
    RuleBroken naming the pair otherwise."""
    if stream and prompt_logprobs is not None:
        raise RuleBroken(
            "'prompt_logprobs' cannot be streamed; set stream: false, or leave "
            "prompt_logprobs out.",
            field="prompt_logprobs",
        )
    if echo and return_token_ids:
        raise RuleBroken(
            "'echo' with 'return_token_ids': vLLM then leaves the prompt out of the text; "
            "send one of them (the prompt's ids come in prompt_token_ids).",
            field="echo",
        )


def check_steering_positions(positions: list[int], *, prompt_tokens: int, max_tokens: int) -> None:
    """Steering by position as every upstream does it alike: vLLM-Lens (1.3.0) counts every
    generated token as position 0, so positions reach the prompt's tokens only (fewer than
    `prompt_tokens`, the shortest prompt's), and position 0 only when one token is generated
    (it would be steered again at every generated token but the first); RuleBroken
    otherwise."""
    beyond = next((p for p in positions if p >= prompt_tokens), None)
    if beyond is not None:
        raise RuleBroken(
            f"Position {beyond} is a generated token's; steering by position reaches the "
            f"prompt's positions only (0–{prompt_tokens - 1}). Leave out the positions to "
            "steer every position.",
            field="position_indices",
        )
    if 0 in positions and max_tokens > 1:
        raise RuleBroken(
            "Position 0 would also be steered at every generated token (the upstream counts "
            "each as position 0); steer position 0 with max_tokens 1 only, or leave out the "
            "positions.",
            field="position_indices",
        )


def check_capture_request(*, prompts: int, n: int, stream: bool) -> None:
    """A residual-stream capture covers one sequence, answered whole: one prompt, n = 1, no
    streaming; RuleBroken naming the one that is not so."""
    if prompts != 1:
        raise RuleBroken("A capture needs exactly one prompt.", field="prompt")
    if n != 1:
        raise RuleBroken("A capture needs n = 1.", field="n")
    if stream:
        raise RuleBroken("A capture cannot be streamed; set stream: false.", field="stream")


def check_steering_shape(
    *, field: str, shape, layer_indices, position_indices, hidden_size: int, sequence_tokens: int
) -> tuple[int, ...]:
    """The shape of a steering vector (`field`, e.g. "apply_steering_vectors.0"), checked
    against its layers, its positions (< `sequence_tokens`: the longest prompt + max_tokens)
    and the model's hidden size, from the codec object alone. Raises ValueError naming what is
    wrong. The gateway checks this before any upstream work and the engine again before it
    decompresses."""
    positions = position_indices
    if positions is not None:
        if not positions:
            raise ValueError(f"'{field}.position_indices' must list at least one position.")
        bad = next((p for p in positions if not 0 <= p < sequence_tokens), None)
        if bad is not None:
            raise ValueError(
                f"Position {bad} in '{field}.position_indices' is outside the sequence; "
                f"positions are 0–{sequence_tokens - 1} (prompt tokens + max_tokens)."
            )
        if len(set(positions)) != len(positions):
            raise ValueError(f"'{field}.position_indices' names a position twice.")
    shape = tuple(shape)
    if len(shape) not in (2, 3):
        raise ValueError(
            f"'{field}.activations.shape' must be [layers, hidden] or [layers, positions, hidden]."
        )
    if len(shape) == 3 and positions is None:
        raise ValueError(
            f"'{field}.activations.shape' is [layers, positions, hidden], which needs "
            "position_indices."
        )
    if shape[-1] != hidden_size:
        raise ValueError(
            f"'{field}.activations' has hidden size {shape[-1]}; the model's is {hidden_size}."
        )
    rows = [len(layer_indices)] + ([len(positions)] if len(shape) == 3 else [])
    if list(shape) != [*rows, hidden_size]:
        raise ValueError(
            f"'{field}.activations.shape' is {list(shape)}, but layer_indices"
            + (" and position_indices" if len(shape) == 3 else "")
            + f" make it {[*rows, hidden_size]}."
        )
    return shape


def error_field(error: dict) -> str:
    """The dotted location of one pydantic validation error (`ValidationError.errors()`
    item), as the caller wrote it: pydantic also names the union branch it tried
    (prompt.list[int].0), which is left out."""
    return ".".join(str(part) for part in error["loc"] if not _is_union_branch(part))


def _is_union_branch(part) -> bool:
    return isinstance(part, str) and (
        "[" in part or part in ("str", "int", "bool", "float", "ActivationTensor")
    )
