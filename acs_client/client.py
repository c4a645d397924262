"""A small typed client for the ACS `/v1` API (httpx; sync and async; no Django).

    client = AcsClient(base_url="http://127.0.0.1:8000", api_key="acs-...")
    result = client.completions({"model": "smollm2-135m", "prompt": "Hi", "max_tokens": 4})
    result.body["choices"][0]["text"], result.server_timing["upstream"]

    with client.stream_completions({..., "stream": True}) as stream:
        for frame in stream:          # parsed `data:` frames; an error frame raises
            ...

Every failure raises `AcsApiError` with the contract's `code`, the HTTP `status` (200 for an
error frame inside a stream, None when the server could not be reached), `retry_after`
(seconds, from `Retry-After`) and `should_retry` (True only where resending can help).
"""

import contextlib
import json
import re
import ssl
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import httpx

DEFAULT_TIMEOUT = httpx.Timeout(connect=5.0, read=900.0, write=30.0, pool=30.0)
# Codes after which the same request may succeed later (see the error table of the contract).
TRANSIENT_STATUSES = frozenset({429, 502, 503})
_TIMING_ENTRY = re.compile(r"\s*([A-Za-z0-9_.-]+)\s*(?:;(.*))?$")
_ssl_context: ssl.SSLContext | None = None


def _shared_ssl_context() -> ssl.SSLContext:
    """One verifying SSL context for every client: building one loads the CA bundle, which
    costs tens of milliseconds, and a client is made per call."""
    global _ssl_context
    if _ssl_context is None:
        _ssl_context = httpx.create_ssl_context()
    return _ssl_context


