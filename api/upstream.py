"""The one network seam of the gateway: every call to an inference upstream goes through here.

Upstreams speak vLLM's HTTP API (the embedded engine does too). A model's base URLs are used
round-robin; a circuit breaker in Redis, shared by all replicas (each trusting a closed
circuit for CLOSED_TRUST_S between checks), skips a URL that keeps failing
(`FAILURE_THRESHOLD` failures within `FAILURE_WINDOW_MS` open it for `OPEN_MS`; then one
probe request is let through, and its outcome closes or re-opens it). While it is open, the
gateway asks the URL's /health at most once per `HEALTH_PROBE_INTERVAL_MS` (all replicas
together), and closes the circuit as soon as the upstream is seen coming back: a probe that
answers after one during this opening did not (an engine restarting, a network healed). An
upstream whose /health never failed while its completions did waits for `OPEN_MS`, so a
broken upstream with a healthy /health is not retried every second. No user request is
involved: a client's request can neither hold the probe nor decide it. Failures are mapped
to the contract's error codes as `ApiError`.

Only what says the upstream is unwell counts as a failure: a transport error, a 5xx, invalid
JSON. An answer about the request itself never counts, so no user can open the circuit for
everyone with requests of their own making: a 4xx; a 503/429 "busy" (its queue is full:
`wrapper_saturated`, or the model is loading) - the upstream is healthy, and the client
retries after Retry-After; a 5xx marked as caused by the request (error type
`invalid_request_error`, or an out-of-memory on its size: `vllm_oom`). No request is too
large for the embedded engine's queue: it takes in a request of any number of sequences the
output-work cap allows (prompt_count x n <= 32,000 / max_tokens) and feeds them to its
batch as room frees up. A timeout is `upstream_deadline` and does not count either: a slow
answer to a long request is not a sick upstream.

Every completion names the account it is for in `X-Acs-Tenant` (an opaque id, no secret):
the embedded engine shares its capacity between tenants (vLLM ignores the header).

For other callers (a harvest worker capturing one prompt):

    reply = await send_completion(model.urls_for(activation=True), body, tenant=tenant_of(u))

sends a non-streaming completion body as the upstream takes it (`api.dialect` writes it) and
returns the reply, or raises `ApiError`. Tests point models at stub servers.
"""

import asyncio
import functools
import itertools
import json
import re
import secrets
import time
import weakref
from contextlib import asynccontextmanager
from dataclasses import dataclass

import aiohttp
import httpx
import orjson
from django.conf import settings

from acs_client.protocol import PROBE_HEADER
from infra.redis import redis_async

from .clients import http_client, upstream_session
from .errors import ERROR_CODES, ApiError

FAILURE_THRESHOLD = 5
FAILURE_WINDOW_MS = 30_000
OPEN_MS = 30_000
PROBE_MS = 15_000
HEALTH_PROBE_INTERVAL_MS = 1_000
HEALTH_PROBE_TIMEOUT_S = 2.0
NON_STREAMING_TIMEOUT_S = 14 * 60
STREAM_IDLE_TIMEOUT_S = 10 * 60
HEALTH_TIMEOUT_S = 3.0
TOKENIZE_TIMEOUT_S = 30.0
# The most bytes `open_completion` hands over at a time.
RELAY_CHUNK_BYTES = 64 * 1024

# Contract codes of upstream errors that say nothing against the upstream's health (see the
# module docstring).
_NOT_UPSTREAM_FAILURES = frozenset(
    {"wrapper_saturated", "modal_cold_boot", "capture_preempted", "vllm_oom"}
)
_CONTEXT_WORDS = re.compile(r"context|maximum model length|max_model_len|too long", re.IGNORECASE)
_OOM_WORDS = re.compile(r"out of memory|\boom\b", re.IGNORECASE)
# What vLLM answers (400) when its output holds NaN or infinity: the JSON encoder refused it.
_NON_FINITE_WORDS = re.compile(r"Out of range float values are not JSON compliant")


def circuit_keys(url: str) -> list[str]:
    """The URL's circuit state in Redis: open_until (ms; absent when closed), the half-open
    probe request's lock, recent failures, the health probe's lock, and `down` (a health
    probe failed during this opening)."""
    base = f"acs:cb:{{{url}}}"
    return [
        f"{base}:open_until",
        f"{base}:probe",
        f"{base}:fails",
        f"{base}:health",
        f"{base}:down",
    ]


