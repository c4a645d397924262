"""Wire format of the engine's HTTP API: request models (unknown fields rejected) and errors."""

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_STOP_STRINGS = 4
MAX_N = 16
MAX_LOGPROBS = 100
MAX_STEERING_VECTORS = 8


class RequestError(Exception):
    """A problem with the request that resending cannot fix: reported as an HTTP 4xx/5xx."""

    def __init__(
        self,
        message: str,
        code: str = "invalid_request",
        status: int = 400,
        error_type: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.message = message
        self.code = code
        self.status = status
        self.error_type = error_type

    def body(self) -> dict:
        return {"error": {"code": self.code, "message": self.message, "type": self.error_type}}


class _Strict(BaseModel):
    # strict: JSON types must match (no "5" for 5, no true for 1); unknown fields are errors.
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class SteeringVectorSpec(_Strict):
    activations: dict
    layer_indices: list[int] = Field(min_length=1)
    scale: float = 1.0
    norm_match: bool = False
    position_indices: list[int] | None = None


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_Strict):
    """The body of POST /v1/completions, as vLLM's OpenAI-compatible server takes it."""

    model: str
    prompt: Prompt
    max_tokens: int = Field(default=16, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    prompt_logprobs: int | None = Field(default=None, ge=-1, le=MAX_LOGPROBS)
    echo: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    add_special_tokens: bool = True
    ignore_eos: bool = False
    output_residual_stream: bool | list[int] | None = None
    apply_steering_vectors: list[SteeringVectorSpec] | None = Field(
        default=None, max_length=MAX_STEERING_VECTORS
    )
    user: str | None = None

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class TokenizeRequest(_Strict):
    """The body of POST /tokenize."""

    model: str | None = None
    prompt: str | list[int]
    add_special_tokens: bool = True


def parse_model(model_class: type[_Strict], body: object):
    """Validate a decoded JSON body; RequestError naming the first offending field otherwise."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    try:
        return model_class.model_validate(body)
    except ValidationError as error:
        raise RequestError(_describe(error.errors()[0])) from None


def _describe(error: dict) -> str:
    field = ".".join(str(part) for part in error["loc"] if not _is_union_branch(part))
    if error["type"] == "extra_forbidden":
        return f"unknown field {field!r}"
    if error["type"] == "missing":
        return f"missing required field {field!r}"
    return f"invalid value for {field!r}: {error['msg']}"


def _is_union_branch(part) -> bool:
    # pydantic names union branches in locations (prompt.list[int].0); users never wrote those.
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "bool", "float"))
