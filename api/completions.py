"""POST /v1/completions: the one path every completion takes, streaming or not.

`completion_run` serves a non-streaming body (the view, completion jobs via async_to_sync);
`completion_stream` serves `stream: true`. Both: validate → admission slot → reserve the
budget → upstream → settle to the actual usage → one usage record.

A full-vocabulary request (prompt_logprobs -1) also takes one of the process's
FULL_VOCAB_IN_FLIGHT slots (`full_vocab_slot`), and the HTTP endpoint relays such an answer
as it arrives where `relay.relayable` (a `CompletionResult` with a `Relay`), settling it
once the relay ends.
"""

import asyncio
import collections
import contextlib
import gzip
import json
import logging
import time
import weakref
from dataclasses import dataclass, field

from django.utils import timezone

from metering import gateway
from metering.budgets import BudgetExceeded
from metering.models import UsageRecord
from metering.sql import DatabaseBusy

from . import dialect, fanout, relay, upstream
from .admission import admission_slot
from .errors import ApiError, metering_refusal, sse_error_frame, unexpected_error
from .validation import ValidCompletion, validate_completion

logger = logging.getLogger(__name__)

# Seconds without an upstream frame after which a `: keepalive` comment is sent.
KEEPALIVE_S = 15.0
# Non-streaming bodies at least this large are gzipped for clients that accept it.
GZIP_MIN_BYTES = 1024
# zlib's fastest level: a full-vocabulary answer of 18.6 MB took 0.25 s of the gateway's CPU
# and became 6.1 MB, against 0.43 s and 5.4 MB at level 5.
GZIP_LEVEL = 1
# Full-vocabulary requests (prompt_logprobs -1: up to ~1 GB of answer) served at once by one
# process; more wait in their admission slot up to FULL_VOCAB_WAIT_S, then are refused 429
# queue_full with Retry-After FULL_VOCAB_RETRY_AFTER_S.
FULL_VOCAB_IN_FLIGHT = 2
FULL_VOCAB_WAIT_S = 30.0
FULL_VOCAB_RETRY_AFTER_S = 5
# Whether the HTTP endpoint relays `relay.relayable` answers as they arrive (False: the parse
# path, as before issue 43; bench/gateway.py compares the two).
RELAY_LARGE_ANSWERS = True


@dataclass
class CompletionResult:
    """`status`, `body` (the completion or the error envelope) and response `headers`;
    `content` is the already-encoded body when the gateway relays the upstream's bytes, and
    `relay` the answer still arriving where it is relayed as it arrives."""

    status: int
    body: dict
    headers: dict = field(default_factory=dict)
    content: bytes | None = None
    # The answer still to relay from the upstream (`Relay`); `body` is then empty.
    relay: "Relay | None" = None

    def encoded(self) -> bytes:
        if self.content is None:
            self.content = json.dumps(self.body, separators=(",", ":")).encode()
        return self.content

    def for_client(self, accept_encoding: str) -> tuple[bytes, dict]:
        """The body to send and the headers that go with it (the result's own, plus
        Content-Encoding and Vary when a large body is gzipped for a client that accepts it)."""
        content, headers = self.encoded(), dict(self.headers)
        if len(content) >= GZIP_MIN_BYTES and "gzip" in accept_encoding:
            content = gzip.compress(content, compresslevel=GZIP_LEVEL)
            headers["Content-Encoding"] = "gzip"
            headers["Vary"] = "Accept-Encoding"
        return content, headers


