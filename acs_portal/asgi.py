"""The ASGI entry point: the portal and the /v1 gateway in one process.

/v1/completions, the hot path, is a plain ASGI application (`api.completions_app`). Other
/v1 requests go to a handler with only the middleware the API needs. Django runs each
classic (MiddlewareMixin) middleware in a thread hop per request under ASGI; the portal's
session, CSRF, auth and message middleware cost the API several milliseconds per request
and do nothing for it (every /v1 view authenticates by API key and is CSRF-exempt).

Every /v1 request first has its Host checked against ALLOWED_HOSTS (Django's own check runs
in the portal's middleware only); its body is read within ACS_REQUEST_BODY_TIMEOUT_SECONDS
(`api.bodies.read_body`: by the completions app itself, after authentication, and here for
the other /v1 views, since Django's handler would wait for a slow body without limit). A
portal request's body has the same time to arrive (`portal`), else 408.
"""

import asyncio
import gc
import os

from django.conf import settings
from django.core.asgi import get_asgi_application
from django.core.handlers.asgi import ASGIHandler

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "acs_portal.settings")

portal_application = get_asgi_application()

# These need the apps loaded.
from api.bodies import ClientGone, read_body, replaying  # noqa: E402
from api.clients import upstream_sessions_close  # noqa: E402
from api.completions_app import completions_app, error_reply  # noqa: E402
from api.errors import ApiError  # noqa: E402
from api.middleware import host_refusal, request_id_from  # noqa: E402
from infra.background import on_server_loop  # noqa: E402
from metering import leases  # noqa: E402
from metering.sql import pools_close  # noqa: E402


class GatewayHandler(ASGIHandler):
    """An ASGI handler whose middleware chain is `settings.GATEWAY_MIDDLEWARE`."""

    def load_middleware(self, is_async=False):
        # Django builds the chain from settings.MIDDLEWARE; swap it only while loading,
        # which happens once, at start-up, before any request is served.
        portal_middleware = settings.MIDDLEWARE
        settings.MIDDLEWARE = settings.GATEWAY_MIDDLEWARE
        try:
            super().load_middleware(is_async)
        finally:
            settings.MIDDLEWARE = portal_middleware


gateway_application = GatewayHandler()


async def lifespan(scope, receive, send):
    """ASGI lifespan: at shutdown, write the gateway's queued usage, give its budget leases
    back and close its database pool and its connections to upstreams."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            on_server_loop.set(True)
            await leases.drain()
            await pools_close()
            await upstream_sessions_close()
            await send({"type": "lifespan.shutdown.complete"})
            return


async def gateway(scope, receive, send):
    """A /v1 request: its Host checked, then /v1/completions to the hot path, any other to
    the gateway's Django handler with its body already read."""
    refusal = host_refusal(scope["headers"])
    if refusal is None and scope["path"] == "/v1/completions":
        return await completions_app(scope, receive, send)
    if refusal is None:
        try:
            body = await read_body(receive)
        except ClientGone:
            return
        except ApiError as error:
            refusal = error
        else:
            return await gateway_application(scope, replaying(body, receive), send)
    rid = request_id_from(dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1"))
    await error_reply(send, refusal, rid)


async def portal(scope, receive, send):
    """A portal request, to Django's handler, whose body must arrive within
    ACS_REQUEST_BODY_TIMEOUT_SECONDS as on /v1: Django reads it before anything else, and would
    wait for a slow one without limit. Past the deadline the client is answered 408 and the
    handler is told it left, so it answers nothing more."""
    deadline = asyncio.get_running_loop().time() + settings.ACS_REQUEST_BODY_TIMEOUT_SECONDS
    body_read = False

    async def receive_in_time():
        nonlocal body_read
        if body_read:  # what Django awaits later: the client's disconnect, without limit
            return await receive()
        try:
            async with asyncio.timeout_at(deadline):
                message = await receive()
        except TimeoutError:
            body_read = True
            await send(
                {
                    "type": "http.response.start",
                    "status": 408,
                    "headers": [
                        (b"content-type", b"text/plain; charset=utf-8"),
                        (b"connection", b"close"),
                    ],
                }
            )
            await send(
                {
                    "type": "http.response.body",
                    "body": f"The request body did not arrive within "
                    f"{settings.ACS_REQUEST_BODY_TIMEOUT_SECONDS} s.\n".encode(),
                }
            )
            return {"type": "http.disconnect"}
        body_read = not message.get("more_body")
        return message

    return await portal_application(scope, receive_in_time, send)


async def application(scope, receive, send):
    if scope["type"] == "lifespan":
        return await lifespan(scope, receive, send)
    if scope["type"] == "http" and scope["path"].startswith("/v1/"):
        return await gateway(scope, receive, send)
    return await portal(scope, receive, send)


# The collector, set for a server process: everything loaded by now lives as long as the
# process, so it is frozen out of the collector's scans (a full collection of those ~120,000
# objects took ~120 ms under load, stalling every request in flight); and a collection waits
# for 50,000 net new container objects instead of 700, so that the objects of requests in
# flight are not promoted to older generations at every few requests, to be found garbage
# only by a full collection. A request frees what it allocates by reference counting.
# Measured in bench/gateway.py (docs/performance.md).
gc.collect()
gc.freeze()
gc.set_threshold(50_000, 20, 10)
