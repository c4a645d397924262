"""API-key authentication for the async gateway, with a per-process cache.

Looking a key up costs a database round trip and a worker-thread hop (about 1.4 ms here) on
every request. So a process keeps the keys it has authenticated, by a digest of the
`Authorization` header, and trusts an entry only while Redis's *access generation* is the one
it was read under, and for at most AUTH_CACHE_SECONDS. Every saved or deleted key or user,
and every change of the spend cap, bumps the generation once its transaction commits (the
receivers below), so a revoked, paused, re-scoped or re-budgeted key, a suspended account or
a paused service is seen by every replica on its next request. Code that changes a key or
user with `QuerySet.update()` bypasses the signals and must call `access_generation_bump()`
itself.
"""

import hashlib
import logging
import secrets
import time
from dataclasses import dataclass

import redis
from django.db import transaction

from accounts.models import ApiKey, Scope, User
from accounts.services.auth import (
    AuthError,
    api_key_authenticate,
    api_key_recheck,
    user_access_check,
)
from infra.redis import redis_batched, redis_sync
from metering.sql import run_db

from .errors import ApiError, redis_unavailable

logger = logging.getLogger(__name__)

GENERATION_KEY = "acs:access:generation"
AUTH_CACHE_SECONDS = 60.0
AUTH_CACHE_MAX_ENTRIES = 10_000


@dataclass
class _Entry:
    key: ApiKey
    generation: bytes | None
    expires_at: float


_cache: dict[bytes, _Entry] = {}


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
    """`authenticate` for an `Authorization` header value. The key returned may be shared
    with concurrent requests: treat it as read-only."""
    digest = hashlib.sha256(f"{scope}\n{authorization}".encode()).digest()
    # Read before the database, so a change committed in between leaves the entry stale
    # under an old generation rather than fresh-looking under the new one.
    try:
        generation = await redis_batched().execute("GET", GENERATION_KEY)
    except redis.RedisError:
        raise redis_unavailable() from None
    entry = _cache.get(digest)
    if entry and entry.generation == generation and entry.expires_at > time.monotonic():
        return entry.key
    outcome = await run_db(_authenticate, authorization, scope)
    if isinstance(outcome, AuthError):
        _cache.pop(digest, None)
        raise _refusal(outcome)
    if len(_cache) >= AUTH_CACHE_MAX_ENTRIES:
        _cache.clear()
    _cache[digest] = _Entry(outcome, generation, time.monotonic() + AUTH_CACHE_SECONDS)
    return outcome


def _refusal(error: AuthError) -> ApiError:
    return ApiError(error.code, error.message)


def key_recheck(key_id: int, *, scope: str = Scope.COMPLETIONS) -> ApiKey:
    """Synchronous: the key re-read from the database if it and its account may still call
    the API, else the ApiError `authenticate` would raise for it now. Workers call it when
    a job starts (and before each harvest batch), since a key can be revoked, paused or its
    account suspended after the job was submitted."""
    try:
        return api_key_recheck(key_id=key_id, scope=scope)
    except AuthError as error:
        raise _refusal(error) from None


def owner_recheck(*, user_id: int, key_id: int | None) -> None:
    """Synchronous: the ApiError `authenticate` would raise now for the key `key_id` (when
    given; it must belong to the user) or else for the account `user_id`, re-read from the
    database; None when they may still use the API. Signed harvest downloads call it, so a
    link stops working as soon as its key is revoked or paused or the account suspended."""
    try:
        if key_id is None:
            user_access_check(User.objects.get(pk=user_id))
        elif api_key_recheck(key_id=key_id).user_id != user_id:
            raise AuthError("invalid_api_key", "The link was issued to another account's key.")
    except AuthError as error:
        raise _refusal(error) from None


def access_generation_bump() -> None:
    """Make every process re-read keys from the database on their next request.

    The generation is a new random value, not a counter: a Redis restarted empty would count
    again from nothing, back through values that cached entries were read under, and so make
    stale entries (a revoked key) look current."""
    try:
        redis_sync().set(GENERATION_KEY, secrets.token_hex(8))
    except redis.RedisError:
        # The gateway cannot admit requests without Redis either; cached entries still
        # expire after AUTH_CACHE_SECONDS.
        logger.exception("could not bump the access generation")


def bump_after_commit(**kwargs) -> None:
    """post_save / post_delete receiver for ApiKey and User (connected in ApiConfig.ready)."""
    transaction.on_commit(access_generation_bump, using=kwargs.get("using"))
