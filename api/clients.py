"""The HTTP client to upstreams: aiohttp, chosen by measurement (bench/gateway.py, issue 23).
Under 64 connections a uvicorn passthrough on one aiohttp.ClientSession served about 8x the
requests/s of one on an httpx.AsyncClient, at a third of its CPU per request.

On the ASGI server's event loop (`on_server_loop`) one session, with its connection pool, is
kept for the loop's lifetime and closed at shutdown (`sessions_close`). Anywhere else (a
Celery task's `async_to_sync` loop ends as soon as its call returns) each call gets a session
of its own, closed when the call is done: a session must not outlive its loop.
Redis clients come from `acs_portal.redis`."""

import asyncio
import weakref
from contextlib import asynccontextmanager

import aiohttp

from metering.background import on_server_loop

_sessions: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, aiohttp.ClientSession]" = (
    weakref.WeakKeyDictionary()
)

# A streamed line (one SSE frame) may be this long: a frame with top logprobs for many
# choices runs to hundreds of kilobytes, past aiohttp's default of 128 KiB.
MAX_LINE_BYTES = 16 * 1024 * 1024


def _new_session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=1024),
        # Upstreams set no cookies; a cookie jar costs CPU on every response.
        cookie_jar=aiohttp.DummyCookieJar(),
        # Ask for identity bodies, as the gateway did with httpx: compressing and
        # decompressing on loopback only spends CPU on both ends.
        skip_auto_headers=("Accept-Encoding", "User-Agent"),
        read_bufsize=MAX_LINE_BYTES // 2,
    )


@asynccontextmanager
async def upstream_session():
    """The session to send one call through (see the module docstring)."""
    if not on_server_loop.get():
        async with _new_session() as session:
            yield session
        return
    loop = asyncio.get_running_loop()
    session = _sessions.get(loop)
    if session is None or session.closed:
        session = _sessions[loop] = _new_session()
    yield session


async def sessions_close() -> None:
    """Close the current event loop's session (at server shutdown)."""
    session = _sessions.pop(asyncio.get_running_loop(), None)
    if session is not None:
        await session.close()
