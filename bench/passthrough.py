"""The floors `bench/gateway.py` measures the gateway against: a minimal ASGI app under uvicorn
that forwards each request (its method, path and body) to one upstream (PASSTHROUGH_UPSTREAM)
and relays its answer,
with no logic at all (no auth, limits, budgets or metering), through one client object per
process: `httpx_app` (an httpx.AsyncClient) or `aiohttp_app` (an aiohttp.ClientSession).

    PASSTHROUGH_UPSTREAM=http://127.0.0.1:8001 uvicorn bench.passthrough:aiohttp_app

A streamed answer (text/event-stream) is relayed chunk by chunk, any other read whole and sent
with its length, as the gateway does.
"""

import os

import aiohttp
import httpx

UPSTREAM = os.environ.get("PASSTHROUGH_UPSTREAM", "http://127.0.0.1:8001")
_HEADERS = {"content-type": "application/json"}


async def _read_body(receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


async def _start(send, status: int, content_type: str, length: int | None = None) -> None:
    headers = [(b"content-type", content_type.encode("latin-1"))]
    if length is not None:
        headers.append((b"content-length", str(length).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})


class _HttpxClient:
    client: httpx.AsyncClient | None = None


async def httpx_app(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    if _HttpxClient.client is None:
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
        _HttpxClient.client = httpx.AsyncClient(timeout=60, limits=limits)
    body = await _read_body(receive)
    request = _HttpxClient.client.build_request(
        scope["method"], UPSTREAM + scope["path"], content=body, headers=_HEADERS
    )
    response = await _HttpxClient.client.send(request, stream=True)
    try:
        content_type = response.headers.get("content-type", "application/json")
        if content_type.startswith("text/event-stream"):
            await _start(send, response.status_code, content_type)
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            return
        content = await response.aread()
        await _start(send, response.status_code, content_type, len(content))
        await send({"type": "http.response.body", "body": content})
    finally:
        await response.aclose()


class _AiohttpSession:
    session: aiohttp.ClientSession | None = None


async def aiohttp_app(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    if _AiohttpSession.session is None:
        connector = aiohttp.TCPConnector(limit=1024)
        _AiohttpSession.session = aiohttp.ClientSession(connector=connector)
    body = await _read_body(receive)
    async with _AiohttpSession.session.request(
        scope["method"], UPSTREAM + scope["path"], data=body, headers=_HEADERS
    ) as response:
        content_type = response.headers.get("content-type", "application/json")
        if content_type.startswith("text/event-stream"):
            await _start(send, response.status, content_type)
            async for chunk in response.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            return
        content = await response.read()
        await _start(send, response.status, content_type, len(content))
        await send({"type": "http.response.body", "body": content})
