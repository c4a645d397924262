"""A typed client for the ACS `/v1` API (httpx; sync and async; no Django).

    client = AcsClient(base_url="http://127.0.0.1:8000", api_key="acs-...")
    result = client.completions(model="smollm2-135m", prompt="Hi", max_tokens=4)
    result.text, result.usage.total_tokens, result.server_timing["upstream"]

    with client.stream_completions(model="smollm2-135m", prompt="Hi", stream=True) as stream:
        for frame in stream:          # parsed `data:` frames; an error frame raises
            ...

    job = client.submit_harvest(model="smollm2-135m", prompts=["a", "b"], layers=[7, 15])
    job = client.wait_for_harvest(job.job_id)            # a progress bar while it runs
    download = client.download_harvest(job, "harvest/")  # then download.captures()

Each method takes the request body as a dict, as keyword fields, or both (the keywords win).
Every failure raises `AcsApiError` with the contract's `code`, the HTTP `status` (200 for an
error frame inside a stream, None when the server could not be reached), `retry_after`
(seconds, from `Retry-After`) and `should_retry` (True only where resending can help).
"""

import contextlib
import json
import re
import ssl
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import numpy as np
from pydantic import ValidationError
from tqdm.auto import tqdm

from .codec import encode_vector
from .downloads import HarvestDownload
from .responses import ErrorObject, ErrorResponse
from .results import Completion, CompletionJob, HarvestJob, KeyUsage, Model, ModelStatus

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

    def retry_in(self, *, at_most: float) -> float | None:
        """The seconds to wait before sending the request again, where sending it again can
        help and the server asks to wait no longer than `at_most`; None: do not resend."""
        countdown = self.retry_after if self.retry_after is not None else 1
        return countdown if self.should_retry and countdown <= at_most else None


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


def _error_object(payload) -> ErrorObject | None:
    """The error of an `ErrorResponse` (a JSON value or its bytes), or None for anything
    else (a proxy's HTML page, a body cut short)."""
    try:
        if isinstance(payload, bytes):
            return ErrorResponse.model_validate_json(payload, extra="ignore").error
        return ErrorResponse.model_validate(payload, extra="ignore").error
    except ValidationError:
        return None


def error_from_response(response: httpx.Response, body: bytes) -> AcsApiError:
    """Build the error of a non-2xx response from its `{"error": {...}}` body and headers."""
    error = _error_object(body)
    if error is not None:
        code, message, error_type = error.code, error.message, error.type
    else:
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
        error = _error_object(frame)
        if error is None:
            raise AcsApiError(status=200, code="stream_error", message=str(frame["error"]))
        raise AcsApiError(status=200, code=error.code, message=error.message, error_type=error.type)
    return frame


def steering_vector(
    vector,
    *,
    layers: list[int],
    scale: float = 1.0,
    positions: list[int] | None = None,
    norm_match: bool = False,
) -> dict:
    """One entry of `apply_steering_vectors`: `vector` (rows `[len(layers), hidden]`, or
    `[len(layers), len(positions), hidden]` with `positions`; a single `[hidden]` row is used
    for every layer) is added, times `scale`, to the output of decoder block `layers[i]`, at
    every position or at `positions`. Values are rounded to bfloat16 on the wire."""
    array = np.asarray(vector, dtype=np.float32)
    if array.ndim == 1:
        array = np.tile(array, (len(layers), 1))
    entry = {
        "activations": encode_vector(array),
        "layer_indices": list(layers),
        "scale": scale,
        "norm_match": norm_match,
    }
    if positions is not None:
        entry["position_indices"] = list(positions)
    return entry


def _body(body: dict | None, fields: dict) -> dict:
    return {**(body or {}), **fields}


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


def _json(result_type):
    """Parse a JSON answer into `result_type` (a model of `acs_client.results`)."""
    return lambda response: result_type.from_wire(response.json())


def _models(response: httpx.Response) -> list[Model]:
    return [Model.from_wire(entry) for entry in response.json()["data"]]


