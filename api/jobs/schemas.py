"""Request bodies of the job endpoints, mirroring the wire format; unknown fields and
mistyped values are rejected like every other /v1 body."""

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from acs_client.protocol import MAX_HARVEST_PROMPTS


class HarvestRequest(BaseModel):
    """The body of POST /v1/harvest. `layers` omitted means the quartile layers."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    prompts: list[Annotated[str, StringConstraints(min_length=1)]] = Field(
        min_length=1, max_length=MAX_HARVEST_PROMPTS
    )
    layers: list[int] | Literal["all"] | None = None
    add_special_tokens: bool = True