_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# KEYS: open_until_i, probe_i, health_i for each URL in round-robin order. ARGV: probe ms,
# health probe interval ms. Returns {index (1-based), 'closed' | 'probe'}, or, when every
# circuit is open, {0, 'open', the indexes of the URLs whose health this caller is to probe
# now}.
_PICK = (
    _NOW
    + """
local health = {}
for i = 1, #KEYS / 3 do
  local open_until = redis.call('GET', KEYS[i * 3 - 2])
  if not open_until then return {i, 'closed'} end
  if now >= tonumber(open_until)
      and redis.call('SET', KEYS[i * 3 - 1], '1', 'NX', 'PX', ARGV[1]) then
    return {i, 'probe'}
  end
  if redis.call('SET', KEYS[i * 3], '1', 'NX', 'PX', ARGV[2]) then health[#health + 1] = i end
end
return {0, 'open', unpack(health)}
"""
)

# KEYS: circuit_keys(url). Closes the circuit if a health probe failed during this opening.
_CLOSE_IF_BACK = """
if redis.call('EXISTS', KEYS[5]) == 1 then
  redis.call('DEL', unpack(KEYS))
  return 1
end
return 0
"""

# KEYS: open_until, probe, fails (circuit_keys' first three). ARGV: member, threshold,
# window ms, open ms, was probe.
_FAILURE = (
    _NOW
    + """
redis.call('ZADD', KEYS[3], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now - tonumber(ARGV[3]))
redis.call('PEXPIRE', KEYS[3], ARGV[3])
if ARGV[5] == '1' or redis.call('ZCARD', KEYS[3]) >= tonumber(ARGV[2]) then
  redis.call('SET', KEYS[1], now + tonumber(ARGV[4]), 'PX', 86400000)
  redis.call('DEL', KEYS[2], KEYS[3])
  return 1
end
return 0
"""
)


@dataclass
class Target:
    """The URL picked for one request and whether it is the half-open circuit's probe."""

    url: str
    probe: bool


_round_robin: dict[tuple[str, ...], itertools.count] = {}

# A URL that Redis reported closed is used without asking again for this long (until a
# failure of this process's own): a circuit opened by another replica is noticed within this
# delay, and a request saves a Redis round trip.
CLOSED_TRUST_S = 1.0
_trusted_closed_until: dict[str, float] = {}


def circuit_trust_clear() -> None:
    """Forget which URLs were seen closed (tests that open circuits from outside)."""
    _trusted_closed_until.clear()


_pick_scripts: "weakref.WeakKeyDictionary[object, tuple]" = weakref.WeakKeyDictionary()


def _scripts(client):
    scripts = _pick_scripts.get(client)
    if scripts is None:
        scripts = _pick_scripts[client] = (
            client.register_script(_PICK),
            client.register_script(_FAILURE),
            client.register_script(_CLOSE_IF_BACK),
        )
    return scripts


async def pick_target(urls: list[str]) -> Target:
    """The next URL round-robin whose circuit lets a request through, or 503 circuit_open."""
    if not urls:
        raise ApiError("activation_engine_unconfigured", "This model has no upstream configured.")
    counter = _round_robin.setdefault(tuple(urls), itertools.count())
    start = next(counter) % len(urls)
    ordered = urls[start:] + urls[:start]
    if _trusted_closed_until.get(ordered[0], 0.0) > time.monotonic():
        return Target(url=ordered[0], probe=False)
    pick = _scripts(redis_async())[0]
    keys = [key for url in ordered for key in _pick_keys(url)]
    index, state, *to_probe = await pick(keys=keys, args=[PROBE_MS, HEALTH_PROBE_INTERVAL_MS])
    state = state.decode() if isinstance(state, bytes) else state
    if index == 0:
        for probed in to_probe:
            url = ordered[int(probed) - 1]
            if await _health_probe(url):
                _trusted_closed_until[url] = time.monotonic() + CLOSED_TRUST_S
                return Target(url=url, probe=False)
        raise ApiError(
            "circuit_open",
            "Every upstream of this model is failing; the gateway is letting them recover.",
        )
    url = ordered[index - 1]
    if state == "closed":
        _trusted_closed_until[url] = time.monotonic() + CLOSED_TRUST_S
    return Target(url=url, probe=state == "probe")


