"""Typed answers of the `/v1` API: dataclasses mirroring the wire, each keeping the JSON it was
read from in `raw`. Fields the server adds later are ignored here (and still in `raw`)."""

import datetime as dt
from dataclasses import dataclass, field

import numpy as np

from .codec import decode

COMPLETION_JOB_ENDED = frozenset({"succeeded", "failed"})
# "expired": the job ended long ago and its files are deleted.
HARVEST_ENDED = frozenset({"done", "failed", "cancelled", "expired"})


def _time(value: int | str | None) -> dt.datetime | None:
    """A Unix timestamp (jobs) or an ISO 8601 string (usage windows) as an aware datetime."""
    if value is None:
        return None
    if isinstance(value, str):
        return dt.datetime.fromisoformat(value)
    return dt.datetime.fromtimestamp(value, tz=dt.UTC)


@dataclass
class ModelCapabilities:
    max_model_len: int
    max_logprobs: int
    full_vocab_max_prompt_tokens: int
    activations: bool
    n_layers: int | None
    hidden_size: int | None
    vocab_size: int | None
    max_steering_vectors: int


@dataclass
class Model:
    """An entry of GET /v1/models, or GET /v1/models/{id}."""

    id: str
    status: str
    default: bool
    capabilities: ModelCapabilities
    raw: dict = field(repr=False)

    @classmethod
    def from_wire(cls, body: dict) -> "Model":
        capabilities = body["capabilities"]
        return cls(
            id=body["id"],
            status=body["status"],
            default=body.get("default", False),
            capabilities=ModelCapabilities(
                **{name: capabilities.get(name) for name in ModelCapabilities.__annotations__}
            ),
            raw=body,
        )


@dataclass
class ModelStatus:
    """GET /v1/models/{id}/status: `warm` is True once an upstream has the model loaded."""

    id: str
    status: str
    warm: bool
    upstreams: list[dict]
    raw: dict = field(repr=False)

    @classmethod
    def from_wire(cls, body: dict) -> "ModelStatus":
        return cls(
            id=body["id"],
            status=body["status"],
            warm=body["warm"],
            upstreams=body.get("upstreams", []),
            raw=body,
        )


@dataclass
class BudgetWindow:
    """One budget window, counted in what its `label` names (tokens, activation requests or
    harvest jobs); `limit` and `remaining` are None where it has no limit. `reserved` counts
    the worst cases of requests still running."""

    name: str
    label: str
    used: int
    reserved: int
    limit: int | None
    remaining: int | None
    resets_at: dt.datetime


@dataclass
class KeyUsage:
    """GET /v1/usage: the key's and its account's budget windows."""

    key_prefix: str
    key_name: str
    windows: list[BudgetWindow]
    raw: dict = field(repr=False)

    @classmethod
    def from_wire(cls, body: dict) -> "KeyUsage":
        return cls(
            key_prefix=body["key"]["prefix"],
            key_name=body["key"]["name"],
            windows=[
                BudgetWindow(
                    **{name: window.get(name) for name in BudgetWindow.__annotations__}
                    | {"resets_at": _time(window["resets_at"])}
                )
                for window in body["windows"]
            ],
            raw=body,
        )


@dataclass
class TokenUsage:
    """A completion's `usage`: tokens of the prompt(s), of the generated text, and both."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


@dataclass
class Logprobs:
    """A choice's `logprobs` (legacy completions shape): per generated token its text, its
    log-probability (natural log) and up to `logprobs` alternatives."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


@dataclass
class Choice:
    """One choice; `prompt_logprobs` keeps the vLLM shape (None first, then per position a
    dict keyed by token id → {logprob, rank, decoded_token})."""

    index: int
    text: str
    finish_reason: str | None
    logprobs: Logprobs | None
    prompt_logprobs: list[dict | None] | None

    @classmethod
    def from_wire(cls, body: dict) -> "Choice":
        logprobs = body.get("logprobs")
        return cls(
            index=body["index"],
            text=body["text"],
            finish_reason=body.get("finish_reason"),
            logprobs=Logprobs(**{name: logprobs.get(name) for name in Logprobs.__annotations__})
            if logprobs
            else None,
            prompt_logprobs=body.get("prompt_logprobs"),
        )


