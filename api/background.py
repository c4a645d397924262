"""Work that outlives the request that started it: settling and metering after the response,
releasing an admission slot. Each task is referenced until it finishes (asyncio keeps only
weak references) and counted, so tests can wait until the gateway's writes are done."""

import asyncio

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