class _FullVocabSlots:
    """The full-vocabulary slots of one event loop (one web process's server loop): at most
    FULL_VOCAB_IN_FLIGHT held, waiters served in arrival order."""

    def __init__(self):
        self.running = 0
        self.waiters: collections.deque[asyncio.Future] = collections.deque()

    async def acquire(self) -> None:
        if self.running < FULL_VOCAB_IN_FLIGHT and not self.waiters:
            self.running += 1
            return
        turn = asyncio.get_running_loop().create_future()
        self.waiters.append(turn)
        try:
            await asyncio.wait_for(asyncio.shield(turn), FULL_VOCAB_WAIT_S)
        except BaseException as failure:
            if turn.done() and not turn.cancelled():
                self.release()  # handed a slot as it gave up: pass it on
            else:
                turn.cancel()
                self.waiters.remove(turn)
            if isinstance(failure, TimeoutError):
                raise ApiError(
                    "queue_full",
                    f"This server already serves {FULL_VOCAB_IN_FLIGHT} full-vocabulary "
                    "requests (prompt_logprobs -1) and more are waiting; retry after the delay "
                    "given.",
                    retry_after=FULL_VOCAB_RETRY_AFTER_S,
                ) from None
            raise

    def release(self) -> None:
        while self.waiters:
            turn = self.waiters.popleft()
            if not turn.done():
                turn.set_result(None)  # the slot passes on: `running` is unchanged
                return
        self.running -= 1


_full_vocab_by_loop: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _FullVocabSlots]"
_full_vocab_by_loop = weakref.WeakKeyDictionary()


@contextlib.asynccontextmanager
async def full_vocab_slot():
    """Hold one of this process's FULL_VOCAB_IN_FLIGHT full-vocabulary slots (per event loop:
    a Celery task's async_to_sync loop, one job at a time, has its own); raises ApiError 429
    queue_full after FULL_VOCAB_WAIT_S without one."""
    loop = asyncio.get_running_loop()
    slots = _full_vocab_by_loop.get(loop)
    if slots is None:
        slots = _full_vocab_by_loop[loop] = _FullVocabSlots()
    await slots.acquire()
    try:
        yield
    finally:
        slots.release()


def full_vocab_counts() -> dict:
    """Full-vocabulary requests running and waiting, over every loop of the process (for
    tests and the benchmark)."""
    slots = list(_full_vocab_by_loop.values())
    return {
        "running": sum(slot.running for slot in slots),
        "waiting": sum(len(slot.waiters) for slot in slots),
    }