def _job_result(response: httpx.Response) -> Completion | None:
    return None if response.status_code == 202 else _completion(response)


class _Operations:
    """The `/v1` operations, each defined once for both clients: `_call` sends the request
    and parses the answer, returning the result in `AcsClient` and an awaitable of it in
    `AsyncAcsClient`."""

    # Models and usage

    def models(self) -> list[Model]:
        """GET /v1/models: the models this key may use, with their limits."""
        return self._call("GET", "/v1/models", parse=_models)

    def model(self, model_id: str) -> Model:
        """GET /v1/models/{id} (404 `model_not_found` for an unknown id)."""
        return self._call("GET", f"/v1/models/{model_id}", parse=_json(Model))

    def model_status(self, model_id: str) -> ModelStatus:
        """GET /v1/models/{id}/status: whether an upstream has the model loaded."""
        return self._call("GET", f"/v1/models/{model_id}/status", parse=_json(ModelStatus))

    def usage(self) -> KeyUsage:
        """GET /v1/usage: the key's and its account's budget windows, in what each one counts."""
        return self._call("GET", "/v1/usage", parse=_json(KeyUsage))

    # Completions

    def completions(self, body: dict | None = None, /, **fields) -> Completion:
        """POST /v1/completions without streaming. Capture with `output_residual_stream`
        (then `result.residual_stream()`), steer with `apply_steering_vectors` (entries from
        `steering_vector`)."""
        return self._call("POST", "/v1/completions", parse=_completion, json=_body(body, fields))

    # Completion jobs

    def submit_completion_job(
        self, body: dict | None = None, /, *, idempotency_key: str | None = None, **fields
    ) -> CompletionJob:
        """POST /v1/completion-jobs. The same `idempotency_key` and body sent again returns
        the same job; without one, a new random key is used (so a resend makes a new job)."""
        headers = {"Idempotency-Key": idempotency_key or str(uuid.uuid4())}
        return self._call(
            "POST",
            "/v1/completion-jobs",
            parse=_json(CompletionJob),
            json=_body(body, fields),
            headers=headers,
        )

    def completion_job(self, job_id: str) -> CompletionJob:
        """GET /v1/completion-jobs/{id}."""
        return self._call("GET", f"/v1/completion-jobs/{job_id}", parse=_json(CompletionJob))

    def completion_job_result(self, job_id: str) -> Completion | None:
        """GET /v1/completion-jobs/{id}/result: the stored completion, None while the job
        waits or runs. A job that failed raises its stored error."""
        return self._call("GET", f"/v1/completion-jobs/{job_id}/result", parse=_job_result)

    # Harvest jobs

    def submit_harvest(
        self, body: dict | None = None, /, *, idempotency_key: str | None = None, **fields
    ) -> HarvestJob:
        """POST /v1/harvest (`model`, `prompts`, optional `layers`: a list or "all"; the
        quartile layers when left out). With an `idempotency_key`, the same key and body sent
        again returns the same job."""
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else None
        return self._call(
            "POST",
            "/v1/harvest",
            parse=_json(HarvestJob),
            json=_body(body, fields),
            headers=headers,
        )

    def harvest(self, job_id: str) -> HarvestJob:
        """GET /v1/harvest/{id}: status, progress and, once there are files, their URLs."""
        return self._call("GET", f"/v1/harvest/{job_id}", parse=_json(HarvestJob))

    def cancel_harvest(self, job_id: str) -> HarvestJob:
        """DELETE /v1/harvest/{id}: cancel a pending or running job (409
        `harvest_not_cancellable` once it ended); the batches it wrote are kept."""
        return self._call("DELETE", f"/v1/harvest/{job_id}", parse=_json(HarvestJob))


