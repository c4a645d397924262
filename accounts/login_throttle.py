"""Login throttling: after `ACS_LOGIN_FAILURE_LIMIT` wrong passwords for one account from one
IP address, sign-ins of that pair are refused, without checking the password, for
`ACS_LOGIN_LOCKOUT_SECONDS`. Another address or another account is unaffected, so an
attacker cannot lock a user out everywhere.

The counters live in Redis so that every web replica sees them. The failure window starts at
the first wrong password; the lock lasts the full lockout from the failure that set it. If
Redis is unreachable, logins are not throttled (and say so in the log) rather than refused.
"""

import hashlib
import logging

import redis
from django.conf import settings

from acs_portal.redis import redis_sync

from .models import User
from .services import user_login_lock

log = logging.getLogger(__name__)


def _key(username: str, ip: str) -> str:
    pair = f"{username.strip().lower()}|{ip}".encode()
    return f"login:failures:{hashlib.sha256(pair).hexdigest()}"


def locked_seconds(*, username: str, ip: str) -> int:
    """Seconds left of the pair's lock, 0 when it may try a password."""
    try:
        pipe = redis_sync().pipeline(transaction=False)
        pipe.get(_key(username, ip))
        pipe.ttl(_key(username, ip))
        failures, ttl = pipe.execute()
    except redis.RedisError:
        log.warning("login throttle: Redis unreachable, not checking locks", exc_info=True)
        return 0
    if failures is None or int(failures) < settings.ACS_LOGIN_FAILURE_LIMIT:
        return 0
    return max(ttl, 1)


def login_failed(*, username: str, ip: str) -> int:
    """Count one wrong password for the pair; returns the seconds of the lock this failure
    set or extended (0 while under the limit). Reaching the limit writes an audit row."""
    key = _key(username, ip)
    lockout = settings.ACS_LOGIN_LOCKOUT_SECONDS
    try:
        # One round trip: the counter is created with its expiry, so it can never outlive it.
        pipe = redis_sync().pipeline(transaction=True)
        pipe.set(key, 0, ex=lockout, nx=True)
        pipe.incr(key)
        failures = pipe.execute()[1]
        if failures == settings.ACS_LOGIN_FAILURE_LIMIT:
            redis_sync().expire(key, lockout)
    except redis.RedisError:
        log.warning("login throttle: Redis unreachable, not counting failures", exc_info=True)
        return 0
    if failures < settings.ACS_LOGIN_FAILURE_LIMIT:
        return 0
    if failures == settings.ACS_LOGIN_FAILURE_LIMIT:
        user = User.objects.filter(email=username.strip().lower()).first()
        if user is not None:  # an unknown address is locked the same, with no row to name
            user_login_lock(user=user, ip=ip, failures=failures, lockout_seconds=lockout)
    return lockout


def login_succeeded(*, username: str, ip: str) -> None:
    """Forget the pair's failures."""
    try:
        redis_sync().delete(_key(username, ip))
    except redis.RedisError:
        log.warning("login throttle: Redis unreachable, failures not cleared", exc_info=True)