class _Request:
    """Timing and metering state of one completion request."""

    def __init__(self, *, key, payload, request_id, endpoint, workload, stream, fence=None):
        self.key = key
        # A worker's bill is fenced by its attempt at the job (`metering.gateway.meter`).
        self.fence = fence
        self.payload = payload
        self.status, self.error_code = 500, "internal_error"
        self.request_id = request_id
        self.endpoint = endpoint
        self.workload = workload[:16]
        self.stream = stream
        self.model = payload.get("model") if isinstance(payload, dict) else None
        self.started = time.perf_counter()
        self.upstream_started: float | None = None
        self.upstream_ms: float | None = None
        self.ttft_ms: float | None = None
        self.valid: ValidCompletion | None = None
        self.reservation = None
        self.reservation_alive_at = 0.0  # time.monotonic() when it was last marked alive
        self.prompt_tokens = 0
        self.completion_tokens = 0

    @property
    def tenant(self) -> str:
        """Whose share of the upstreams' capacity the request spends (`upstream.tenant_of`)."""
        return upstream.tenant_of(self.key.user_id)

    def elapsed_ms(self) -> float:
        return (time.perf_counter() - self.started) * 1000

    def server_timing(self) -> str:
        """The Server-Timing header. A stream's is sent when it opens: its upstream part is
        the time the upstream took to open the stream."""
        total = self.elapsed_ms()
        upstream_ms = self.upstream_ms
        if upstream_ms is None:
            started = self.upstream_started
            upstream_ms = (time.perf_counter() - started) * 1000 if started is not None else 0.0
        return f"gateway;dur={total - upstream_ms:.2f}, upstream;dur={upstream_ms:.2f}"

    def clamp_headers(self) -> dict:
        reservation = self.reservation
        if reservation is None or reservation.max_tokens_applied >= self.valid.max_tokens:
            return {}
        return {
            "X-Acs-Max-Tokens-Clamped": (
                f"requested={self.valid.max_tokens},"
                f"applied={reservation.max_tokens_applied},reason=budget"
            )
        }

    def record(self, *, status: int, error_code: str = "") -> UsageRecord:
        """The request's usage record, unsaved."""
        model = self.valid.model.name if self.valid else self.model
        return UsageRecord(
            created_at=timezone.now(),
            key_id=self.key.pk,
            user_id=self.key.user_id,
            request_id=self.request_id,
            endpoint=self.endpoint,
            status_code=status,
            error_code=error_code,
            latency_ms=self.elapsed_ms(),
            model=model[:64] if isinstance(model, str) else "",
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            upstream_latency_ms=self.upstream_ms,
            ttft_ms=self.ttft_ms,
            stream=self.stream,
            activation_layers=self.valid.capture_layers if self.valid else None,
            workload=self.workload,
        )

    def finish_in_background(self, *, status: int, error_code: str = "", urgent: bool = False):
        """Start settling and metering, in work that outlives the request's own task;
        returns a future done once they are written. A capture the upstream did not deliver
        costs nothing: neither its tokens nor its activation request."""
        if error_code == "capture_incomplete":
            self.prompt_tokens = self.completion_tokens = 0
        return gateway.meter(
            hold=self.reservation,
            record=self.record(status=status, error_code=error_code),
            urgent=urgent,
            activations_refunded=error_code == "capture_incomplete",
            fence=self.fence,
        )

    async def finish(self, *, status: int, error_code: str = "") -> None:
        """Settle and meter, even if the request task is being cancelled."""
        await asyncio.shield(
            self.finish_in_background(status=status, error_code=error_code, urgent=True)
        )

    async def admit_and_reserve(self, stack: contextlib.AsyncExitStack) -> int:
        """Take an admission slot (held until `stack` closes) and reserve the budget;
        returns the max_tokens to send upstream."""
        valid = self.valid
        await stack.enter_async_context(admission_slot(self.key.pk, self.key.user_id))
        if valid.request.prompt_logprobs == -1:
            await stack.enter_async_context(full_vocab_slot())
        terms = {
            "key": self.key,
            "prompt_tokens": valid.prompt_tokens,
            "max_tokens": valid.max_tokens,
            "completions": valid.completions,
            "activation": valid.activation,
        }
        # Most requests are held out of the key's lease at once; a task for the rest.
        self.reservation = gateway.reserve_from_lease(**terms)
        if self.reservation is None:
            self.reservation = await self._reserve(terms)
        self.reservation_alive_at = time.monotonic()
        return self.reservation.max_tokens_applied

    async def _reserve(self, terms: dict):
        hold = asyncio.ensure_future(gateway.reserve(**terms))
        try:
            return await asyncio.shield(hold)
        except (BudgetExceeded, DatabaseBusy) as error:
            raise metering_refusal(error) from None
        except asyncio.CancelledError:
            # The client left while the hold was being made: let it finish and keep it, so
            # that `finish` releases it now rather than the sweep half an hour later.
            with contextlib.suppress(Exception):
                self.reservation = await hold
            raise

    def keep_reservation_alive(self) -> None:
        """Mark the hold alive once every `gateway.hold_heartbeat_s()` while the request
        runs, so that the sweep of stale holds cannot free it under a long stream."""
        now = time.monotonic()
        if now - self.reservation_alive_at >= gateway.hold_heartbeat_s():
            self.reservation_alive_at = now
            gateway.keep_alive(self.reservation)


def _usage_tokens(body: dict) -> tuple[int, int] | None:
    usage = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(usage, dict):
        return None
    return int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)


