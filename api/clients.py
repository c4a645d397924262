"""Connection pools bound to the running event loop. Completions and tokenization go to
upstreams through aiohttp (`upstream_session`); other outbound calls (an upstream's /health
and /tokenizer.json) through one httpx client per loop (`http_client`). A Celery worker's
async_to_sync makes a new loop per call, so pools are never shared across loops. Redis
clients come from `infra.redis`."""

import asyncio
import weakref
from contextlib import asynccontextmanager

import aiohttp
import httpx

from infra.background import on_server_loop

# Seconds an idle upstream connection stays pooled: below the 5 s after which uvicorn (the
# embedded engine's server, and vLLM's) closes an idle connection, so that no request is sent
# on a connection the upstream is closing at that moment.
UPSTREAM_KEEPALIVE_S = 4.0

_http_by_loop: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncClient]" = (
    weakref.WeakKeyDictionary()
)
_session_by_loop: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, aiohttp.ClientSession]"
_session_by_loop = weakref.WeakKeyDictionary()


def _new_session() -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=1024, keepalive_timeout=UPSTREAM_KEEPALIVE_S)
    # No cookies: an upstream's cookies mean nothing to the gateway, and the jar costs CPU.
    return aiohttp.ClientSession(connector=connector, cookie_jar=aiohttp.DummyCookieJar())


@asynccontextmanager
async def upstream_session():
    """The aiohttp session for a call to an upstream. On the ASGI server's loop
    (`on_server_loop`): one pool for the loop's life, closed by `upstream_sessions_close` at
    shutdown. On another loop (a Celery task's async_to_sync, which ends with its call): a
    session of its own, closed when the block ends.

    aiohttp's pool, not httpx's: httpx's scans every pooled connection with a socket check
    per request, 19% of the gateway's CPU at 64 connections (py-spy), and aiohttp's gave the
    gateway 2.5-3x the requests/s there (bench/gateway.py, docs/performance.md)."""
    if not on_server_loop.get():
        async with _new_session() as session:
            yield session
        return
    loop = asyncio.get_running_loop()
    session = _session_by_loop.get(loop)
    if session is None or session.closed:
        session = _session_by_loop[loop] = _new_session()
    yield session


async def upstream_sessions_close() -> None:
    """Close the current loop's upstream session (at server shutdown)."""
    session = _session_by_loop.pop(asyncio.get_running_loop(), None)
    if session is not None:
        await session.close()


def http_client() -> httpx.AsyncClient:
    """The running loop's httpx client."""
    loop = asyncio.get_running_loop()
    client = _http_by_loop.get(loop)
    if client is None:
        client = httpx.AsyncClient(
            limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256),
            timeout=httpx.Timeout(connect=5.0, read=None, write=30.0, pool=30.0),
        )
        _http_by_loop[loop] = client
    return client