def _pick_keys(url: str) -> list[str]:
    open_until, probe, _, health, _ = circuit_keys(url)
    return [open_until, probe, health]


async def _health_probe(url: str) -> bool:
    """Ask an open circuit's upstream for its health; True when this closed the circuit (the
    upstream answers after a probe during this opening did not). A failed probe is noted."""
    client = redis_async()
    keys = circuit_keys(url)
    if not (await _health_of(url, timeout=HEALTH_PROBE_TIMEOUT_S))["model_loaded"]:
        await client.set(keys[4], "1", px=86_400_000)
        return False
    return bool(await _scripts(client)[2](keys=keys))


async def record_failure(target: Target) -> None:
    _trusted_closed_until.pop(target.url, None)
    failure = _scripts(redis_async())[1]
    await failure(
        keys=circuit_keys(target.url)[:3],
        args=[
            f"{time.time_ns()}-{secrets.token_hex(2)}",
            FAILURE_THRESHOLD,
            FAILURE_WINDOW_MS,
            OPEN_MS,
            "1" if target.probe else "0",
        ],
    )


async def record_success(target: Target) -> None:
    """Close the circuit after a successful probe (plain successes cost no Redis call)."""
    if target.probe:
        await redis_async().delete(*circuit_keys(target.url))


# ---------------------------------------------------------------------------------------
# Error mapping


def map_upstream_error(status: int, content: bytes, headers) -> ApiError:
    """The contract's error for an upstream's non-2xx answer. An error code that passes
    through keeps the `usage` the upstream reports beside it (the work it did, billed)."""
    upstream_code, message = _error_fields(content)
    retry_after = _retry_after(headers)
    if _passed_through(upstream_code):
        return ApiError(
            upstream_code,
            message,
            retry_after=retry_after,
            usage=_usage_beside_error(content),
        )
    if _NON_FINITE_WORDS.search(message or ""):
        return _unwell_output()
    if status in (400, 422):
        if upstream_code in ("context_length_exceeded", "vllm_context_length") or (
            upstream_code != "bad_json" and _CONTEXT_WORDS.search(message or "")
        ):
            return ApiError("vllm_context_length", message or "The prompt is too long.")
        return ApiError("vllm_invalid_request", message or "The upstream refused the request.")
    if status in (401, 403):
        return ApiError("upstream_auth", "The upstream refused the gateway's credentials.")
    if status == 503 and upstream_code == "model_loading":
        return ApiError("modal_cold_boot", "The model is loading.", retry_after=retry_after)
    if status in (429, 503):
        return ApiError(
            "wrapper_saturated",
            "The upstream is at capacity; retry after the delay given.",
            retry_after=retry_after,
        )
    if status == 504:
        return ApiError("upstream_deadline", "The upstream ran out of time.")
    if _OOM_WORDS.search(message or "") or upstream_code == "oom":
        return ApiError("vllm_oom", message, retry_after=retry_after)
    return ApiError(
        "upstream_server_error",
        f"The upstream failed with HTTP {status}" + (f": {message}" if message else "."),
        retry_after=retry_after,
        should_retry=retry_after is not None,
    )


def _unwell_output() -> ApiError:
    """vLLM's answer when its output held NaN or infinity, which JSON cannot carry. The
    gateway refuses any steering that could overflow, so an upstream that answers this is
    unwell: a KV cache left NaN by an earlier request fails every later one until vLLM
    restarts (measured with vLLM-Lens 1.3.0). It counts against the upstream's circuit."""
    return ApiError(
        "upstream_server_error",
        "The upstream's output held NaN or infinite values for this request: it is unwell "
        "(its operator should restart it).",
        should_retry=False,
    )


