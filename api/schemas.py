"""Request bodies of the public API, mirroring the wire format (vLLM's completions protocol
plus the ACS activation fields). Unknown fields and mistyped values are rejected."""

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import ApiError

MAX_N = 16
MAX_STOP_STRINGS = 4
MAX_LOGPROBS = 100
MAX_STEERING_VECTORS = 8
DEFAULT_MAX_TOKENS = 16
OUTPUT_WORK_CAP = 32_000
NON_STREAMING_MAX_TOKENS = 15_600
FULL_VOCAB_MAX_PROMPT_TOKENS = 256
FULL_VOCAB_MAX_PROMPT_TOKENS_WITH_CAPTURE = 16
# layers × tokens × hidden values one capture may return (128 MiB of bfloat16).
CAPTURE_MAX_VALUES = 64 * 1024 * 1024
MAX_BODY_BYTES = 8 * 1024 * 1024


class _Strict(BaseModel):
    # strict: JSON types must match (no "5" for 5); unknown fields are errors.
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class ActivationTensor(_Strict):
    """The activation codec object (see `acs_client.codec`)."""

    data: str
    dtype: str
    original_dtype: str = "torch.bfloat16"
    shape: list[int] = Field(min_length=1, max_length=3)
    compression: str


class SteeringVector(_Strict):
    activations: ActivationTensor
    layer_indices: list[int] = Field(min_length=1)
    scale: float = 1.0
    norm_match: bool = False
    position_indices: list[int] | None = None


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_Strict):
    """The body of POST /v1/completions."""

    model: str | None = None
    prompt: Prompt
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    seed: int | None = None
    stop: str | list[str] | None = Field(default=None)
    n: int = Field(default=1, ge=1, le=MAX_N)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    prompt_logprobs: int | None = Field(default=None, ge=-1, le=MAX_LOGPROBS)
    echo: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    add_special_tokens: bool = True
    ignore_eos: bool = False
    output_residual_stream: bool | list[int] | None = None
    apply_steering_vectors: list[SteeringVector] | None = Field(
        default=None, max_length=MAX_STEERING_VECTORS
    )
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

    def capture_layers(self, n_layers: int) -> list[int] | None:
        """The layers to capture, or None without a capture."""
        if self.output_residual_stream is True:
            return list(range(n_layers))
        if isinstance(self.output_residual_stream, list):
            return list(self.output_residual_stream)
        return None

    @property
    def is_activation_request(self) -> bool:
        return bool(self.output_residual_stream) or bool(self.apply_steering_vectors)


def parse_body(model_class: type[BaseModel], body: object):
    """Validate a decoded JSON body or raise 400 invalid_request naming the first bad field."""
    if not isinstance(body, dict):
        raise ApiError(400, "invalid_request", "The request body must be a JSON object.")
    try:
        return model_class.model_validate(body)
    except ValidationError as error:
        raise ApiError(400, "invalid_request", describe_error(error.errors()[0])) from None


def describe_error(error: dict) -> str:
    field = ".".join(str(part) for part in error["loc"] if not _is_union_branch(part))
    if error["type"] == "extra_forbidden":
        return f"Unknown field '{field}'."
    if error["type"] == "missing":
        return f"Missing required field '{field}'."
    return f"Invalid value for '{field}': {error['msg']}."


def _is_union_branch(part) -> bool:
    # pydantic names union branches in locations (prompt.list[int].0); the caller never wrote them.
    return isinstance(part, str) and (
        "[" in part or part in ("str", "int", "bool", "float", "ActivationTensor")
    )