async def completion_run(
    *,
    key,
    payload: dict,
    request_id: str,
    endpoint: str = "completions",
    workload: str = "",
    settle_in_background: bool = False,
    fence=None,
    relay_large: bool = False,
) -> "CompletionResult":
    """Serve one non-streaming completion body for `key` exactly as POST /v1/completions
    does; never raises ApiError (errors come back as a result with the error envelope).

    The budget is settled and the usage recorded before returning, unless
    `settle_in_background` (the HTTP view: the client gets its body without waiting for
    those writes; `background.pending()` counts the ones still running). `fence` (a job's
    worker: `infra.lifecycle.Attempt.fence_steps`) bills nothing when its attempt no longer
    holds the job (`metering.gateway.meter`).

    `relay_large` (the HTTP endpoint; a job stores its result whole): an answer that
    `relay.relayable` comes back as soon as the upstream's headers are in, as a result whose
    `relay` the caller sends (`Relay`); its admission slot, full-vocabulary slot and hold
    stay taken, and it is settled and metered, when the relay ends."""
    state = _Request(
        key=key,
        payload=payload,
        request_id=request_id,
        endpoint=endpoint,
        workload=workload,
        stream=False,
        fence=fence,
    )
    try:
        result = await _run(state, relay_large=relay_large)
    except BaseException:
        # The client went away (the only way this raises): billed as a stream whose client
        # goes, its prompt once the upstream took the request (its prefill may have run);
        # what it generated before the connection closed is not known.
        if state.reservation is not None and state.upstream_started is not None:
            state.prompt_tokens = state.valid.prompt_tokens
        await state.finish(status=499, error_code="client_disconnected")
        raise
    if result.relay is not None:
        return result  # settled by the relay's end
    if settle_in_background:
        state.finish_in_background(status=state.status, error_code=state.error_code)
    else:
        await state.finish(status=state.status, error_code=state.error_code)
    return result


async def _run(state: "_Request", *, relay_large: bool = False) -> "CompletionResult":
    try:
        state.valid = await validate_completion(state.payload)
        if state.valid.request.stream:
            raise ApiError("invalid_request", "Use the streaming endpoint for stream: true.")
        async with contextlib.AsyncExitStack() as stack:
            max_tokens = await state.admit_and_reserve(stack)
            state.upstream_started = time.perf_counter()
            body = dialect.upstream_body(state.valid, max_tokens=max_tokens)
            if relay_large and RELAY_LARGE_ANSWERS and relay.relayable(state.valid):
                return await _opened_relay(state, body, stack)
            reply = await fanout.send_completion(state.valid, body, tenant=state.tenant)
            state.upstream_ms = reply.upstream_ms
            state.ttft_ms = state.elapsed_ms()
        usage = _usage_tokens(reply.body)
        if usage is not None:
            state.prompt_tokens, state.completion_tokens = usage
        body, content = reply.body, reply.content
        if dialect.public_answer(body, state.valid):
            content = None
        if body.get("model") != state.valid.model.name:
            body["model"] = state.valid.model.name
            content = None
        headers = {"Server-Timing": state.server_timing(), **state.clamp_headers()}
        state.status, state.error_code = 200, ""
        return CompletionResult(200, body, headers, content)
    except ApiError as error:
        state.status, state.error_code = error.status, error.code
        if (usage := _usage_tokens({"usage": error.usage})) is not None:
            state.prompt_tokens, state.completion_tokens = usage
        return CompletionResult(error.status, error.body(), error.headers())
    except Exception as failure:
        logger.exception("completion %s failed", state.request_id)
        error = unexpected_error(failure, state.request_id)
        state.status, state.error_code = error.status, error.code
        return CompletionResult(error.status, error.body(), error.headers())
    finally:
        if state.upstream_started is not None and state.upstream_ms is None:
            state.upstream_ms = (time.perf_counter() - state.upstream_started) * 1000


async def _opened_relay(state: "_Request", body: dict, stack) -> "CompletionResult":
    """The result of a request whose answer is relayed as it arrives, once the upstream's
    status and headers are in (an error before them raises its ApiError here). The relay
    takes over `stack` (the admission and full-vocabulary slots, and the upstream's
    response)."""
    chunks = await stack.enter_async_context(
        upstream.open_completion(state.valid.urls, body, tenant=state.tenant)
    )
    answer = Relay(state, chunks, stack.pop_all())
    state.status, state.error_code = 200, ""
    headers = {"Server-Timing": state.server_timing(), **state.clamp_headers()}
    return CompletionResult(200, {}, headers, relay=answer)