def map_stream_error(payload: dict) -> ApiError:
    """The contract's error for an `{"error": ...}` frame an upstream sent mid-stream, with
    the `usage` the upstream reports beside it (the work it did, billed)."""
    error = payload.get("error") if isinstance(payload.get("error"), dict) else {}
    code, message = error.get("code") or "", error.get("message") or "The upstream failed."
    usage = payload.get("usage") if isinstance(payload.get("usage"), dict) else None
    if _NON_FINITE_WORDS.search(message):
        return _unwell_output()
    if _passed_through(code):
        return ApiError(code, message, usage=usage)
    if _OOM_WORDS.search(message) or code == "oom":
        return ApiError("vllm_oom", message, usage=usage)
    return ApiError("upstream_server_error", message, should_retry=False, usage=usage)


def _passed_through(upstream_code: str) -> bool:
    """Whether an upstream's error code keeps its code (and so the table's status) through
    the gateway."""
    entry = ERROR_CODES.get(upstream_code)
    return entry is not None and entry.from_upstream


def _error_fields(content: bytes) -> tuple[str, str]:
    try:
        error = json.loads(content).get("error")
    except (ValueError, AttributeError):
        return "", content[:200].decode("utf-8", "replace").strip()
    if isinstance(error, dict):
        return str(error.get("code") or ""), str(error.get("message") or "")
    return "", str(error or "")


def _usage_beside_error(content: bytes) -> dict | None:
    try:
        usage = json.loads(content).get("usage")
    except (ValueError, AttributeError):
        return None
    return usage if isinstance(usage, dict) else None


class _NonFinite(Exception):
    pass


def _refuse_non_finite(name: str):
    raise _NonFinite(name)


_FINITE_JSON = json.JSONDecoder(parse_constant=_refuse_non_finite)


def finite_json(content: bytes, *, steered: bool):
    """An upstream's JSON body or SSE frame, decoded. NaN and ±Infinity are not JSON, though
    Python (and so an upstream) writes and reads them: they raise 400 non_finite_output (with
    the upstream's `usage`, for billing), so no such value reaches a client or the database.
    `steered`: the request carried steering vectors (the likely cause, said in the message).
    Raises ValueError for anything else that is not JSON."""
    try:
        # Strict JSON, twice as fast on a full-vocabulary answer (tens of MB); it refuses NaN,
        # ±Infinity, a lone surrogate and big numbers, which the standard library then reads.
        return orjson.loads(content)
    except orjson.JSONDecodeError:
        pass
    try:
        return _FINITE_JSON.decode(content.decode("utf-8", "surrogatepass"))
    except _NonFinite:
        pass
    usage = json.loads(content).get("usage")
    cause = (
        "this request's steering (its vectors' values times scale) likely overflows the "
        "residual stream; lower the scale or the values"
        if steered
        else "the upstream failed to compute this request"
    )
    raise ApiError(
        "non_finite_output",
        f"The model's output holds NaN or infinite values, which JSON cannot carry: {cause}.",
        usage=usage if isinstance(usage, dict) else None,
    )


def _error_type(content: bytes) -> str:
    try:
        error = json.loads(content).get("error")
    except (ValueError, AttributeError):
        return ""
    return str(error.get("type") or "") if isinstance(error, dict) else ""


def _retry_after(headers) -> int | None:
    value = headers.get("retry-after") if headers is not None else None
    try:
        return max(1, int(float(value))) if value is not None else None
    except ValueError:
        return None


def unreachable(target_url: str) -> ApiError:
    return ApiError("upstream_unreachable", f"The upstream at {target_url} is unreachable.")


def engine_dead() -> ApiError:
    return ApiError("vllm_engine_dead", "The upstream closed the connection mid-response.")


def deadline() -> ApiError:
    return ApiError("upstream_deadline", "The upstream did not answer in time.")


# ---------------------------------------------------------------------------------------
# Calls


@dataclass
class UpstreamReply:
    content: bytes
    body: dict
    upstream_ms: float


_JSON_HEADERS = {"content-type": "application/json"}
CONNECT_TIMEOUT_S = 5.0


def tenant_of(user_id) -> str:
    """The X-Acs-Tenant of an account's requests: the engine shares capacity per account,
    so that many keys of one user share one turn."""
    return str(user_id)


def _auth_headers() -> dict:
    """The shared upstream token (ACS_ENGINE_TOKEN), sent on every request to an upstream."""
    token = settings.ACS_ENGINE_TOKEN
    return {"authorization": f"Bearer {token}"} if token else {}


