"""Work that outlives the request that started it: settling and metering after the response,
releasing an admission slot. Each task is referenced until it finishes (asyncio keeps only
weak references) and counted, so tests can wait until the gateway's writes are done.

Only the ASGI server's event loop lives long enough for such work (and for connection pools):
a Celery task's `async_to_sync` loop ends, cancelling what is left, as soon as its call
returns. The completions app marks its requests with `on_server_loop`; code that would leave
work behind checks it and otherwise finishes the work before returning.
"""

import asyncio
import contextvars

on_server_loop: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "acs_on_server_loop", default=False
)

_tasks: set[asyncio.Future] = set()


def spawn(awaitable) -> asyncio.Future:
    """Run `awaitable` in a task of its own, not cancelled with the caller's."""
    task = asyncio.ensure_future(awaitable)
    _tasks.add(task)
    task.add_done_callback(_tasks.discard)
    return task


def pending() -> int:
    """Background tasks not finished yet."""
    return len(_tasks)
