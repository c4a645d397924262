"""The audit of sign-in locks and of their lifting (`accounts.login_throttle` keeps the
locks themselves)."""

from django.db import transaction

from .audit import audit_log


def login_lock_audit(*, throttle, user, ip: str, failures: int, lockout_seconds: int):
    """Record that sign-ins of `throttle`'s subject are refused for `lockout_seconds` after
    `failures` wrong passwords, the last from `ip` (`accounts.login_throttle` keeps the lock
    itself): `user.login_locked` on the user for a lock of their account (from one address or
    from all), `login.address_locked` on the throttle for a lock of an address."""
    after = {
        "scope": throttle.scope,
        "ip": ip,
        "failures": failures,
        "lockout_seconds": lockout_seconds,
    }
    with transaction.atomic():
        if user is None:
            return audit_log(
                actor=None, action="login.address_locked", target=throttle, after=after
            )
        return audit_log(actor=None, action="user.login_locked", target=user, after=after)


def login_unlock_audit(*, user, acting_user):
    """Record that `acting_user` lifted the lock of `user`'s account (`user.login_unlocked`)."""
    return audit_log(actor=acting_user, action="user.login_unlocked", target=user, after={})
