"""Typed answers of the `/v1` API: the response models of `acs_client.responses` (the ones the
gateway builds its bodies with and documents), read from the wire, with a few helpers. Each
keeps the JSON it was read from in `raw` (a `Completion` in `body`); a field a newer server
adds is left out of the model and stays in `raw`."""

from dataclasses import dataclass, field
from functools import cached_property
from typing import Self

import numpy as np
from pydantic import BaseModel, PrivateAttr

from . import responses
from .codec import decode

COMPLETION_JOB_ENDED = frozenset({"succeeded", "failed"})
HARVEST_ENDED = frozenset({"done", "failed", "cancelled", "expired"})


class _FromWire(BaseModel):
    _raw: dict = PrivateAttr(default_factory=dict)

    @classmethod
    def from_wire(cls, body: dict) -> Self:
        """`body` validated by its response model, fields this client does not know left
        out (and kept in `raw`)."""
        result = cls.model_validate(body, extra="ignore")
        result._raw = body
        return result

    @property
    def raw(self) -> dict:
        """The JSON this was read from."""
        return self._raw


class Model(responses.ModelCard, _FromWire):
    """An entry of GET /v1/models, or GET /v1/models/{id}."""


class ModelStatus(responses.ModelStatus, _FromWire):
    """GET /v1/models/{id}/status: `warm` is True once an upstream has the model loaded."""


class KeyUsage(responses.KeyUsage, _FromWire):
    """GET /v1/usage: the key's and its account's budget windows, in what each counts."""

    @property
    def key_prefix(self) -> str:
        return self.key.prefix

    @property
    def key_name(self) -> str:
        return self.key.name


class CompletionJob(responses.CompletionJob, _FromWire):
    """A completion job: status `queued`, `running`, `succeeded` or `failed`."""

    @property
    def ended(self) -> bool:
        return self.status in COMPLETION_JOB_ENDED


class HarvestJob(responses.HarvestJob, _FromWire):
    """A harvest job: status `pending`, `running`, `done`, `failed`, `cancelled` or
    `expired`. `files` is set once there are files to download (a job that failed on a limit
    or was cancelled keeps the batches it wrote)."""

    @property
    def ended(self) -> bool:
        return self.status in HARVEST_ENDED

    @property
    def prompts_done(self) -> int:
        return self.progress.prompts_done

    @property
    def files(self) -> responses.HarvestFiles | None:
        return self.result


@dataclass
class Completion:
    """A non-streaming completion: the JSON `body` and the headers a caller may want. The
    typed views (`response`, `choices`, `usage`) validate `body` by
    `responses.CompletionResponse` when first read: seconds for a body of full-vocabulary
    prompt logprobs, whose `body` is better read as it is."""

    body: dict
    request_id: str = ""
    server_timing: dict[str, float] = field(default_factory=dict)
    max_tokens_clamped: str = ""

    @cached_property
    def response(self) -> responses.CompletionResponse:
        return responses.CompletionResponse.model_validate(self.body)

    @property
    def choices(self) -> list[responses.CompletionChoice]:
        return self.response.choices

    @property
    def usage(self) -> responses.TokenUsage:
        return self.response.usage

    @property
    def text(self) -> str:
        """The text of the first choice."""
        return self.body["choices"][0]["text"]

    def residual_stream(self) -> np.ndarray | None:
        """The captured residual stream as float32 `[layers, tokens, hidden]` (row k: the
        output of the k-th requested decoder block, before the final norm; tokens: prompt +
        generated − 1), or None when the request captured nothing."""
        captured = (self.body.get("activations") or {}).get("residual_stream")
        return decode(captured) if captured else None
