"""A page whose request waited in vain for a database connection is answered 503 with
Retry-After, not 500: every connection of the process's pool was busy for
ACS_ORM_POOL_TIMEOUT_SECONDS (a burst of slow pages), which passes by itself."""

from django.http import HttpResponse
from django.template.loader import render_to_string
from psycopg_pool import PoolTimeout

RETRY_AFTER_S = 5


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