class AcsClient(_Operations, _Base):
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

    def _call(self, method: str, path: str, *, parse, **kwargs):
        return parse(self._request(method, path, **kwargs))

    def stream_completions(self, body: dict | None = None, /, **fields) -> CompletionStream:
        """POST /v1/completions with `stream: true` (set here); use as a context manager."""
        client = self._client()
        request = client.build_request(
            "POST", "/v1/completions", json={**_body(body, fields), "stream": True}
        )
        return CompletionStream(client, request)

    def wait_for_job(
        self,
        job_id: str,
        *,
        progress: bool = True,
        timeout: float | None = None,
        poll_interval: float = 1.0,
    ) -> Completion:
        """Poll a completion job until it ends and return its completion (a failed job
        raises its stored error), waiting as the server's Retry-After asks. `progress` shows
        the job's status in a bar (terminal or notebook). TimeoutError after `timeout` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with tqdm(total=1, desc=f"completion job {job_id[:8]}", disable=not progress) as bar:
            while True:
                response = self._request("GET", f"/v1/completion-jobs/{job_id}/result")
                if response.status_code != 202:
                    bar.set_postfix_str("succeeded")
                    bar.update(1)
                    return _completion(response)
                bar.set_postfix_str(CompletionJob.from_wire(response.json()).status)
                delay = _retry_after(response.headers) or poll_interval
                _sleep_before(deadline, delay, f"completion job {job_id}")

    def wait_for_harvest(
        self,
        job_id: str,
        *,
        progress: bool = True,
        timeout: float | None = None,
        poll_interval: float = 1.0,
    ) -> HarvestJob:
        """Poll a harvest job until it ends (done, failed, cancelled or expired) and return
        it; check `status`, as a failed or cancelled job may still have files. `progress`
        shows prompts captured in a bar. TimeoutError after `timeout` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        job = self.harvest(job_id)
        with tqdm(
            total=job.n_prompts, desc=f"harvest {job_id[:8]}", unit="prompt", disable=not progress
        ) as bar:
            while True:
                bar.update(job.prompts_done - bar.n)
                bar.set_postfix_str(job.status)
                if job.ended:
                    return job
                _sleep_before(deadline, poll_interval, f"harvest job {job_id}")
                job = self.harvest(job_id)

    def download_harvest(self, job: HarvestJob | str, directory) -> HarvestDownload:
        """Download a harvest's files (shards, stats, manifest) into `directory` (created if
        need be) and return them, ready to load. The URLs are signed: the API key is not
        sent with them."""
        if isinstance(job, str):
            job = self.harvest(job)
        if job.files is None:
            raise ValueError(f"Harvest job {job.job_id} has no files ({job.status}).")
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        options = {"timeout": self.timeout, "verify": _shared_ssl_context()}
        if self.transport is not None:
            options["transport"] = self.transport
        urls = [*job.files.shard_urls, job.files.stats_url, job.files.manifest_url]
        with httpx.Client(**options) as client:
            for url in urls:
                name = Path(urlsplit(url).path).name
                (directory / name).write_bytes(_download(client, url))
        return HarvestDownload.open(directory)


def _download(client: httpx.Client, url: str) -> bytes:
    try:
        response = client.get(url)
    except httpx.TransportError as error:
        raise _connection_error(error) from error
    if response.status_code >= 400:
        raise error_from_response(response, response.content)
    return response.content


def _sleep_before(deadline: float | None, delay: float, what: str) -> None:
    if deadline is not None and time.monotonic() + delay > deadline:
        raise TimeoutError(f"{what} did not end in time.")
    time.sleep(delay)


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


class AsyncAcsClient(_Operations, _Base):
    """Asynchronous client: the same `/v1` methods as `AcsClient`, awaited (the polling and
    download helpers are `AcsClient`'s)."""

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

    async def _call(self, method: str, path: str, *, parse, **kwargs):
        return parse(await self._request(method, path, **kwargs))

    def stream_completions(self, body: dict | None = None, /, **fields) -> AsyncCompletionStream:
        """Use as `async with client.stream_completions(body) as stream`."""
        client = self._client()
        request = client.build_request(
            "POST", "/v1/completions", json={**_body(body, fields), "stream": True}
        )
        return AsyncCompletionStream(client, request)
