"""The ASGI entry point: the portal and the /v1 gateway in one process.

/v1/completions, the hot path, is a plain ASGI application (`api.completions_app`). Other
/v1 requests go to a handler with only the middleware the API needs. Django runs each
classic (MiddlewareMixin) middleware in a thread hop per request under ASGI; the portal's
session, CSRF, auth and message middleware cost the API several milliseconds per request
and do nothing for it (every /v1 view authenticates by API key and is CSRF-exempt).
"""

import os

from django.conf import settings
from django.core.asgi import get_asgi_application
from django.core.handlers.asgi import ASGIHandler

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "acs_portal.settings")

portal_application = get_asgi_application()

# These need the apps loaded.
from api.completions_app import completions_app  # noqa: E402
from metering import leases  # noqa: E402
from metering.background import on_server_loop  # noqa: E402
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
    back and close its database pool."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            on_server_loop.set(True)
            await leases.drain()
            await pools_close()
            await send({"type": "lifespan.shutdown.complete"})
            return


async def application(scope, receive, send):
    if scope["type"] == "lifespan":
        return await lifespan(scope, receive, send)
    if scope["type"] == "http" and scope["path"].startswith("/v1/"):
        if scope["path"] == "/v1/completions":
            return await completions_app(scope, receive, send)
        return await gateway_application(scope, receive, send)
    return await portal_application(scope, receive, send)
