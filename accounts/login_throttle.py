"""Login throttling. Wrong passwords are counted against three subjects at once, each with its
own limit within a window of ACS_LOGIN_LOCKOUT_SECONDS from its first failure:

- an account from one IP address (ACS_LOGIN_FAILURE_LIMIT, 5): that pair is locked for
  ACS_LOGIN_LOCKOUT_SECONDS; other addresses and accounts are unaffected;
- an account from addresses it has not signed in from (ACS_LOGIN_ACCOUNT_FAILURE_LIMIT,
  20): guesses spread over many addresses lock the account at every such address, for
  ACS_LOGIN_LOCKOUT_SECONDS, twice that at the next lock, and so on up to
  ACS_LOGIN_LOCKOUT_MAX_SECONDS (a day), until a day passes without a lock or staff lift it.
  An address the account signed in from with the right password within
  ACS_LOGIN_KNOWN_ADDRESS_SECONDS (a `LoginAddress`) is neither locked nor counted here:
  otherwise whoever knows an e-mail address could lock its owner out (the pair and address
  limits still hold there);
- an address across accounts (ACS_LOGIN_ADDRESS_FAILURE_LIMIT, 50): one address spraying
  passwords over many accounts is locked for ACS_LOGIN_LOCKOUT_SECONDS.

A locked attempt is refused before the password is checked, so it tells nothing. Unknown
accounts are counted and locked the same. Every lock writes an audit row.

Every form of the site that checks a secret of an account goes through `login_attempt`: the
login pages (the portal's and the admin's), the admin's password change, and staff's
second-factor codes (accounts/forms.py). A wrong code counts as a wrong password would: the
same counts, so whoever has a staff password cannot guess codes faster than passwords.

The counters live in PostgreSQL, not Redis: login is not a hot path, the counts are exact
across replicas under row locks, and throttling holds while Redis is down or after it
restarts empty (a Redis counter would have to fail open, letting guesses through, or
closed, locking everyone out of the portal, for as long as Redis is away).
"""

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from .models import LoginAddress, LoginThrottle, User
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


@dataclass(frozen=True)
class Attempt:
    """What became of one attempt: whether its secret was right, and the lock that refused it
    unchecked or that its wrong secret set (None when neither)."""

    right: bool
    lock: Lock | None = None


def login_attempt(*, username: str, ip: str, check: Callable[[], bool]) -> Attempt:
    """One attempt to prove who `username` is from `ip`: refused unchecked while they are
    locked, else `check()` (whether the password or code typed is right) decides, and a wrong
    one is counted (`login_failed`). A right one forgets nothing: the caller calls
    `login_succeeded` once the whole sign-in is done (after the second factor, for staff)."""
    if lock := login_lock(username=username, ip=ip):
        return Attempt(right=False, lock=lock)
    if check():
        return Attempt(right=True)
    return Attempt(right=False, lock=login_failed(username=username, ip=ip))


def _subjects(username: str, ip: str, now) -> dict[str, str]:
    """The digests of what an attempt to sign in as `username` from `ip` is counted and locked
    against: the account only from an address it has not lately signed in from."""
    account = username.strip().lower()
    subjects = {Scope.PAIR: _pair_digest(account, ip), Scope.ADDRESS: _digest(ip)}
    if not _known_address(username, ip, now):
        subjects[Scope.ACCOUNT] = _digest(account)
    return subjects


def _pair_digest(account: str, ip: str) -> str:
    return _digest(f"{account}\n{ip}")


def _known_address(username: str, ip: str, now) -> bool:
    # The e-mail address as typed: the backend signs in only its exact match.
    return LoginAddress.objects.filter(
        user__email=username, ip=ip, last_login_at__gt=_known_since(now)
    ).exists()


def _known_since(now):
    return now - timedelta(seconds=settings.ACS_LOGIN_KNOWN_ADDRESS_SECONDS)


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
    locked = _rows(_subjects(username, ip, now)).filter(locked_until__gt=now)
    return max(
        (Lock(row.scope, _seconds_left(row, now)) for row in locked),
        key=lambda lock: lock.seconds,
        default=None,
    )


def _seconds_left(row: LoginThrottle, now) -> int:
    return max(int((row.locked_until - now).total_seconds() + 0.999), 1)


def login_failed(*, username: str, ip: str, now=None) -> Lock | None:
    """Count one wrong password against the pair, the address and (from an address it has not
    signed in from) the account; returns the longest lock this failure set (None while under
    every limit). Each lock writes an audit row."""
    now = now or timezone.now()
    subjects = _subjects(username, ip, now)
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


def login_succeeded(*, user: User, ip: str, now=None) -> None:
    """Forget `user`'s failures from this address, and record it as an address they signed in
    from (spared their account's lock from now on). The account's count from all addresses
    stays, and so does the growth of its lockouts: its owner gets in without forgetting them,
    and forgetting them would give whoever guesses from elsewhere a fresh start at each of
    the owner's logins. The address's count across accounts stays too."""
    now = now or timezone.now()
    with transaction.atomic():
        LoginThrottle.objects.filter(
            scope=Scope.PAIR, subject=_pair_digest(user.email.strip().lower(), ip)
        ).delete()
        LoginAddress.objects.bulk_create(
            [LoginAddress(user=user, ip=ip, last_login_at=now)],
            update_conflicts=True,
            unique_fields=["user", "ip"],
            update_fields=["last_login_at"],
        )


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
    after which an account's lockouts no longer grow), and addresses no longer spared their
    account's lock; returns how many rows."""
    now = now or timezone.now()
    window = timedelta(seconds=settings.ACS_LOGIN_LOCKOUT_SECONDS)
    quiet = timedelta(seconds=settings.ACS_LOGIN_LOCKOUT_MAX_SECONDS)
    with transaction.atomic():
        counts, _ = (
            LoginThrottle.objects.filter(window_started_at__lt=now - window)
            .filter(Q(locked_until=None) | Q(locked_until__lt=now - quiet))
            .delete()
        )
        addresses, _ = LoginAddress.objects.filter(last_login_at__lte=_known_since(now)).delete()
    return counts + addresses
