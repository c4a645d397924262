"""The response bodies of the `/v1` API as pydantic models mirroring the wire format, beside
the request models of `acs_client.protocol`. The gateway builds every body it writes through
them, its OpenAPI document (/v1/openapi.json) is generated from them, and the client's result
types (`acs_client.results`) are these models read from the wire: one definition of each body
for all three. Needs pydantic ≥ 2.12.

Two kinds of body:

- `GatewayBody`: what the gateway writes itself (model cards and status, usage, jobs,
  errors). `extra="forbid"`: building one with a field the model lacks raises, so the gateway
  cannot send a field the document does not list. Every field is always sent (null when it
  has no value), so the schema lists every field as required. A client reads these bodies
  with `extra="ignore"` (`acs_client.results`): a field a newer server adds breaks no client.
- `RelayedBody`: the completion body and stream chunks, which the gateway relays from its
  upstream (vLLM, vLLM-Lens, the embedded engine) without decoding them into these models on
  the way. It keeps only the fields listed here (`api.dialect.public_fields`): vLLM adds
  fields of its own from version to version (service_tier, system_fingerprint,
  kv_transfer_params, routed_experts, unasked token_ids, ...), which the engine has not, and
  an answer is the same from every upstream. `extra="allow"`, as in vLLM's own protocol, so
  that a client reading them breaks on no field a later version adds.
"""

import datetime as dt
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, PlainSerializer, WithJsonSchema

# Job times on the wire: whole seconds since the Unix epoch (a client reads an aware datetime).
UnixTime = Annotated[dt.datetime, PlainSerializer(lambda t: int(t.timestamp()), return_type=int)]
# Budget-window resets on the wire: ISO 8601 with the offset written out, "…T00:00:00+00:00".
IsoTime = Annotated[
    dt.datetime,
    PlainSerializer(dt.datetime.isoformat, return_type=str),
    WithJsonSchema({"type": "string", "format": "date-time"}, mode="serialization"),
]
# A model's state in the registry: only a live model serves requests.
ModelState = Literal["live", "disabled"]


class GatewayBody(BaseModel):
    """A body the gateway writes itself: no field beyond the model's, every field sent."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_serialization_defaults_required=True,
        use_attribute_docstrings=True,
    )


class RelayedBody(BaseModel):
    """A body relayed from the upstream: these fields (a reader tolerates others)."""

    model_config = ConfigDict(extra="allow", use_attribute_docstrings=True)


# ---------------------------------------------------------------------------------------
# Errors


class ErrorObject(GatewayBody):
    code: str
    """The error code: branch on it (x-error-codes of /v1/openapi.json lists every one)."""
    message: str
    """What went wrong, for a person: names the field or the limit."""
    type: str
    """The error's class, OpenAI-style (invalid_request_error, rate_limit_error, ...)."""


class ErrorResponse(GatewayBody):
    """Every error answer, and the one `data:` frame that ends a stream whose 200 was sent."""

    error: ErrorObject


# ---------------------------------------------------------------------------------------
# POST /v1/completions


class CompletionLogprobs(RelayedBody):
    """A choice's `logprobs` in the legacy completions shape: per generated token (echoed
    prompt tokens first with `echo`) its text, its natural-log probability, up to `logprobs`
    alternatives and its character offset in `text`."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(RelayedBody):
    """One token at one prompt position, in vLLM's prompt_logprobs shape."""

    logprob: float
    rank: int | None = None
    """1 for the likeliest token at that position."""
    decoded_token: str | None = None


class CompletionChoice(RelayedBody):
    """One choice: `choices[i * n + j]` is sample j of prompt i."""

    index: int
    text: str
    """The generated text (the prompt in front of it, with no separator, under `echo`)."""
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    """Why the choice ended, "length" or "stop"; null in a stream chunk that does not end it."""
    stop_reason: int | str | None = None
    """The stop string or token id that ended the choice, if one did."""
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None
    """With `prompt_logprobs`: null for the first prompt token, then per position a dict
    keyed by token id (a string) that always includes the actual token."""
    prompt_token_ids: list[int] | None = None
    """With `return_token_ids`: the prompt's token ids (in a stream, in the first chunk)."""
    token_ids: list[int] | None = None
    """With `return_token_ids`: the generated tokens' ids (in a stream, each chunk's new
    ones)."""


