"""Request bodies of the public API, mirroring the wire format (vLLM's completions protocol
plus the ACS activation fields; the fields and limits shared with the engine are in
`acs_client.protocol`). Unknown fields and mistyped values are rejected."""

from pydantic import BaseModel, Field, ValidationError

from acs_client.codec import MAX_VALUES
from acs_client.protocol import (
    MAX_STEERING_VECTORS,
    CompletionFields,
    SteeringFields,
    Strict,
    error_field,
)

from .errors import ApiError

DEFAULT_MAX_TOKENS = 16
# layers × tokens × hidden values one capture may return (128 MiB of bfloat16): the largest
# tensor the codec decodes by default.
CAPTURE_MAX_VALUES = MAX_VALUES


class ActivationTensor(Strict):
    """The activation codec object (see `acs_client.codec`)."""

    data: str
    dtype: str
    original_dtype: str = "torch.bfloat16"
    shape: list[int] = Field(min_length=1, max_length=3)
    compression: str


class SteeringVector(SteeringFields):
    activations: ActivationTensor


class CompletionRequest(CompletionFields):
    """The body of POST /v1/completions."""

    apply_steering_vectors: list[SteeringVector] | None = Field(
        default=None, max_length=MAX_STEERING_VECTORS
    )

    @property
    def is_activation_request(self) -> bool:
        return bool(self.output_residual_stream) or bool(self.apply_steering_vectors)


def parse_body(model_class: type[BaseModel], body: object):
    """Validate a decoded JSON body or raise 400 invalid_request naming the first bad field."""
    if not isinstance(body, dict):
        raise ApiError("invalid_request", "The request body must be a JSON object.")
    try:
        return model_class.model_validate(body)
    except ValidationError as error:
        raise ApiError("invalid_request", describe_error(error.errors()[0])) from None


def describe_error(error: dict) -> str:
    field = error_field(error)
    if error["type"] == "extra_forbidden":
        return f"Unknown field '{field}'."
    if error["type"] == "missing":
        return f"Missing required field '{field}'."
    return f"Invalid value for '{field}': {error['msg']}."
