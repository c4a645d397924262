"""Per-key and per-account admission control in Redis, so limits hold across any number of
web replicas.

Each key may have `MAX_RUNNING` requests running and `MAX_WAITING` more waiting, and may start
`STARTS_PER_MINUTE` requests per sliding minute; its account, over all its keys, the
`ACCOUNT_` limits (a request takes its key's slot, then its account's). Slots are leases, not
counters: a member of a sorted set scored by its expiry, refreshed by a heartbeat while the
request runs, so a replica that dies frees its slots when the lease runs out. Waiters are woken
by a pub/sub message when a slot frees (with a slow poll as a safety net), never by spinning.

Use `async with admission_slot(key_id, user_id):` around the work; it raises `ApiError` 429
queue_full / rate_limited with Retry-After, or 503 redis_unavailable while Redis is out of
reach, and always releases (also on cancellation).
"""

import asyncio
import contextlib
import logging
import secrets
import weakref

from redis import RedisError

from infra import background
from infra.redis import redis_async, redis_batched

from .errors import ApiError, redis_unavailable
from .limits import (
    ACCOUNT_MAX_RUNNING,
    ACCOUNT_MAX_WAITING,
    ACCOUNT_STARTS_PER_MINUTE,
    MAX_RUNNING,
    MAX_WAITING,
    STARTS_PER_MINUTE,
)

logger = logging.getLogger(__name__)

LEASE_MS = 30_000
HEARTBEAT_S = 10.0
WAKE_POLL_S = 1.0

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

_PURGE = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local expired = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now)
for i = 1, #expired do
  redis.call('ZREM', KEYS[2], expired[i])
  redis.call('ZREM', KEYS[3], expired[i])
end
"""

# KEYS: running, waiting, waiting leases, starts. ARGV: token, max running, max waiting,
# starts per minute, lease ms. Returns {outcome, retry_after_seconds}.
_ACQUIRE = (
    _NOW
    + _PURGE
    + """
local token = ARGV[1]
local lease = tonumber(ARGV[5])
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now - 60000)
if redis.call('ZCARD', KEYS[4]) >= tonumber(ARGV[4]) then
  local oldest = redis.call('ZRANGE', KEYS[4], 0, 0, 'WITHSCORES')
  return {'rate_limited', math.max(1, math.ceil((tonumber(oldest[2]) + 60000 - now) / 1000))}
end
local running = redis.call('ZCARD', KEYS[1])
local waiting = redis.call('ZCARD', KEYS[2])
local outcome
if running < tonumber(ARGV[2]) and waiting == 0 then
  redis.call('ZADD', KEYS[1], now + lease, token)
  outcome = 'run'
elseif waiting < tonumber(ARGV[3]) then
  redis.call('ZADD', KEYS[2], now, token)
  redis.call('ZADD', KEYS[3], now + lease, token)
  outcome = 'wait'
else
  return {'queue_full', 1}
end
redis.call('ZADD', KEYS[4], now, token)
for i = 1, 4 do redis.call('PEXPIRE', KEYS[i], 120000) end
return {outcome, 0}
"""
)

# KEYS: running, waiting, waiting leases. ARGV: token, max running, lease ms.
# Returns 1 when the waiter now holds a running slot, 0 to keep waiting.
_PROMOTE = (
    _NOW
    + _PURGE
    + """
local token = ARGV[1]
local lease = tonumber(ARGV[3])
if not redis.call('ZSCORE', KEYS[2], token) then
  redis.call('ZADD', KEYS[2], now, token)
end
redis.call('ZADD', KEYS[3], now + lease, token)
local free = tonumber(ARGV[2]) - redis.call('ZCARD', KEYS[1])
if free > 0 and redis.call('ZRANK', KEYS[2], token) < free then
  redis.call('ZREM', KEYS[2], token)
  redis.call('ZREM', KEYS[3], token)
  redis.call('ZADD', KEYS[1], now + lease, token)
  for i = 1, 3 do redis.call('PEXPIRE', KEYS[i], 120000) end
  return 1
end
return 0
"""
)

# KEYS: running, waiting, waiting leases. ARGV: token, channel.
_RELEASE = """
local held = redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
if held == 1 and redis.call('ZCARD', KEYS[2]) > 0 then
  redis.call('PUBLISH', ARGV[2], '1')
end
return held
"""

# KEYS: running. ARGV: token, lease ms.
_HEARTBEAT = (
    _NOW
    + """