class AcsApiError(Exception):
    """An error answer of the API, an error frame of a stream, or an unreachable server."""

    def __init__(
        self,
        *,
        status: int | None,
        code: str,
        message: str,
        error_type: str = "",
        retry_after: float | None = None,
        should_retry: bool = False,
        request_id: str = "",
    ):
        super().__init__(f"{code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.error_type = error_type
        self.retry_after = retry_after
        self.should_retry = should_retry
        self.request_id = request_id


def parse_server_timing(value: str | None) -> dict[str, float]:
    """`gateway;dur=12.5, upstream;dur=10` → {"gateway": 12.5, "upstream": 10.0} (ms)."""
    timings = {}
    for entry in (value or "").split(","):
        match = _TIMING_ENTRY.match(entry)
        if not match:
            continue
        for param in (match.group(2) or "").split(";"):
            name, _, number = param.strip().partition("=")
            if name == "dur":
                with contextlib.suppress(ValueError):
                    timings[match.group(1)] = float(number.strip('"'))
    return timings


def _retry_after(headers: httpx.Headers) -> float | None:
    try:
        return float(headers["retry-after"])
    except (KeyError, ValueError):
        return None


def error_from_response(response: httpx.Response, body: bytes) -> AcsApiError:
    """Build the error of a non-2xx response from its `{"error": {...}}` body and headers."""
    try:
        error = json.loads(body)["error"]
        code, message = str(error["code"]), str(error.get("message", ""))
        error_type = str(error.get("type", ""))
    except (ValueError, KeyError, TypeError):
        code, error_type = "http_error", ""
        message = f"HTTP {response.status_code}: {body[:200].decode('utf-8', 'replace')}"
    retry_after = _retry_after(response.headers)
    should_retry = (
        response.headers.get("x-should-retry", "").lower() != "false"
        and response.status_code in TRANSIENT_STATUSES
        and retry_after is not None
    )
    return AcsApiError(
        status=response.status_code,
        code=code,
        message=message,
        error_type=error_type,
        retry_after=retry_after,
        should_retry=should_retry,
        request_id=response.headers.get("x-request-id", ""),
    )


def _connection_error(error: httpx.TransportError) -> AcsApiError:
    return AcsApiError(
        status=None,
        code="connection_error",
        message=f"Could not reach the API: {error.__class__.__name__}: {error}",
        should_retry=True,
    )


def parse_sse_line(line: str) -> dict | None:
    """The JSON frame of one `data:` line; None for comments, blank lines, other fields and
    `[DONE]`. An error frame raises `AcsApiError` (status 200)."""
    if not line.startswith("data:"):
        return None
    payload = line[5:].strip()
    if payload == "[DONE]":
        return None
    frame = json.loads(payload)
    if isinstance(frame, dict) and "error" in frame:
        error = frame["error"] or {}
        raise AcsApiError(
            status=200,
            code=str(error.get("code", "stream_error")),
            message=str(error.get("message", "")),
            error_type=str(error.get("type", "")),
        )
    return frame


@dataclass
class Completion:
    """A non-streaming answer: the JSON body and the headers a caller may want."""

    body: dict
    request_id: str = ""
    server_timing: dict[str, float] = field(default_factory=dict)
    max_tokens_clamped: str = ""


def _completion(response: httpx.Response) -> Completion:
    return Completion(
        body=response.json(),
        request_id=response.headers.get("x-request-id", ""),
        server_timing=parse_server_timing(response.headers.get("server-timing")),
        max_tokens_clamped=response.headers.get("x-acs-max-tokens-clamped", ""),
    )


class _Base:
    """`transport` is an optional httpx transport (e.g. `httpx.MockTransport` in tests)."""

    def __init__(self, *, base_url: str, api_key: str, timeout=DEFAULT_TIMEOUT, transport=None):
        self.base_url = base_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"}
        self.timeout = timeout
        self.transport = transport

    def _client_options(self) -> dict:
        options = {
            "base_url": self.base_url,
            "headers": self.headers,
            "timeout": self.timeout,
            "verify": _shared_ssl_context(),
        }
        if self.transport is not None:
            options["transport"] = self.transport
        return options


class CompletionStream:
    """An open streaming response (sync). Iterate for parsed frames; `[DONE]` ends it."""

    def __init__(self, client: httpx.Client, request: httpx.Request):
        self._client = client
        self._request = request
        self.response: httpx.Response | None = None
        self.request_id = ""
        self.server_timing: dict[str, float] = {}
        self.done = False

    def __enter__(self):
        try:
            self.response = self._client.send(self._request, stream=True)
        except httpx.TransportError as error:
            self._client.close()
            raise _connection_error(error) from error
        if self.response.status_code >= 400:
            body = self.response.read()
            self.close()
            raise error_from_response(self.response, body)
        self.request_id = self.response.headers.get("x-request-id", "")
        self.server_timing = parse_server_timing(self.response.headers.get("server-timing"))
        return self

    def __iter__(self) -> Iterator[dict]:
        try:
            for line in self.response.iter_lines():
                if line.strip() == "data: [DONE]":
                    self.done = True
                    return
                frame = parse_sse_line(line)
                if frame is not None:
                    yield frame
        except httpx.TransportError as error:
            raise _connection_error(error) from error

    def close(self):
        if self.response is not None:
            self.response.close()
        self._client.close()

    def __exit__(self, *exc):
        self.close()


class AcsClient(_Base):
    """Synchronous client. Each call opens its own connection; keep none between calls."""

    def _client(self) -> httpx.Client:
        return httpx.Client(**self._client_options())

    def _request(self, method: str, path: str, **kwargs) -> httpx.Response:
        with self._client() as client:
            try:
                response = client.request(method, path, **kwargs)
            except httpx.TransportError as error:
                raise _connection_error(error) from error
        if response.status_code >= 400:
            raise error_from_response(response, response.content)
        return response

    def models(self) -> list[dict]:
        """The `data` list of GET /v1/models."""
        return self._request("GET", "/v1/models").json()["data"]

    def completions(self, body: dict) -> Completion:
        """POST /v1/completions without streaming."""
        return _completion(self._request("POST", "/v1/completions", json=body))

    def stream_completions(self, body: dict) -> CompletionStream:
        """POST /v1/completions with `stream: true`; use as a context manager."""
        client = self._client()
        return CompletionStream(client, client.build_request("POST", "/v1/completions", json=body))

    def submit_completion_job(self, body: dict, *, idempotency_key: str) -> dict:
        """POST /v1/completion-jobs: the job (`{id, status, ...}`); the same key and body
        sent again returns the same job."""
        headers = {"Idempotency-Key": idempotency_key}
        return self._request("POST", "/v1/completion-jobs", json=body, headers=headers).json()

    def submit_harvest(self, body: dict, *, idempotency_key: str | None = None) -> dict:
        """POST /v1/harvest: `{job_id, status, model, n_prompts}`; with an `idempotency_key`,
        the same key and body sent again returns the same job."""
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else None
        return self._request("POST", "/v1/harvest", json=body, headers=headers).json()


class AsyncCompletionStream:
    """An open streaming response (async). `async for` gives parsed frames."""

    def __init__(self, client: httpx.AsyncClient, request: httpx.Request):
        self._client = client
        self._request = request
        self.response: httpx.Response | None = None
        self.request_id = ""
        self.server_timing: dict[str, float] = {}
        self.done = False

    async def __aenter__(self):
        try:
            self.response = await self._client.send(self._request, stream=True)
        except httpx.TransportError as error:
            await self._client.aclose()
            raise _connection_error(error) from error
        if self.response.status_code >= 400:
            body = await self.response.aread()
            await self.aclose()
            raise error_from_response(self.response, body)
        self.request_id = self.response.headers.get("x-request-id", "")
        self.server_timing = parse_server_timing(self.response.headers.get("server-timing"))
        return self

    async def __aiter__(self) -> AsyncIterator[dict]:
        try:
            async for line in self.response.aiter_lines():
                if line.strip() == "data: [DONE]":
                    self.done = True
                    return
                frame = parse_sse_line(line)
                if frame is not None:
                    yield frame
        except httpx.TransportError as error:
            raise _connection_error(error) from error

    async def aclose(self):
        if self.response is not None:
            await self.response.aclose()
        await self._client.aclose()

    async def __aexit__(self, *exc):
        await self.aclose()


class AsyncAcsClient(_Base):
    """Asynchronous client with the same methods as `AcsClient`."""

    def _client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(**self._client_options())

    async def _request(self, method: str, path: str, **kwargs) -> httpx.Response:
        async with self._client() as client:
            try:
                response = await client.request(method, path, **kwargs)
            except httpx.TransportError as error:
                raise _connection_error(error) from error
        if response.status_code >= 400:
            raise error_from_response(response, response.content)
        return response

    async def models(self) -> list[dict]:
        return (await self._request("GET", "/v1/models")).json()["data"]

    async def completions(self, body: dict) -> Completion:
        return _completion(await self._request("POST", "/v1/completions", json=body))

    def stream_completions(self, body: dict) -> AsyncCompletionStream:
        """Use as `async with client.stream_completions(body) as stream`."""
        client = self._client()
        return AsyncCompletionStream(
            client, client.build_request("POST", "/v1/completions", json=body)
        )