@dataclass
class Completion:
    """A non-streaming completion: the JSON `body` and the headers a caller may want. The
    typed views (`choices`, `text`, `usage`, `residual_stream()`) read `body`."""

    body: dict
    request_id: str = ""
    server_timing: dict[str, float] = field(default_factory=dict)
    max_tokens_clamped: str = ""

    @property
    def choices(self) -> list[Choice]:
        return [Choice.from_wire(choice) for choice in self.body["choices"]]

    @property
    def text(self) -> str:
        """The text of the first choice."""
        return self.body["choices"][0]["text"]

    @property
    def usage(self) -> TokenUsage | None:
        usage = self.body.get("usage")
        return TokenUsage(**usage) if usage else None

    def residual_stream(self) -> np.ndarray | None:
        """The captured residual stream as float32 `[layers, tokens, hidden]` (row k: the
        output of the k-th requested decoder block, before the final norm; tokens: prompt +
        generated − 1), or None when the request captured nothing."""
        captured = (self.body.get("activations") or {}).get("residual_stream")
        return decode(captured) if captured else None


@dataclass
class CompletionJob:
    """A completion job: status `queued`, `running`, `succeeded` or `failed`."""

    id: str
    status: str
    created_at: dt.datetime | None
    started_at: dt.datetime | None
    finished_at: dt.datetime | None
    error: dict | str | None
    raw: dict = field(repr=False)

    @property
    def ended(self) -> bool:
        return self.status in COMPLETION_JOB_ENDED

    @classmethod
    def from_wire(cls, body: dict) -> "CompletionJob":
        return cls(
            id=body["id"],
            status=body["status"],
            created_at=_time(body.get("created_at")),
            started_at=_time(body.get("started_at")),
            finished_at=_time(body.get("finished_at")),
            error=body.get("error"),
            raw=body,
        )


@dataclass
class HarvestFiles:
    """Signed download URLs of a harvest's files (they need no API key), valid until
    `urls_expire_at`."""

    manifest_url: str
    shard_urls: list[str]
    stats_url: str
    urls_expire_at: dt.datetime | None


@dataclass
class HarvestJob:
    """A harvest job: status `pending`, `running`, `done`, `failed`, `cancelled` or
    `expired`. The answer to a submit carries only `job_id`, `status`, `model` and
    `n_prompts`; the job's GET fills the rest. `files` is set once there are files to
    download (a job that failed on a limit or was cancelled keeps the batches it wrote)."""

    job_id: str
    status: str
    model: str
    n_prompts: int
    layers: list[int] | None = None
    prompts_done: int = 0
    created_at: dt.datetime | None = None
    completed_at: dt.datetime | None = None
    error: str | None = None
    message: str | None = None
    files: HarvestFiles | None = None
    raw: dict = field(default_factory=dict, repr=False)

    @property
    def ended(self) -> bool:
        return self.status in HARVEST_ENDED

    @classmethod
    def from_wire(cls, body: dict) -> "HarvestJob":
        result = body.get("result")
        return cls(
            job_id=body["job_id"],
            status=body["status"],
            model=body["model"],
            n_prompts=body["n_prompts"],
            layers=body.get("layers"),
            prompts_done=(body.get("progress") or {}).get("prompts_done", 0),
            created_at=_time(body.get("created_at")),
            completed_at=_time(body.get("completed_at")),
            error=body.get("error") or None,
            message=body.get("message"),
            files=HarvestFiles(
                manifest_url=result["manifest_url"],
                shard_urls=list(result["shard_urls"]),
                stats_url=result["stats_url"],
                urls_expire_at=_time(result.get("urls_expire_at")),
            )
            if result
            else None,
            raw=body,
        )
