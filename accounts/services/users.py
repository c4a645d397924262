"""Account status: suspension and reactivation by staff, and the state audit rows record."""

from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from accounts.models import User, UserStatus

from .audit import audit_log


def user_state(user: User) -> dict:
    """What an audit row of a change of an account's access records before and after."""
    return {
        "status": user.status,
        "monthly_token_budget": user.monthly_token_budget,
        "is_staff": user.is_staff,
    }


def user_status_change(user: User, status: str) -> None:
    """Set a (locked) account's status and when it changed; the caller audits it."""
    user.status = status
    user.status_changed_at = timezone.now()
    user.save(update_fields=["status", "status_changed_at"])


def user_suspend(*, user: User, acting_user: User | None, note: str = "") -> User:
    """Suspend an approved account: every key is refused with account_suspended."""
    return _user_status_move(
        user=user,
        acting_user=acting_user,
        note=note,
        source=UserStatus.APPROVED,
        target=UserStatus.SUSPENDED,
        action="user.suspend",
    )


def user_reactivate(*, user: User, acting_user: User | None, note: str = "") -> User:
    """Give a suspended account its access back."""
    return _user_status_move(
        user=user,
        acting_user=acting_user,
        note=note,
        source=UserStatus.SUSPENDED,
        target=UserStatus.APPROVED,
        action="user.reactivate",
    )


def _user_status_move(*, user, acting_user, note, source, target, action) -> User:
    with transaction.atomic():
        locked = User.objects.select_for_update().get(pk=user.pk)
        if locked.status != source:
            raise ValidationError(
                f"This account is {locked.status}; only {source} accounts can become {target}."
            )
        before = user_state(locked)
        user_status_change(locked, target)
        audit_log(
            actor=acting_user,
            action=action,
            target=locked,
            before=before,
            after=user_state(locked),
            note=note,
        )
    user.status, user.status_changed_at = locked.status, locked.status_changed_at
    return user
