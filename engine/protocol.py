"""Wire format of the engine's HTTP API: request models (unknown fields rejected) and errors."""

from pydantic import Field, ValidationError

from acs_client.protocol import CompletionFields, Strict, error_field


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


class CompletionRequest(CompletionFields):
    """The body of POST /v1/completions, as vLLM's OpenAI-compatible server takes it
    (`model` required, `max_tokens` 16 by default)."""

    model: str
    max_tokens: int = Field(default=16, ge=1)


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


def _describe(error: dict) -> str:
    field = error_field(error)
    if error["type"] == "extra_forbidden":
        return f"unknown field {field!r}"
    if error["type"] == "missing":
        return f"missing required field {field!r}"
    return f"invalid value for {field!r}: {error['msg']}"