@asynccontextmanager
async def _exchange(urls, path, payload, *, read_timeout_s: float, tenant: str = ""):
    """POST `payload` to `path` at the next healthy URL (one retry on another URL when the
    connection fails); yields `(target, response)` once the upstream's status and headers are
    in, the body left to read (`_read`, `_sse_payloads`) until the block ends. A read that
    waits `read_timeout_s` for a byte is `upstream_deadline`."""
    content = json.dumps(payload, separators=(",", ":")).encode()
    headers = {**_JSON_HEADERS, **_auth_headers()}
    if tenant:
        headers["x-acs-tenant"] = tenant
    timeout = aiohttp.ClientTimeout(
        total=None, sock_connect=CONNECT_TIMEOUT_S, sock_read=read_timeout_s
    )
    attempts = 2 if len(urls) > 1 else 1
    async with upstream_session() as session:
        for attempt in range(attempts):
            target = await pick_target(urls)
            try:
                response = await session.post(
                    _endpoint(target.url, path), data=content, headers=headers, timeout=timeout
                )
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as error:
                await record_failure(target)
                if attempt == attempts - 1:
                    raise unreachable(target.url) from error
                continue
            except (aiohttp.ClientError, TimeoutError) as error:
                raise await _transport_failure(target, error) from error
            try:
                yield target, response
            finally:
                # A body read to its end leaves the connection for the next request; aiohttp
                # closes one left unread (a client gone mid-stream): the upstream then stops.
                response.release()
            return


@functools.lru_cache(maxsize=1024)
def _endpoint(base: str, path: str) -> str:
    return base.rstrip("/") + path


async def _transport_failure(target: Target, error: BaseException) -> ApiError:
    """The contract's error for a failed exchange with `target` once connected: a timeout is
    `upstream_deadline` (a slow answer is not a sick upstream); anything else (the connection
    reset or closed mid-answer) counts against its circuit."""
    if isinstance(error, TimeoutError):
        return deadline()
    await record_failure(target)
    return engine_dead()


async def _read(target: Target, response: aiohttp.ClientResponse) -> bytes:
    try:
        return await response.read()
    except (aiohttp.ClientError, TimeoutError) as error:
        raise await _transport_failure(target, error) from error


def counts_against_upstream(status: int, content: bytes, error: ApiError) -> bool:
    """Whether an upstream's error answer (`error`, as mapped) feeds its circuit breaker: a
    5xx that is neither "busy" nor marked as caused by the request, and output it could not
    encode (`_unwell_output`)."""
    if _NON_FINITE_WORDS.search(_error_fields(content)[1]):
        return True
    if status < 500 or error.code in _NOT_UPSTREAM_FAILURES:
        return False
    return _error_type(content) != "invalid_request_error"


async def _raise_for_status(target: Target, response: aiohttp.ClientResponse) -> None:
    if response.status < 400:
        return
    content = await _read(target, response)
    error = map_upstream_error(response.status, content, response.headers)
    if counts_against_upstream(response.status, content, error):
        await record_failure(target)
    raise error


async def send_completion(urls: list[str], payload: dict, *, tenant: str) -> UpstreamReply:
    """A non-streaming completion for `tenant` (`tenant_of`); raises the contract's ApiError
    on any failure."""
    started = time.perf_counter()
    async with _exchange(
        urls, "/v1/completions", payload, read_timeout_s=NON_STREAMING_TIMEOUT_S, tenant=tenant
    ) as (target, response):
        await _raise_for_status(target, response)
        content = await _read(target, response)
    try:
        body = finite_json(content, steered=bool(payload.get("apply_steering_vectors")))
    except ApiError:
        await record_success(target)  # it answered: a non-finite output is the request's
        raise
    except ValueError as error:
        await record_failure(target)
        raise ApiError("upstream_server_error", "The upstream sent invalid JSON.") from error
    await record_success(target)
    return UpstreamReply(content, body, (time.perf_counter() - started) * 1000)


