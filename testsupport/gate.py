"""A reverse proxy that a test puts in front of an upstream to hold chosen requests until it
lets them go: background work is caught mid-way by an event, not by hoping it is still
running (a faster CPU finishes a harvest before a slower test clicks Cancel)."""

import asyncio
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx

from .servers import serve_in_thread, stop_server

# Headers of one hop, which the proxy's own connections set.
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "host", "content-length"}


@dataclass
class Request:
    """What a hold's predicate sees of a request (header names in lower case)."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes


class UpstreamGate:
    """Forwards every request to `upstream_url` as it comes (streamed answers too), except
    while a `hold` is in force. Start with `start()`; the URL to use instead of the upstream's
    is then `url`."""

    def __init__(self, upstream_url: str):
        self.upstream_url = upstream_url
        self.url = ""
        self._lock = threading.Lock()
        self._matches: Callable[[Request], bool] | None = None
        self._passes_left = 0
        self._open = threading.Event()
        self._open.set()
        self.holding = threading.Event()
        self._server = self._thread = None

    def start(self) -> None:
        self._server, self._thread, self.url = serve_in_thread(self)

    def stop(self) -> None:
        self._open.set()
        stop_server(self._server, self._thread)

    @contextmanager
    def hold(self, matches: Callable[[Request], bool], *, after: int = 0) -> Iterator[None]:
        """Within the block, requests that `matches` are let through `after` times, then held
        (`holding` is set once one waits) until the block ends."""
        with self._lock:
            self._matches, self._passes_left = matches, after
            self.holding.clear()
            self._open.clear()
        try:
            yield
        finally:
            self.release()

    def release(self) -> None:
        """End the hold: the requests it holds go on, and later ones are not held."""
        with self._lock:
            self._matches = None
            self._open.set()

    def _must_wait(self, request: Request) -> bool:
        with self._lock:
            if self._matches is None or not self._matches(request):
                return False
            if self._passes_left > 0:
                self._passes_left -= 1
                return False
            self.holding.set()
            return True

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = {
            name.decode("latin-1").lower(): value.decode("latin-1")
            for name, value in scope["headers"]
        }
        request = Request(scope["method"], scope["path"], headers, body)
        if self._must_wait(request):
            await asyncio.to_thread(self._open.wait)
        await self._forward(request, scope.get("query_string", b""), send)

    async def _forward(self, request: Request, query: bytes, send) -> None:
        url = f"{self.upstream_url}{request.path}" + (f"?{query.decode()}" if query else "")
        forwarded = {k: v for k, v in request.headers.items() if k not in HOP_BY_HOP}
        async with httpx.AsyncClient(timeout=None) as client:
            upstream_request = client.build_request(
                request.method, url, headers=forwarded, content=request.body
            )
            response = await client.send(upstream_request, stream=True)
            try:
                await send(
                    {
                        "type": "http.response.start",
                        "status": response.status_code,
                        "headers": [
                            (name.encode("latin-1"), value.encode("latin-1"))
                            for name, value in response.headers.multi_items()
                            if name.lower() not in HOP_BY_HOP
                        ],
                    }
                )
                async for chunk in response.aiter_raw():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b""})
            finally:
                await response.aclose()
