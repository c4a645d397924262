"""Login throttling. Wrong passwords are counted against three subjects at once, each with its
own limit within a window of ACS_LOGIN_LOCKOUT_SECONDS from its first failure:

- an account from one IP address (ACS_LOGIN_FAILURE_LIMIT, 5): that pair is locked for
  ACS_LOGIN_LOCKOUT_SECONDS; other addresses and accounts are unaffected;
- an account from any address (ACS_LOGIN_ACCOUNT_FAILURE_LIMIT, 20): guesses spread over
  many addresses lock the account everywhere, for ACS_LOGIN_LOCKOUT_SECONDS, twice that at
  the next lock, and so on up to ACS_LOGIN_LOCKOUT_MAX_SECONDS (a day), until its owner
  logs in or a day passes without a lock;
- an address across accounts (ACS_LOGIN_ADDRESS_FAILURE_LIMIT, 50): one address spraying
  passwords over many accounts is locked for ACS_LOGIN_LOCKOUT_SECONDS.

A locked attempt is refused before the password is checked, so it tells nothing. Unknown
accounts are counted and locked the same. Every lock writes an audit row.

The counters live in PostgreSQL, not Redis: login is not a hot path, the counts are exact
across replicas under row locks, and throttling holds while Redis is down or after it
restarts empty (a Redis counter would have to fail open, letting guesses through, or
closed, locking everyone out of the portal, for as long as Redis is away).
"""

import hashlib
from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from .models import LoginThrottle, User
from .models import LoginThrottleScope as Scope
from .services.login import login_lock_audit, login_unlock_audit

# The setting that holds each scope's failure limit.
_LIMITS = {
    Scope.PAIR: "ACS_LOGIN_FAILURE_LIMIT",
    Scope.ACCOUNT: "ACS_LOGIN_ACCOUNT_FAILURE_LIMIT",
    Scope.ADDRESS: "ACS_LOGIN_ADDRESS_FAILURE_LIMIT",
}


@dataclass(frozen=True)
class Lock:
    """Sign-ins refused for `seconds` more, because of the counts of `scope`."""

    scope: str
    seconds: int


def _subjects(username: str, ip: str) -> dict[str, str]:
    account = username.strip().lower()
    return {
        Scope.PAIR: _digest(f"{account}\n{ip}"),
        Scope.ACCOUNT: _digest(account),
        Scope.ADDRESS: _digest(ip),
    }


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _rows(subjects: dict[str, str]):
    match = Q()
    for scope, subject in subjects.items():
        match |= Q(scope=scope, subject=subject)
    return LoginThrottle.objects.filter(match)


def login_lock(*, username: str, ip: str, now=None) -> Lock | None:
    """The longest lock on an attempt to sign in as `username` from `ip`, or None when it may
    try a password."""
    now = now or timezone.now()
    locked = _rows(_subjects(username, ip)).filter(locked_until__gt=now)
    return max(
        (Lock(row.scope, _seconds_left(row, now)) for row in locked),
        key=lambda lock: lock.seconds,
        default=None,
    )


def _seconds_left(row: LoginThrottle, now) -> int:
    return max(int((row.locked_until - now).total_seconds() + 0.999), 1)


def login_failed(*, username: str, ip: str, now=None) -> Lock | None:
    """Count one wrong password against the pair, the account and the address; returns the
    longest lock this failure set (None while under every limit). Each lock writes an audit
    row."""
    now = now or timezone.now()
    subjects = _subjects(username, ip)
    locks = []
    with transaction.atomic():
        LoginThrottle.objects.bulk_create(
            [LoginThrottle(scope=s, subject=d, window_started_at=now) for s, d in subjects.items()],
            ignore_conflicts=True,
        )
        for row in _rows(subjects).select_for_update().order_by("pk"):
            lock = _count_failure(row, now)
            if lock is not None:
                locks.append(lock)
                _audit(row, lock, username=username, ip=ip)
    return max(locks, key=lambda lock: lock.seconds, default=None)


def _count_failure(row: LoginThrottle, now) -> Lock | None:
    window = timedelta(seconds=settings.ACS_LOGIN_LOCKOUT_SECONDS)
    if now - row.window_started_at >= window:
        row.failures, row.window_started_at = 0, now
        quiet = timedelta(seconds=settings.ACS_LOGIN_LOCKOUT_MAX_SECONDS)
        if row.locked_until is None or now - row.locked_until >= quiet:
            row.locks = 0
    row.failures += 1
    lock = None
    if row.failures >= getattr(settings, _LIMITS[row.scope]):
        seconds = _lockout_seconds(row.scope, locks_before=row.locks)
        lock = Lock(row.scope, seconds)
        row.locks += 1
        row.locked_until = now + timedelta(seconds=seconds)
        # Counting starts again once the lock is over (no password is checked meanwhile).
        row.failures, row.window_started_at = 0, row.locked_until
    row.save(update_fields=["failures", "window_started_at", "locked_until", "locks"])
    return lock


def _lockout_seconds(scope: str, *, locks_before: int) -> int:
    base = settings.ACS_LOGIN_LOCKOUT_SECONDS
    if scope != Scope.ACCOUNT:
        return base
    return min(base * 2**locks_before, max(base, settings.ACS_LOGIN_LOCKOUT_MAX_SECONDS))


def _audit(row: LoginThrottle, lock: Lock, *, username: str, ip: str) -> None:
    user = None
    if row.scope != Scope.ADDRESS:
        user = User.objects.filter(email=username.strip().lower()).first()
        if user is None:  # an unknown account is locked the same, with no row to name
            return
    login_lock_audit(
        throttle=row,
        user=user,
        ip=ip,
        failures=getattr(settings, _LIMITS[row.scope]),
        lockout_seconds=lock.seconds,
    )


def login_succeeded(*, username: str, ip: str) -> None:
    """Forget the account's failures, from this address and from all (and so the growth of
    its lockouts); the address's count across accounts stays."""
    subjects = _subjects(username, ip)
    del subjects[Scope.ADDRESS]
    _rows(subjects).delete()


def login_lock_lift(*, user: User, acting_user: User) -> bool:
    """Staff lift the lock of `user`'s account from every address, and forget the growth of
    its lockouts (audited `user.login_unlocked`); returns whether there was a count to lift.
    A lock of one address for this account (its digest names no account) ends by itself
    within ACS_LOGIN_LOCKOUT_SECONDS."""
    with transaction.atomic():
        deleted, _ = LoginThrottle.objects.filter(
            scope=Scope.ACCOUNT, subject=_digest(user.email.strip().lower())
        ).delete()
        login_unlock_audit(user=user, acting_user=acting_user)
    return bool(deleted)


def login_throttles_prune(*, now=None) -> int:
    """Delete counts whose window ended and whose last lock is a day old or more (the age
    after which an account's lockouts no longer grow); returns how many."""
    now = now or timezone.now()
    window = timedelta(seconds=settings.ACS_LOGIN_LOCKOUT_SECONDS)
    quiet = timedelta(seconds=settings.ACS_LOGIN_LOCKOUT_MAX_SECONDS)
    deleted, _ = (
        LoginThrottle.objects.filter(window_started_at__lt=now - window)
        .filter(Q(locked_until=None) | Q(locked_until__lt=now - quiet))
        .delete()
    )
    return deleted
