"""Wire format of the engine's HTTP API: request models (unknown fields rejected) and errors."""

import json
from typing import Annotated

from pydantic import Field, TypeAdapter, ValidationError

from acs_client.protocol import (
    MAX_STEERING_VECTORS,
    XARGS_STEERING,
    SamplingFields,
    SteeringFields,
    Strict,
    VllmXargs,
    error_field,
)


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


class CompletionRequest(SamplingFields):
    """The body of POST /v1/completions, as vLLM's OpenAI-compatible server with the
    vLLM-Lens plugin takes it (`model` required, `max_tokens` 16 by default, capture and
    steering inside `vllm_xargs`)."""

    model: str
    max_tokens: int = Field(default=16, ge=1)
    vllm_xargs: VllmXargs | None = None

    @property
    def output_residual_stream(self) -> bool | list[int] | None:
        return self.vllm_xargs.output_residual_stream if self.vllm_xargs else None

    def steering_vectors(self) -> list[SteeringFields]:
        """The steering vectors, decoded from their JSON string (RequestError if bad)."""
        text = self.vllm_xargs.apply_steering_vectors if self.vllm_xargs else None
        if text is None:
            return []
        where = f"vllm_xargs.{XARGS_STEERING}"
        try:
            return _STEERING_LIST.validate_python(json.loads(text))
        except json.JSONDecodeError as error:
            raise RequestError(f"{where!r} is not a JSON string: {error}") from None
        except ValidationError as error:
            raise RequestError(_describe(error.errors()[0], prefix=where)) from None


_STEERING_LIST = TypeAdapter(
    Annotated[list[SteeringFields], Field(max_length=MAX_STEERING_VECTORS)]
)


class TokenizeRequest(Strict):
    """The body of POST /tokenize."""

    model: str | None = None
    prompt: str | list[int]
    add_special_tokens: bool = True


def parse_model(model_class: type[Strict], body: object):
    """Validate a decoded JSON body; RequestError naming the first offending field otherwise."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    try:
        return model_class.model_validate(body)
    except ValidationError as error:
        raise RequestError(_describe(error.errors()[0])) from None


def _describe(error: dict, prefix: str = "") -> str:
    field = ".".join(part for part in (prefix, error_field(error)) if part)
    if error["type"] == "extra_forbidden":
        return f"unknown field {field!r}"
    if error["type"] == "missing":
        return f"missing required field {field!r}"
    return f"invalid value for {field!r}: {error['msg']}"
