"""Connection pools bound to the running event loop: one httpx client per loop (uvicorn has
one loop; a Celery worker's async_to_sync makes a new one per call, so pools are never shared
across loops). Redis clients come from `acs_portal.redis`."""

import asyncio
import weakref

import httpx

_http_by_loop: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncClient]" = (
    weakref.WeakKeyDictionary()
)
_transport_by_loop: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncBaseTransport]"
_transport_by_loop = weakref.WeakKeyDictionary()

# Tests may replace this with an httpx.MockTransport; None = real network.
http_transport: httpx.AsyncBaseTransport | None = None


def upstream_transport() -> httpx.AsyncBaseTransport:
    """The running loop's connection pool to upstreams (`http_transport` when a test set
    one). `api.upstream` sends completions through it directly: what the client adds per
    request (a cookie jar, redirects, auth) cost about 0.3 ms of CPU here and does nothing
    for an upstream."""
    if http_transport is not None:
        return http_transport
    loop = asyncio.get_running_loop()
    transport = _transport_by_loop.get(loop)
    if transport is None:
        transport = _transport_by_loop[loop] = httpx.AsyncHTTPTransport(
            limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256)
        )
    return transport


def http_client() -> httpx.AsyncClient:
    """The running loop's client, on `upstream_transport()`'s pool."""
    loop = asyncio.get_running_loop()
    client = _http_by_loop.get(loop)
    if client is None:
        client = httpx.AsyncClient(
            transport=upstream_transport(),
            timeout=httpx.Timeout(connect=5.0, read=None, write=30.0, pool=30.0),
        )
        _http_by_loop[loop] = client
    return client