@asynccontextmanager
async def open_completion(urls: list[str], payload: dict, *, tenant: str):
    """A non-streaming completion for `tenant` whose body is relayed as it arrives, never
    held whole (`api.relay`): yields an async iterator of the body's raw chunks (each at
    most RELAY_CHUNK_BYTES; aiohttp stops reading the connection while its buffer holds
    more than 128 KiB). The URL choice, circuit breaker and error mapping are `send_completion`'s: a
    failure before the first byte (no connection, an error status) raises its ApiError here;
    the connection failing or timing out mid-body raises `vllm_engine_dead` or
    `upstream_deadline` from the iterator. The body is not parsed, so an answer that is not
    JSON does not count against the circuit as it does in `send_completion`."""
    async with _exchange(
        urls, "/v1/completions", payload, read_timeout_s=NON_STREAMING_TIMEOUT_S, tenant=tenant
    ) as (target, response):
        await _raise_for_status(target, response)
        yield _body_chunks(target, response)


async def _body_chunks(target: Target, response: aiohttp.ClientResponse):
    try:
        async for chunk in response.content.iter_chunked(RELAY_CHUNK_BYTES):
            yield chunk
    except (aiohttp.ClientError, TimeoutError) as error:
        raise await _transport_failure(target, error) from error
    await record_success(target)


PROBE_TIMEOUT_S = 60.0


async def capture_probe(url: str, body: dict) -> bool | None:
    """Whether the upstream at `url` answers the capture `body` (`api.dialect.capture_body`
    of one token and layer) with a capture: False when it answers without one (plain vLLM,
    which ignores `vllm_xargs` it has no plugin for), None when it does not answer. Asks
    that URL alone, outside the round robin and the circuit breaker: no user's request."""
    try:
        response = await http_client().post(
            _endpoint(url, "/v1/completions"),
            json=body,
            headers={**_auth_headers(), PROBE_HEADER: "capture"},
            timeout=PROBE_TIMEOUT_S,
        )
        answer = response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
    if not isinstance(answer, dict):
        return None
    activations = answer.get("activations")
    return isinstance(activations, dict) and isinstance(activations.get("residual_stream"), dict)


async def upstream_tokenize(
    model, *, prompt: str, add_special_tokens: bool, activation: bool = True
) -> list[int]:
    """The token ids of `prompt` from `model`'s upstream (the activation upstream when
    `activation`) by POST /tokenize, with the URL choice, circuit breaker and error codes of
    completions; an upstream without /tokenize is 503 tokenizer_unavailable. Raises
    ApiError."""
    payload = {
        "model": model.upstream_model_name,
        "prompt": prompt,
        "add_special_tokens": add_special_tokens,
    }
    urls = model.urls_for(activation=activation)
    async with _exchange(urls, "/tokenize", payload, read_timeout_s=TOKENIZE_TIMEOUT_S) as (
        target,
        response,
    ):
        if response.status == 404:
            raise ApiError(
                "tokenizer_unavailable", "The model's upstream has no tokenizer endpoint."
            )
        await _raise_for_status(target, response)
        content = await _read(target, response)
    try:
        tokens = [int(token) for token in orjson.loads(content)["tokens"]]
    except (ValueError, KeyError, TypeError) as error:
        await record_failure(target)
        raise ApiError(
            "upstream_server_error", "The upstream's tokenizer sent invalid JSON."
        ) from error
    await record_success(target)
    return tokens


@asynccontextmanager
async def open_stream(urls: list[str], payload: dict, *, tenant: str):
    """Open a streaming completion for `tenant`; yields an async iterator of SSE `data:`
    payloads (bytes, without the `data: ` prefix). Failures before the first byte raise
    ApiError here; failures while iterating raise ApiError from the iterator."""
    async with _exchange(
        urls, "/v1/completions", payload, read_timeout_s=STREAM_IDLE_TIMEOUT_S, tenant=tenant
    ) as (target, response):
        await _raise_for_status(target, response)
        yield _sse_payloads(target, response)