class Relay:
    """An answer relayed to the client as the upstream sends it (`api.relay`): `pieces()`
    yields its public bytes; `end()`, once the last was sent (or with the failure that ended
    the relay early: the client gone, the upstream failing mid-body), releases the request's
    slots and the upstream's response, then settles and meters it.

    Billed: the `usage` the upstream's body ends with (read from its tail); where the body
    ended without one, the hold's worst case (prompt tokens + max_tokens per sequence),
    logged; where the relay ended early, the prompt tokens, as a stream cut off is billed
    (the usage comes last, and the upstream took the request)."""

    def __init__(self, state: "_Request", chunks, stack: contextlib.AsyncExitStack):
        self.state = state
        self._chunks = chunks
        self._stack = stack
        valid = state.valid
        self._public = relay.PublicBody(
            model_name=valid.model.name, keep_token_ids=bool(valid.request.return_token_ids)
        )
        self._pieces = self._public_pieces()
        self._ended = False

    def pieces(self):
        return self._pieces

    async def _public_pieces(self):
        state = self.state
        async for chunk in self._chunks:
            if state.ttft_ms is None:
                state.ttft_ms = state.elapsed_ms()
            state.keep_reservation_alive()
            piece = self._public.feed(chunk)
            if piece:
                yield piece
        state.upstream_ms = (time.perf_counter() - state.upstream_started) * 1000
        last = self._public.end()
        if last:
            yield last

    async def end(self, failure: BaseException | None = None) -> None:
        """Release, settle and meter the request (once); `failure` ended the relay early."""
        if self._ended:
            return
        self._ended = True
        state = self.state
        try:
            await self._pieces.aclose()
            await self._chunks.aclose()
        finally:
            await self._stack.aclose()
        status, error_code = 200, ""
        if isinstance(failure, (asyncio.CancelledError, GeneratorExit)):
            status, error_code = 499, "client_disconnected"
        elif isinstance(failure, ApiError):
            status, error_code = failure.status, failure.code
            logger.warning("relay of %s broken mid-body: %s", state.request_id, failure.code)
        elif failure is not None:
            logger.error("relay of %s failed", state.request_id, exc_info=failure)
            status, error_code = 500, "internal_error"
        usage = _usage_tokens({"usage": self._public.usage()})
        if usage is not None:
            state.prompt_tokens, state.completion_tokens = usage
        elif failure is None:
            logger.warning(
                "the upstream's answer to %s (%d bytes) ended without usage: billing its "
                "hold's worst case",
                state.request_id,
                self._public.upstream_bytes,
            )
            state.prompt_tokens = state.valid.prompt_tokens
            state.completion_tokens = state.reservation.max_tokens_applied * state.valid.completions
        else:
            state.prompt_tokens, state.completion_tokens = state.valid.prompt_tokens, 0
        state.status, state.error_code = status, error_code
        await state.finish(status=status, error_code=error_code)


def _count_chunk_tokens(frame: dict) -> int:
    """Generated tokens in one stream chunk (one per choice delta unless logprobs list more)."""
    count = 0
    for choice in frame.get("choices") or ():
        logprobs = choice.get("logprobs")
        tokens = logprobs.get("tokens") if isinstance(logprobs, dict) else None
        count += len(tokens) if tokens else (1 if choice.get("text") else 0)
    return count


async def _with_keepalive(frames):
    """Yield the frames of `frames`, and None after each KEEPALIVE_S of silence."""
    iterator = frames.__aiter__()
    pending = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(iterator.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=KEEPALIVE_S)
            if not done:
                yield None
                continue
            try:
                item = pending.result()
            except StopAsyncIteration:
                return
            finally:
                pending = None
            yield item
    finally:
        if pending is not None:
            pending.cancel()


class StreamOpened:
    """What `completion_stream` yields first when the stream is ready: its headers."""

    def __init__(self, headers: dict):
        self.headers = headers