class TokenUsage(RelayedBody):
    """Tokens of the prompt(s), of the generated text, and both."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CapturedTensor(RelayedBody):
    """A residual-stream capture as the activation codec object (`acs_client.codec.decode`
    reads it): `data` is base64 of a zstd frame of the bfloat16 values' 16-bit patterns, C
    order, shape [layers, tokens, hidden] with tokens = prompt + generated − 1."""

    data: str
    dtype: Literal["int16"]
    original_dtype: Literal["torch.bfloat16"]
    shape: list[int]
    compression: Literal["zstd"]


class Activations(RelayedBody):
    residual_stream: CapturedTensor
    """Row k is the output of the k-th requested decoder block, before the final norm."""


class CompletionResponse(RelayedBody):
    """A completion (`stream: false`), and a completion job's stored result."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: TokenUsage
    activations: Activations | None = None
    """With `output_residual_stream` only."""


class CompletionStreamChunk(RelayedBody):
    """One `data:` frame of a stream. With `stream_options.include_usage` the last frame
    before `data: [DONE]` has `choices: []` and the `usage`."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: TokenUsage | None = None


# ---------------------------------------------------------------------------------------
# Models


class ModelCapabilities(GatewayBody):
    """What requests to the model may ask for."""

    max_model_len: int
    """Prompt tokens + max_tokens at most."""
    max_logprobs: int
    full_vocab_max_prompt_tokens: int
    """`prompt_logprobs: -1` covers at most this many prompt tokens × n."""
    activations: bool
    """Whether the model captures and steers the residual stream."""
    n_layers: int
    hidden_size: int
    vocab_size: int
    max_steering_vectors: int
    """0 for a model without activations."""


class ModelCard(GatewayBody):
    """A model: the id to send as `model`, and its limits."""

    id: str
    object: Literal["model"] = "model"
    owned_by: Literal["acs"] = "acs"
    default: bool
    """The model a request that names none gets."""
    status: ModelState
    capabilities: ModelCapabilities


class ModelList(GatewayBody):
    """GET /v1/models."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


class UpstreamHealth(GatewayBody):
    """One upstream of the model, as its /health answered."""

    ok: bool
    model_loaded: bool


class ModelStatus(GatewayBody):
    """GET /v1/models/{id}/status: whether the model is loaded upstream."""

    id: str
    object: Literal["model.status"] = "model.status"
    status: ModelState
    warm: bool
    """True once any upstream has the model loaded (a 503 modal_cold_boot clears then)."""
    upstreams: list[UpstreamHealth]


# ---------------------------------------------------------------------------------------
# GET /v1/usage


class UsageKey(GatewayBody):
    prefix: str
    name: str


class BudgetWindow(GatewayBody):
    """One budget window, counted in what `label` names (tokens, activation requests or
    harvest jobs)."""

    name: str
    label: str
    used: int
    reserved: int
    """The worst cases of requests still running, and budget the gateway leased for the key
    (given back 2 s after its last request)."""
    limit: int | None
    """null: no limit."""
    remaining: int | None
    resets_at: IsoTime


class KeyUsage(GatewayBody):
    """GET /v1/usage: the key's and its account's budget windows. `used` trails finished
    requests by up to 50 ms."""

    object: Literal["usage"] = "usage"
    key: UsageKey
    windows: list[BudgetWindow]


# ---------------------------------------------------------------------------------------
# Jobs


class CompletionJob(GatewayBody):
    """A completion job. Its result (GET …/result) is the stored completion, or the stored
    error with its status once the job failed."""

    id: str
    object: Literal["completion_job"] = "completion_job"
    status: Literal["queued", "running", "succeeded", "failed"]
    created_at: UnixTime
    started_at: UnixTime | None
    finished_at: UnixTime | None
    error: ErrorObject | None
    """The failed job's error."""


class HarvestProgress(GatewayBody):
    prompts_done: int
    n_prompts: int


class HarvestFiles(GatewayBody):
    """Signed download URLs of a harvest's files: they need no API key and work until
    `urls_expire_at` while the key that read them may use the API."""

    manifest_url: str
    shard_urls: list[str]
    """Per prompt i: `prompt_i` bfloat16 [layers, tokens, hidden] and `tokens_i` int32."""
    stats_url: str
    urls_expire_at: UnixTime


class HarvestJob(GatewayBody):
    """A harvest job. "expired": it ended long ago and its files are deleted (`message` says
    when)."""

    job_id: str
    object: Literal["harvest_job"] = "harvest_job"
    status: Literal["pending", "running", "done", "failed", "cancelled", "expired"]
    model: str
    layers: list[int]
    n_prompts: int
    progress: HarvestProgress
    created_at: UnixTime
    completed_at: UnixTime | None
    error: ErrorObject | None
    """Why the job failed."""
    message: str | None
    result: HarvestFiles | None
    """Once there are files: a done job, or one that failed on a limit or was cancelled
    after writing some batches."""