async def _sse_payloads(target: Target, response: aiohttp.ClientResponse):
    """The `data:` payloads of an SSE body, each as soon as its line is complete. Every line
    the upstream sent before its connection failed is yielded before the failure is raised."""
    reader = response.content
    # The pieces of the line not yet complete: joined once its end arrives, so that a frame of
    # many MB (a full-vocabulary answer) read in many chunks is copied once, not per chunk.
    pending: list[bytes] = []
    failure = None
    while failure is None:
        try:
            chunk = await reader.readany()
        except (aiohttp.ClientError, TimeoutError) as error:
            # aiohttp raises a failure before handing back what its buffer still holds: the
            # frames that arrived with the connection's end.
            chunk, failure = _unread(reader), error
        if not chunk and failure is None:
            break
        if b"\n" not in chunk:
            pending.append(chunk)
            continue
        *lines, rest = b"".join([*pending, chunk]).split(b"\n")
        pending = [rest]
        for line in lines:
            if line.startswith(b"data:"):
                yield line[5:].strip()
    if failure is not None:
        raise await _transport_failure(target, failure) from failure
    await record_success(target)


def _unread(reader: aiohttp.StreamReader) -> bytes:
    """The bytes left in `reader`'s buffer after it failed. aiohttp has no public way to read
    them (every read raises the failure first), so this takes its private buffer; aiohttp is
    pinned and tests/gateway/test_upstream_seam.py checks this against the pinned version."""
    return b"".join(reader._buffer)


async def _health_of(url: str, *, timeout: float) -> dict:
    """`{url, ok, model_loaded}` from the URL's /health (vLLM answers 200 with no body)."""
    try:
        response = await http_client().get(
            url.rstrip("/") + "/health", headers=_auth_headers(), timeout=timeout
        )
        body = response.json() if response.content else {}
    except (httpx.HTTPError, ValueError):
        return {"url": url, "ok": False, "model_loaded": False}
    loaded = (
        response.status_code == 200
        and isinstance(body, dict)
        and body.get("model_loaded", True) is not False
    )
    return {"url": url, "ok": response.status_code == 200, "model_loaded": loaded}


async def upstream_health(urls: list[str]) -> dict:
    """`{"warm": bool, "upstreams": [{url, ok, model_loaded}]}` from each URL's /health."""
    states = await asyncio.gather(*(_health_of(url, timeout=HEALTH_TIMEOUT_S) for url in urls))
    return {"warm": any(s["model_loaded"] for s in states), "upstreams": list(states)}


MODELS_TIMEOUT_S = 10.0


class ModelCardUnavailable(Exception):
    """An upstream gave no entry for a model in its GET /v1/models; the message says why,
    naming the URL."""


def upstream_model_card(url: str, served_name: str) -> dict:
    """The entry for `served_name` in the GET /v1/models answer of the upstream at `url`:
    vLLM's carries `max_model_len`, the embedded engine's also `n_layers`, `hidden_size` and
    `vocab_size`. Synchronous (the registry asks from a worker thread, the admin and
    `manage.py acs_model_sizes` from theirs), and outside the round robin and the circuit
    breaker: no user's request. Raises ModelCardUnavailable."""
    try:
        response = httpx.get(
            _endpoint(url, "/v1/models"), headers=_auth_headers(), timeout=MODELS_TIMEOUT_S
        )
    except httpx.HTTPError as error:
        raise ModelCardUnavailable(
            f"{url} did not answer GET /v1/models ({type(error).__name__}: {error})"
        ) from error
    if response.status_code != 200:
        raise ModelCardUnavailable(
            f"{url} answered GET /v1/models with HTTP {response.status_code}"
        )
    try:
        cards = [card for card in response.json()["data"] if isinstance(card, dict)]
    except (ValueError, KeyError, TypeError) as error:
        raise ModelCardUnavailable(f"{url} answered GET /v1/models without a model list") from error
    card = next((card for card in cards if card.get("id") == served_name), None)
    if card is None:
        listed = ", ".join(repr(card.get("id")) for card in cards) or "nothing"
        raise ModelCardUnavailable(
            f"{url} does not serve {served_name!r} (its GET /v1/models lists {listed})"
        )
    return card


async def fetch_tokenizer_json(url: str) -> bytes | None:
    """The HF tokenizer JSON an upstream serves at /tokenizer.json, or None."""
    try:
        response = await http_client().get(
            url.rstrip("/") + "/tokenizer.json", headers=_auth_headers(), timeout=30.0
        )
    except httpx.HTTPError:
        return None
    return response.content if response.status_code == 200 else None
