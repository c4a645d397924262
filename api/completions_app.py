"""/v1/completions as a plain ASGI application, the gateway's hot path.

Every completion pays for whatever sits between the socket and `api.completions`; Django's
request cycle (request objects, signals, URL resolving, response classes) alone added about
2 ms per request on this project's machines, against a latency target of 2 ms for the whole
gateway. So this path reads the ASGI messages itself and calls the same services the Django
views use: authentication, `completion_run` and `completion_stream`. `acs_portal.asgi` sends
every /v1/completions request here.

A client that disconnects cancels the request's work, as Django would: the completion
functions then settle and meter what was used (status 499).
"""

import asyncio
import logging
import zlib

from accounts.models import Scope
from infra.background import on_server_loop

from .auth import authenticate_header
from .bodies import ClientGone, check_content_type, check_declared_length, decode_json, read_body
from .completions import (
    GZIP_LEVEL,
    CompletionResult,
    StreamOpened,
    completion_run,
    completion_stream,
)
from .errors import ApiError, unexpected_error
from .middleware import request_id_from

logger = logging.getLogger(__name__)


async def completions_app(scope, receive, send) -> None:
    on_server_loop.set(True)
    headers = {
        name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]
    }
    rid = request_id_from(headers.get("x-request-id", ""))
    reply = _Reply(send, rid)
    try:
        if scope["method"] != "POST":
            error = ApiError("method_not_allowed", "Use POST.")
            allow = {**error.headers(), "Allow": "POST"}
            return await reply.result(CompletionResult(error.status, error.body(), allow), "")
        key = await authenticate_header(headers.get("authorization"), scope=Scope.COMPLETIONS)
        check_content_type(headers.get("content-type"))
        check_declared_length(headers.get("content-length"))
        payload = decode_json(await read_body(receive))
    except ApiError as error:
        return await reply.result(CompletionResult(error.status, error.body(), error.headers()), "")
    except ClientGone:
        return
    except Exception as failure:
        logger.exception("completion %s failed before its work started", rid)
        error = unexpected_error(failure, rid)
        return await reply.result(CompletionResult(error.status, error.body(), error.headers()), "")
    await _cancel_on_disconnect(_serve(reply, key, payload, rid, headers), reply, receive)


async def _serve(reply, key, payload, rid, headers) -> None:
    workload = headers.get("x-acs-workload", "")
    if isinstance(payload, dict) and payload.get("stream") is True:
        frames = completion_stream(key=key, payload=payload, request_id=rid, workload=workload)
        try:
            first = await anext(frames)
            if isinstance(first, CompletionResult):
                return await reply.result(first, headers.get("accept-encoding", ""))
            await reply.stream(first, frames)
        finally:
            await frames.aclose()
        return
    result = await completion_run(
        key=key,
        payload=payload,
        request_id=rid,
        workload=workload,
        settle_in_background=True,
        relay_large=True,
    )
    if result.relay is not None:
        return await reply.relay(result, headers.get("accept-encoding", ""))
    await reply.result(result, headers.get("accept-encoding", ""))


async def _cancel_on_disconnect(work, reply: "_Reply", receive) -> None:
    """Run `work` in this task; cancel it if the client disconnects before `reply` is sent
    in full (the work then settles what it used and ends)."""
    request = asyncio.current_task()
    watcher = asyncio.ensure_future(_cancel_when_gone(request, reply, receive))
    try:
        await work
    except asyncio.CancelledError:
        if not reply.client_gone:
            raise  # the server's cancellation, not the client's
        request.uncancel()
    finally:
        watcher.cancel()


async def _cancel_when_gone(request: asyncio.Task, reply: "_Reply", receive) -> None:
    # uvicorn answers http.disconnect once the response is complete, too.
    while (await receive())["type"] != "http.disconnect":
        pass
    if not reply.complete:
        reply.client_gone = True
        request.cancel()


async def error_reply(send, error: ApiError, request_id: str) -> None:
    """Answer a request with `error` in the API's envelope (for acs_portal.asgi's checks)."""
    await _Reply(send, request_id).result(
        CompletionResult(error.status, error.body(), error.headers()), ""
    )


class _Reply:
    """Sends the response of one request, with its X-Request-Id."""

    def __init__(self, send, request_id: str):
        self.send = send
        self.request_id = request_id
        self.complete = False  # the response's last byte was sent
        self.client_gone = False  # the client disconnected before that

    async def _start(self, status: int, headers: dict) -> None:
        headers = {**headers, "X-Request-Id": self.request_id}
        await self.send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (name.lower().encode("latin-1"), str(value).encode("latin-1"))
                    for name, value in headers.items()
                ],
            }
        )

    async def result(self, result: CompletionResult, accept_encoding: str) -> None:
        content, headers = result.for_client(accept_encoding)
        headers = {
            "Content-Type": "application/json",
            "Content-Length": str(len(content)),
            **headers,
        }
        await self._start(result.status, headers)
        await self.send({"type": "http.response.body", "body": content})
        self.complete = True

    async def relay(self, result: CompletionResult, accept_encoding: str) -> None:
        """Send an answer relayed as it arrives (`completions.Relay`), gzipped as a stream
        for a client that accepts it, without a Content-Length (chunked). The request is
        settled after its last byte went out and before the response ends, so that a client
        that read it finds its usage current. A failure mid-body (the upstream's connection,
        an answer that cannot be made public) can no longer change the status: the
        connection is closed without the body's end, which the client sees as a broken
        response, never as a complete one."""
        answer = result.relay
        headers = {"Content-Type": "application/json", **result.headers, "Vary": "Accept-Encoding"}
        compressor = None
        if "gzip" in accept_encoding:
            compressor = zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, 31)
            headers["Content-Encoding"] = "gzip"
        try:
            await self._start(result.status, headers)
            async for piece in answer.pieces():
                if compressor is not None:
                    piece = compressor.compress(piece)
                if piece:
                    await self.send(
                        {"type": "http.response.body", "body": piece, "more_body": True}
                    )
            if compressor is not None:
                last = compressor.flush()
                await self.send({"type": "http.response.body", "body": last, "more_body": True})
        except ApiError as failure:
            # Returning with the response incomplete: uvicorn closes the connection.
            await answer.end(failure)
            return
        except BaseException as failure:
            await answer.end(failure)
            raise
        await answer.end()
        await self.send({"type": "http.response.body", "body": b""})
        self.complete = True

    async def stream(self, opened: StreamOpened, frames) -> None:
        headers = {
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
            **opened.headers,
        }
        await self._start(200, headers)
        async for frame in frames:
            await self.send({"type": "http.response.body", "body": frame, "more_body": True})
        await self.send({"type": "http.response.body", "body": b""})
        self.complete = True
