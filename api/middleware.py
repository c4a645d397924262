"""Gives every /v1 request an id (a safe inbound X-Request-Id is kept) and every /v1
response its X-Request-Id header, and a Content-Length when it is not streamed (the gateway's
lean middleware chain has no CommonMiddleware to add it). An exception a /v1 view did not
handle becomes the API's 500 envelope (503 redis_unavailable for Redis), not Django's HTML
error page. `host_refusal` applies ALLOWED_HOSTS to /v1 (acs_portal.asgi calls it)."""

import functools
import logging
import re
import uuid

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.conf import settings
from django.http.request import split_domain_port, validate_host

from .errors import ApiError, error_response, unexpected_error

logger = logging.getLogger(__name__)

_SAFE_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")


def request_id_from(inbound: str) -> str:
    """`inbound` (an X-Request-Id header value) if it is safe to echo, else a new id."""
    return inbound if _SAFE_REQUEST_ID.match(inbound) else f"req_{uuid.uuid4().hex}"


def request_id_for(request) -> str:
    return request_id_from(request.headers.get("X-Request-Id", ""))


@functools.lru_cache(maxsize=1024)
def _host_allowed(host: str, allowed_hosts: tuple[str, ...]) -> bool:
    # Cached: Django's parsing and matching cost ~30 µs, on every request of the hot path.
    domain, _ = split_domain_port(host)
    return bool(domain) and validate_host(domain, allowed_hosts)


def host_refusal(headers: list[tuple[bytes, bytes]]) -> ApiError | None:
    """400 host_not_allowed unless the request's ASGI `headers` hold exactly one Host header
    and it names one of ALLOWED_HOSTS, as Django checks it for the portal's pages. The
    gateway runs none of Django's host checking (its hot path no Django request at all), so
    a DNS-rebound or misrouted request would otherwise be served under any name. Two Host
    headers are refused whatever they name (RFC 9112 §3.2): a proxy may route by one while
    the gateway reads the other."""
    hosts = [value for name, value in headers if name == b"host"]
    if len(hosts) > 1:
        return ApiError(
            "host_not_allowed", f"The request carries {len(hosts)} Host headers; send one."
        )
    host = hosts[0].decode("latin-1") if hosts else ""
    if _host_allowed(host, tuple(settings.ALLOWED_HOSTS)):
        return None
    return ApiError("host_not_allowed", f"This server does not answer for the host {host[:100]!r}.")


class RequestIdMiddleware:
    async_capable = True
    sync_capable = True

    def __init__(self, get_response):
        self.get_response = get_response
        if iscoroutinefunction(get_response):
            markcoroutinefunction(self)

    def __call__(self, request):
        if iscoroutinefunction(self):
            return self._acall(request)
        request.request_id = request_id_for(request)
        return self._tag(request, self.get_response(request))

    async def _acall(self, request):
        request.request_id = request_id_for(request)
        return self._tag(request, await self.get_response(request))

    def process_exception(self, request, exception):
        if not request.path.startswith("/v1/"):
            return None
        rid = getattr(request, "request_id", None) or request_id_for(request)
        logger.error(
            "%s %s failed (request %s)", request.method, request.path, rid, exc_info=exception
        )
        return error_response(unexpected_error(exception, rid), rid)

    @staticmethod
    def _tag(request, response):
        if request.path.startswith("/v1/") and not response.has_header("X-Request-Id"):
            response["X-Request-Id"] = request.request_id
        if not response.streaming and not response.has_header("Content-Length"):
            response["Content-Length"] = str(len(response.content))
        return response
