"""Database faults a process lives through.

- A page whose request waited in vain for a database connection is answered 503 with
  Retry-After, not 500 (`DatabaseBusyMiddleware`): every connection of the process's pool
  was busy for ACS_ORM_POOL_TIMEOUT_SECONDS (a burst of slow pages), which passes by itself.
- A worker's write after work that cannot be done again without billing it again (a job's
  result, a run's) outlives a connection PostgreSQL ended, or a database that is back within
  a minute (`written_through_reconnects`).
"""

import logging
import time

from django.db import InterfaceError, OperationalError, close_old_connections
from django.http import HttpResponse
from django.template.loader import render_to_string
from psycopg_pool import PoolTimeout

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 5
# How long a write is tried again: within the minute a job or run may sit running after its
# work ended (the fault suite's bound), with pauses growing from 0.1 s to 5 s.
RECONNECT_WITHIN_S = 45.0


def written_through_reconnects(write, *, within_s: float = RECONNECT_WITHIN_S):
    """`write()` (database writes in a transaction of their own), called again after a
    connection failure: the broken connection is dropped, and the next call takes a new one
    from the pool. Returns what `write` returns; raises the last failure after `within_s`."""
    deadline = time.monotonic() + within_s
    pause = 0.1
    while True:
        try:
            return write()
        except (OperationalError, InterfaceError) as error:
            if time.monotonic() + pause > deadline:
                raise
            logger.warning("database write failed (%s); trying again in %.1f s", error, pause)
            close_old_connections()
            time.sleep(pause)
            pause = min(pause * 2, 5.0)


def pool_exhausted(error: BaseException) -> bool:
    """Whether `error` is a pool's timeout, as raised or as Django wraps it."""
    return isinstance(error, PoolTimeout) or isinstance(error.__cause__, PoolTimeout)


class DatabaseBusyMiddleware:
    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        return self.get_response(request)

    def process_exception(self, request, exception):
        if request.path.startswith("/v1/") or not pool_exhausted(exception):
            return None  # the API answers in JSON (api.middleware)
        # Without the request: its user would need the database.
        response = HttpResponse(render_to_string("503.html"), status=503)
        response["Retry-After"] = str(RETRY_AFTER_S)
        return response
