"""Database calls from the async gateway."""

import functools

from asgiref.sync import sync_to_async
from django.db import close_old_connections


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
