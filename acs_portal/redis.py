"""The one factory of Redis clients: every part of the project that talks to Redis (admission
control, the auth cache's generation, the circuit breakers, login throttling, playground
streams and caches) gets its client here, on `settings.REDIS_URL`."""

import asyncio
import weakref

import redis
import redis.asyncio as aioredis
from django.conf import settings
from redis.exceptions import ConnectionError as RedisConnectionError

# A Redis host that stopped answering (not just refusing) fails a connect within this long,
# so requests answer 503 redis_unavailable instead of waiting on the operating system's
# connect timeout (minutes).
CONNECT_TIMEOUT_S = 2.0

_sync_clients: dict[str, redis.Redis] = {}
_by_loop: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, aioredis.Redis]" = (
    weakref.WeakKeyDictionary()
)


def redis_sync() -> redis.Redis:
    """The process's synchronous client of `settings.REDIS_URL` (its connection pool is
    thread-safe; a changed setting, as in tests, gets a client of its own)."""
    url = settings.REDIS_URL
    client = _sync_clients.get(url)
    if client is None:
        client = _sync_clients[url] = redis.Redis.from_url(
            url, socket_connect_timeout=CONNECT_TIMEOUT_S
        )
    return client


def redis_sync_reset() -> None:
    """Forget the process's synchronous clients: the next `redis_sync()` connects anew."""
    _sync_clients.clear()


def redis_async() -> aioredis.Redis:
    """The running event loop's pooled asyncio client (uvicorn has one loop; a Celery
    worker's async_to_sync makes a new one per call, so pools are never shared across loops).

    A command on a pooled connection that Redis closed (a restart, a failover) is sent once
    more on a new connection, instead of failing the request that drew it from the pool. A
    command Redis ran just before the drop may so run twice: the admission and breaker
    scripts add members named by a per-request token, so that changes nothing."""
    loop = asyncio.get_running_loop()
    client = _by_loop.get(loop)
    if client is None:
        client = _by_loop[loop] = aioredis.Redis.from_url(
            settings.REDIS_URL,
            max_connections=512,
            retry_on_error=[RedisConnectionError],
            socket_connect_timeout=CONNECT_TIMEOUT_S,
        )
    return client


def redis_async_dedicated(*, socket_timeout: float) -> aioredis.Redis:
    """A new asyncio client of its own, for a long blocking read whose socket must outlast
    `socket_timeout` seconds; the caller closes it."""
    return aioredis.Redis.from_url(
        settings.REDIS_URL, socket_timeout=socket_timeout, socket_connect_timeout=CONNECT_TIMEOUT_S
    )
