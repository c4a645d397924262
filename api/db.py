"""Database calls from the async gateway.

`run_db` runs a sync ORM function in a worker thread. `run_steps_async` runs the budget and
usage step generators of `accounts.services` (see `accounts.services.run_steps`): on the
ASGI server's event loop with PostgreSQL, over a per-loop async connection pool, which spares
every request's budget hold a thread hop and the ORM, each batch of statements travelling in
one round trip; anywhere else (SQLite, or a short-lived loop such as a Celery task's
`async_to_sync`) in a worker thread on Django's connection.
"""

import asyncio
import functools
import weakref

from asgiref.sync import sync_to_async
from django.db import close_old_connections, connections
from psycopg import AsyncClientCursor, OperationalError
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from accounts.services import COMMIT, WindowsMissing, run_steps, statements_joined

from .background import on_server_loop
from .errors import ApiError

# At most this many connections per server process for the hot path (Django's own
# per-thread connections come on top), and how long a request waits for one of them before
# it is answered 503 db_pool_exhausted.
POOL_MAX_SIZE = 16
POOL_TIMEOUT_S = 5.0

_pools: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncConnectionPool]" = (
    weakref.WeakKeyDictionary()
)


def _managed(function):
    @functools.wraps(function)
    def run(*args, **kwargs):
        # Worker threads never see Django's request signals, so they drop broken or expired
        # connections themselves (a no-op for a healthy persistent connection).
        close_old_connections()
        try:
            return function(*args, **kwargs)
        finally:
            close_old_connections()

    return run


async def run_db(function, *args, **kwargs):
    """Run a sync ORM function in a worker thread (not the single thread-sensitive one, so
    concurrent requests do not queue behind each other) and return its result."""
    return await sync_to_async(_managed(function), thread_sensitive=False)(*args, **kwargs)


@functools.cache
def on_postgresql() -> bool:
    """Whether the default database is PostgreSQL (read once: `connection` is a lookup in
    thread- and task-local state on every use)."""
    return connections["default"].vendor == "postgresql"


class _ConnectionLost(Exception):
    """The database ended the pooled connection mid-transaction; `retryable` when the
    transaction had sent no COMMIT, so nothing of it was written."""

    def __init__(self, *, retryable: bool):
        super().__init__("the database connection was lost")
        self.retryable = retryable


async def run_steps_async(make_steps):
    """`accounts.services.run_steps` for async callers: the step generator `make_steps()`
    runs in one transaction and its result is returned (its exceptions are raised); 503
    db_pool_exhausted when no pooled connection frees up in time, or when the database
    ended the connection while the transaction was committing (it may have been written)."""
    if not on_server_loop.get() or not on_postgresql():
        return await run_db(run_steps, make_steps)
    pool = await _pool()
    # The database may have ended every connection of the pool at once (a restart, a
    # failover, an administrator): each broken one is discarded, so the last try gets a
    # new connection.
    tries = POOL_MAX_SIZE + 1
    while True:
        try:
            return await _run_on(pool, make_steps())
        except WindowsMissing as missing:
            await run_db(missing.create)
        except _ConnectionLost as error:
            tries -= 1
            if not tries or not error.retryable:
                raise ApiError(
                    503, "db_pool_exhausted", "The database connection was lost; retry."
                ) from None
        except PoolTimeout:
            raise ApiError(
                503,
                "db_pool_exhausted",
                f"Every database connection was busy for {POOL_TIMEOUT_S:.0f} s.",
            ) from None


async def _run_on(pool: AsyncConnectionPool, steps):
    # Autocommit connections with BEGIN and COMMIT sent as statements: with the simple query
    # protocol they ride along with a batch, so a reservation takes two round trips
    # (psycopg's own transaction or pipeline blocks cost more here).
    async with pool.connection() as conn:
        cursor, rows, began, committed = conn.cursor(), None, False, False
        try:
            while True:
                try:
                    batch = steps.send(rows)
                except StopIteration as done:
                    if not committed:
                        committed = True
                        await cursor.execute("COMMIT")
                    return done.value
                if not began:
                    batch, began = [("BEGIN", []), *batch], True
                committed = batch[-1] is COMMIT
                await cursor.execute(*statements_joined(batch))
                rows = await _rows_of_last_result(cursor)
        except OperationalError as error:
            # A broken connection is closed (the pool then discards it). Whether a COMMIT it
            # was sending took effect is unknown, so only a transaction that sent none may
            # be run again.
            if conn.closed:
                raise _ConnectionLost(retryable=not committed) from error
            if began:
                await conn.rollback()
            raise
        except Exception:
            if began and not conn.closed:
                await conn.rollback()
            raise


async def _rows_of_last_result(cursor) -> list:
    """After a multi-statement execute: the rows of the last statement that returned any
    (the async twin of `accounts.services._rows_of_last_result`)."""
    rows = await cursor.fetchall() if cursor.description else []
    while cursor.nextset():
        if cursor.description:
            rows = await cursor.fetchall()
    return rows


async def _pool() -> AsyncConnectionPool:
    loop = asyncio.get_running_loop()
    pool = _pools.get(loop)
    if pool is None:
        # Django's own connection parameters (database, credentials, libpq OPTIONS such as
        # sslmode), without its sync cursor class and adapters.
        params = connections["default"].get_connection_params()
        for django_only in ("cursor_factory", "context", "prepare_threshold"):
            params.pop(django_only, None)
        pool = _pools[loop] = AsyncConnectionPool(
            min_size=1,
            max_size=POOL_MAX_SIZE,
            open=False,
            timeout=POOL_TIMEOUT_S,
            kwargs={**params, "autocommit": True, "cursor_factory": AsyncClientCursor},
        )
    await pool.open()  # a no-op once open
    return pool


async def pools_close() -> None:
    """Close the current event loop's pool (at server shutdown)."""
    pool = _pools.pop(asyncio.get_running_loop(), None)
    if pool is not None:
        await pool.close()