async def completion_stream(*, key, payload: dict, request_id: str, workload: str = ""):
    """An async generator serving a `stream: true` body. Its first item is either a
    `CompletionResult` (an error before the stream opened; nothing follows) or a
    `StreamOpened`; every later item is SSE bytes to relay."""
    state = _Request(
        key=key,
        payload=payload,
        request_id=request_id,
        endpoint="completions",
        workload=workload,
        stream=True,
    )
    status, error_code, opened, finished = 500, "internal_error", False, False
    try:
        state.valid = await validate_completion(payload)
        include_usage = bool(
            state.valid.request.stream_options and state.valid.request.stream_options.include_usage
        )
        rename = state.valid.model.upstream_model_name != state.valid.model.name
        steered = bool(state.valid.request.apply_steering_vectors)
        state.prompt_tokens = state.valid.prompt_tokens
        async with contextlib.AsyncExitStack() as stack:
            max_tokens = await state.admit_and_reserve(stack)
            state.upstream_started = time.perf_counter()
            frames = await stack.enter_async_context(
                fanout.open_stream(
                    state.valid,
                    dialect.upstream_body(state.valid, max_tokens=max_tokens),
                    tenant=state.tenant,
                )
            )
            status, error_code, opened = 200, "", True
            yield StreamOpened({"Server-Timing": state.server_timing(), **state.clamp_headers()})
            async for raw in _with_keepalive(frames):
                # Runs at least every KEEPALIVE_S, however slow the upstream.
                state.keep_reservation_alive()
                if raw is None:
                    yield b": keepalive\n\n"
                    continue
                if raw == b"[DONE]":
                    state.upstream_ms = (time.perf_counter() - state.upstream_started) * 1000
                    # Settled before [DONE]: a client that has read it finds its usage and
                    # budgets already current (and SDKs stop reading at [DONE]).
                    await state.finish(status=status, error_code=error_code)
                    finished = True
                    yield b"data: [DONE]\n\n"
                    break
                frame = upstream.finite_json(raw, steered=steered)
                if "error" in frame:
                    raise upstream.map_stream_error(frame)
                usage = _usage_tokens(frame)
                if usage is not None and not frame.get("choices"):
                    state.prompt_tokens, state.completion_tokens = usage
                    if not include_usage:
                        continue
                else:
                    if state.ttft_ms is None:
                        state.ttft_ms = state.elapsed_ms()
                    state.completion_tokens += _count_chunk_tokens(frame)
                if dialect.public_fields(frame, state.valid, chunk=True) or rename:
                    frame["model"] = state.valid.model.name
                    raw = json.dumps(frame, separators=(",", ":")).encode()
                yield b"data: " + raw + b"\n\n"
    except (asyncio.CancelledError, GeneratorExit):
        # The client went away: settle what was generated so far (the prompt was counted
        # when the hold was made: its prefill may have run).
        status, error_code = 499, "client_disconnected"
        if state.reservation is None:
            state.prompt_tokens = 0
        raise
    except Exception as failure:
        if isinstance(failure, ApiError):
            error = failure
        else:
            logger.exception("stream %s failed", request_id)
            error = unexpected_error(failure, request_id)
        # Recorded with the error's status even once the 200 went out (the client then reads
        # the error in the stream's last frame): the usage record says how the request ended.
        status, error_code = error.status, error.code
        # Billed as the same request without streaming is: the usage the upstream reported
        # beside its error, else the prompt once the upstream took the request (its prefill
        # ran), else nothing.
        if (usage := _usage_tokens({"usage": error.usage})) is not None:
            state.prompt_tokens, state.completion_tokens = usage
        elif not opened:
            state.prompt_tokens = 0
        if opened:
            yield sse_error_frame(error)
        else:
            yield CompletionResult(error.status, error.body(), error.headers())
    finally:
        if state.upstream_started is not None and state.upstream_ms is None:
            state.upstream_ms = (time.perf_counter() - state.upstream_started) * 1000
        if not finished:
            await state.finish(status=status, error_code=error_code)
