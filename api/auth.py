"""API-key authentication for the async gateway views."""

from accounts.models import ApiKey, Scope
from accounts.services import AuthError, api_key_authenticate

from .db import run_db
from .errors import ApiError


def _authenticate(authorization, scope):
    try:
        return api_key_authenticate(authorization, scope=scope)
    except AuthError as error:
        return error


async def authenticate(request, *, scope: str = Scope.COMPLETIONS) -> ApiKey:
    """The active key (with `.user` loaded) of the request's `Authorization` header, or
    ApiError 401/403 with the contract's code."""
    return await authenticate_header(request.headers.get("Authorization"), scope=scope)


async def authenticate_header(authorization: str | None, *, scope: str) -> ApiKey:
    """`authenticate` for an `Authorization` header value."""
    outcome = await run_db(_authenticate, authorization, scope)
    if isinstance(outcome, AuthError):
        raise ApiError(outcome.status, outcome.code, outcome.message)
    return outcome