return redis.call('ZADD', KEYS[1], 'XX', 'CH', now + tonumber(ARGV[2]), ARGV[1])
"""
)


def _keys(owner) -> list[str]:
    """The Redis keys of `owner`'s slots: a key's id, or `_account(user_id)`."""
    base = f"acs:adm:{{{owner}}}"
    return [f"{base}:run", f"{base}:wait", f"{base}:wlease", f"{base}:starts"]


def _channel(owner) -> str:
    return f"acs:adm:{{{owner}}}:free"


def _account(user_id) -> str:
    return f"account-{user_id}"


class _Scripts:
    def __init__(self, client):
        self.acquire = client.register_script(_ACQUIRE)
        self.promote = client.register_script(_PROMOTE)
        self.release = client.register_script(_RELEASE)
        self.heartbeat = client.register_script(_HEARTBEAT)


_scripts_by_client: "weakref.WeakKeyDictionary[object, _Scripts]" = weakref.WeakKeyDictionary()


def _scripts(client) -> _Scripts:
    scripts = _scripts_by_client.get(client)
    if scripts is None:
        scripts = _scripts_by_client[client] = _Scripts(client)
    return scripts


async def _wait_for_slot(client, scripts, owner, token, keys, max_running: int) -> None:
    pubsub = client.pubsub()
    await pubsub.subscribe(_channel(owner))
    try:
        while not await scripts.promote(keys=keys[:3], args=[token, max_running, LEASE_MS]):
            await pubsub.get_message(ignore_subscribe_messages=True, timeout=WAKE_POLL_S)
    finally:
        with contextlib.suppress(Exception):
            await pubsub.aclose()


async def _heartbeat(scripts, keys, token) -> None:
    while True:
        await asyncio.sleep(HEARTBEAT_S)
        # A running request goes on while Redis is away; its slot lease may then lapse.
        with contextlib.suppress(RedisError):
            await scripts.heartbeat(keys=keys[:1], args=[token, LEASE_MS])


@contextlib.asynccontextmanager
async def admission_slot(key_id, user_id):
    """Hold one running slot of the key, and one of its account (user `user_id`), for the
    body of the `async with`."""
    limits = (MAX_RUNNING, MAX_WAITING, STARTS_PER_MINUTE)
    account_limits = (ACCOUNT_MAX_RUNNING, ACCOUNT_MAX_WAITING, ACCOUNT_STARTS_PER_MINUTE)
    async with (
        _slot(key_id, limits, "This key"),
        _slot(_account(user_id), account_limits, "This account"),
    ):
        yield


@contextlib.asynccontextmanager
async def _slot(owner, limits: tuple[int, int, int], who: str):
    """Hold one running slot of `owner` (see `_keys`) within `limits` (running, waiting,
    starts per minute); `who` names the owner in a refusal."""
    max_running, max_waiting, starts_per_minute = limits
    client = redis_async()
    scripts = _scripts(client)
    batcher = redis_batched()
    keys = _keys(owner)
    token = secrets.token_hex(8)
    try:
        outcome, retry_after = await batcher.script(
            scripts.acquire, keys, [token, max_running, max_waiting, starts_per_minute, LEASE_MS]
        )
    except RedisError:
        raise redis_unavailable() from None
    outcome = outcome.decode() if isinstance(outcome, bytes) else outcome
    if outcome == "rate_limited":
        raise ApiError(
            "rate_limited",
            f"{who} started {starts_per_minute} requests in the last minute.",
            retry_after=int(retry_after),
        )
    if outcome == "queue_full":
        raise ApiError(
            "queue_full",
            f"{who} already has {max_running} requests running and {max_waiting} waiting.",
            retry_after=int(retry_after),
        )
    heartbeat = None
    try:
        if outcome == "wait":
            try:
                await _wait_for_slot(client, scripts, owner, token, keys, max_running)
            except RedisError:
                raise redis_unavailable() from None
        heartbeat = asyncio.create_task(_heartbeat(scripts, keys, token))
        yield
    finally:
        if heartbeat is not None:
            heartbeat.cancel()
        release = batcher.script(scripts.release, keys[:3], [token, _channel(owner)])
        if background.on_server_loop.get():
            # The response need not wait for Redis (the batcher sends it in any case).
            release.add_done_callback(_released)
        else:
            await asyncio.shield(release)


def _released(release: asyncio.Future) -> None:
    if not release.cancelled() and release.exception() is not None:
        logger.warning(
            "could not release an admission slot (it lapses in %d s): %r",
            LEASE_MS // 1000,
            release.exception(),
        )


async def admission_counts(key_id=None, *, user_id=None) -> dict:
    """Running and waiting requests of a key, or of an account (for tests and the staff
    overview)."""
    client = redis_async()
    keys = _keys(key_id if user_id is None else _account(user_id))
    running, waiting = await asyncio.gather(client.zcard(keys[0]), client.zcard(keys[1]))
    return {"running": running, "waiting": waiting}
