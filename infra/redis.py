"""The one factory of Redis clients: every part of the project that talks to Redis (admission
control, the auth cache's generation, the circuit breakers, login throttling, playground
streams and caches) gets its client here, on `settings.REDIS_URL`."""

import asyncio
import functools
import weakref

import hiredis
import redis
import redis.asyncio as aioredis
from django.conf import settings
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError

from infra import background

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


class _HiredisPacking:
    """Packs commands with hiredis, in C: redis-py's asyncio connections pack them in Python,
    ~9.7 µs for an admission script's EVALSHA against hiredis's ~1.1 µs (its synchronous
    connections already use hiredis). The bytes are the same."""

    def pack_command(self, *args):
        if not isinstance(args[0], str) or " " in args[0]:
            return super().pack_command(*args)  # "CLIENT SETNAME": redis-py splits it
        try:
            return [hiredis.pack_command(args)]
        except TypeError:
            return super().pack_command(*args)  # its DataError naming the bad argument

    def pack_commands(self, commands):
        return [b"".join(packed for args in commands for packed in self.pack_command(*args))]


@functools.cache
def _hiredis_packing(connection_class: type) -> type:
    return type(
        f"HiredisPacking{connection_class.__name__}", (_HiredisPacking, connection_class), {}
    )


def _async_client(url: str, **options) -> aioredis.Redis:
    client = aioredis.Redis.from_url(url, socket_connect_timeout=CONNECT_TIMEOUT_S, **options)
    pool = client.connection_pool
    # Whatever class the URL's scheme chose (TCP, TLS, a Unix socket).
    pool.connection_class = _hiredis_packing(pool.connection_class)
    return client


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
        client = _by_loop[loop] = _async_client(
            settings.REDIS_URL, max_connections=512, retry_on_error=[RedisConnectionError]
        )
    return client


def redis_async_dedicated(*, socket_timeout: float) -> aioredis.Redis:
    """A new asyncio client of its own, for a long blocking read whose socket must outlast
    `socket_timeout` seconds; the caller closes it."""
    return _async_client(settings.REDIS_URL, socket_timeout=socket_timeout)


class CommandBatcher:
    """Sends the commands that an event loop's tasks issue in one turn of the loop to Redis
    together, as one pipeline (one write, one read) instead of one exchange each.

    redis-py spends ~85 µs of CPU on one command sent alone and ~25 µs per command in a
    pipeline of 16 (its connection checkout, timeouts and socket calls are per exchange; ~22
    µs with hiredis's parser and packing). The
    gateway's hot path makes three commands per request; at 64 requests in flight they were a
    third of its CPU (py-spy, bench/gateway.py). A command found alone when the loop turns is
    sent alone, as before. Errors are those of the client's own calls: a reply error raises
    for its command only, a lost connection (after the client's one retry) for every command
    of the pipeline."""

    def __init__(self, client: aioredis.Redis):
        self.client = client
        self._queued: list[tuple[tuple, object, asyncio.Future]] = []

    def execute(self, *args) -> "asyncio.Future":
        """A future of the reply to the command `args` (as `Redis.execute_command` takes them)."""
        return self._queue(args, None)

    def script(self, script, keys: list, args: list) -> "asyncio.Future":
        """A future of the reply of `script` (what `register_script` returned), run by
        EVALSHA and loaded into a Redis that does not know it (a restarted one). Sent
        whether or not the future is awaited."""
        return self._queue(("EVALSHA", script.sha, len(keys), *keys, *args), script)

    def _queue(self, args: tuple, script) -> "asyncio.Future":
        reply = asyncio.get_running_loop().create_future()
        self._queued.append((args, script, reply))
        if len(self._queued) == 1:
            # The send starts in the loop's next turn, with every command queued until then.
            # Not cancelled with any one caller: the others wait for its replies.
            background.spawn(self._send())
        return reply

    async def _send(self) -> None:
        batch, self._queued = self._queued, []
        try:
            if len(batch) == 1:
                replies = [await self.client.execute_command(*batch[0][0])]
            else:
                pipeline = self.client.pipeline(transaction=False)
                for args, _, _ in batch:
                    pipeline.execute_command(*args)
                replies = await pipeline.execute(raise_on_error=False)
        except Exception as error:
            replies = [error] * len(batch)
        for (args, script, future), reply in zip(batch, replies, strict=True):
            if future.done():  # its caller was cancelled
                continue
            if isinstance(reply, NoScriptError) and script is not None:
                try:
                    reply = await self.client.eval(script.script, *args[2:])
                except Exception as error:
                    reply = error
                if future.done():
                    continue
            if isinstance(reply, Exception):
                future.set_exception(reply)
            else:
                future.set_result(reply)


_batchers: "weakref.WeakKeyDictionary[aioredis.Redis, CommandBatcher]" = weakref.WeakKeyDictionary()


def redis_batched() -> CommandBatcher:
    """The batcher of the running loop's `redis_async()` client, for commands on a hot path
    that many requests issue at once."""
    client = redis_async()
    batcher = _batchers.get(client)
    if batcher is None:
        batcher = _batchers[client] = CommandBatcher(client)
    return batcher
