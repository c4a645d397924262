"""The step runner of the money path, sync and async.

The budget and usage writes run on every API request, so they are plain SQL (the ORM cost
several milliseconds of CPU per request on these machines), written as *step generators*:
a generator yields a batch of `(sql, params)` statements to run in one round trip, receives
the rows of the batch's last statement that returns rows, and finally returns its result.
`run_steps` runs one in a transaction on Django's connection; `run_steps_async` runs the same
generators for the async gateway: on the ASGI server's event loop with PostgreSQL, over a
per-loop async connection pool, which spares every request's budget hold a thread hop and
the ORM; anywhere else (SQLite, or a short-lived loop such as a Celery task's
`async_to_sync`) in a worker thread on Django's connection. `run_db` runs a sync ORM
function in a worker thread.
"""

import asyncio
import functools
import weakref

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import close_old_connections, connection, connections, transaction
from psycopg import AsyncClientCursor, OperationalError
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from infra.background import on_server_loop

Statements = list[tuple[str, list]]

# On PostgreSQL, lets the current transaction's COMMIT return before its WAL reaches disk
# (for this transaction only). Locks, constraints and consistency are unchanged; only a crash
# of the database server itself can lose the last fraction of a second of holds and usage.
# That trade saves one disk flush (about 3 ms on this project's machines) on every API
# request's hot path.
NO_FLUSH_WAIT = ("SET LOCAL synchronous_commit = off", [])
# May end the last batch of a step generator that is run on its own (not composed into a
# bigger transaction): the async driver then commits in that round trip instead of another.
# The sync driver leaves committing to its atomic block.
COMMIT = ("COMMIT", [])


class MissingRows(Exception):
    """Raised by a step generator when rows it needs do not exist yet: the driver rolls
    back, calls `create()` and runs the steps again."""

    def create(self) -> None:
        raise NotImplementedError


class DatabaseBusy(Exception):
    """No pooled connection freed up in time, or the database ended the connection while
    the transaction was committing (it may have been written): the gateway answers 503
    db_pool_exhausted."""


def run_steps(make_steps):
    """Run the step generator `make_steps()` in one transaction on Django's connection and
    return its result (creating missing rows and starting again if it asks)."""
    while True:
        try:
            with transaction.atomic(), connection.cursor() as cursor:
                steps, rows = make_steps(), None
                while True:
                    try:
                        batch = steps.send(rows)
                    except StopIteration as done:
                        return done.value
                    rows = _execute_in_one_trip(cursor, batch)
        except MissingRows as missing:
            missing.create()


def statements_joined(statements: Statements) -> tuple[str, list]:
    """One SQL string and parameter list for `statements`, to execute in one round trip with
    client-side parameter binding (PostgreSQL)."""
    return (
        "; ".join(sql for sql, _ in statements),
        [param for _, params in statements for param in params],
    )


def _execute_in_one_trip(cursor, statements: Statements) -> list:
    """Execute statements in order, in one round trip on PostgreSQL, and return the rows of
    the last one that returns rows. Skips `COMMIT`, and `NO_FLUSH_WAIT` on other databases."""
    statements = [statement for statement in statements if statement is not COMMIT]
    if connection.vendor == "postgresql":
        cursor.execute(*statements_joined(statements))
        return _rows_of_last_result(cursor)
    rows = []
    for statement in statements:
        if statement is not NO_FLUSH_WAIT:
            cursor.execute(*statement)
            rows = cursor.fetchall() if cursor.description else rows
    return rows


def _rows_of_last_result(cursor) -> list:
    """After a multi-statement execute: the rows of the last statement that returned any."""
    rows = cursor.fetchall() if cursor.description else []
    while cursor.nextset():
        if cursor.description:
            rows = cursor.fetchall()
    return rows


# How long a request waits for a pooled connection before it is answered 503
# db_pool_exhausted. At most ACS_DB_POOL_MAX_SIZE connections per server process are pooled
# for the hot path (Django's own per-thread connections come on top).
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


def int_array(values) -> str:
    """`values` (ints) as a PostgreSQL array literal, for a `%s::bigint[]` parameter:
    psycopg quotes a list element by element in Python (~0.5 µs each), and the lease
    writer's batches send hundreds."""
    return "{" + ",".join(map(str, map(int, values))) + "}"


async def run_steps_async(make_steps):
    """`run_steps` for async callers: the step generator `make_steps()` runs in one
    transaction and its result is returned (its exceptions are raised); `DatabaseBusy` when
    no pooled connection frees up in time, or when the database ended the connection while
    the transaction was committing (it may have been written)."""
    if not on_server_loop.get() or not on_postgresql():
        return await run_db(run_steps, make_steps)
    pool = await _pool()
    # The database may have ended every connection of the pool at once (a restart, a
    # failover, an administrator): each broken one is discarded, so the last try gets a
    # new connection.
    tries = pool.max_size + 1
    while True:
        try:
            return await _run_on(pool, make_steps())
        except MissingRows as missing:
            await run_db(missing.create)
        except _ConnectionLost as error:
            tries -= 1
            if not tries or not error.retryable:
                raise DatabaseBusy("The database connection was lost; retry.") from None
        except PoolTimeout:
            raise DatabaseBusy(
                f"Every database connection was busy for {POOL_TIMEOUT_S:.0f} s."
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
                rows = await _rows_of_last_result_async(cursor)
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


async def _rows_of_last_result_async(cursor) -> list:
    """`_rows_of_last_result` for an async cursor."""
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
            max_size=settings.ACS_DB_POOL_MAX_SIZE,
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
