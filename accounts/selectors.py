"""Reads for accounts, access applications, keys and the audit log."""

from django.db.models import Q

from .models import (
    AccessApplication,
    ApiKey,
    ApplicationStatus,
    AuditLog,
    KeyStatus,
    User,
)


def user_keys(*, user) -> list[ApiKey]:
    """A user's keys, newest first, revoked ones last."""
    keys = ApiKey.objects.filter(user=user).select_related("user")
    return sorted(keys, key=lambda k: k.status == KeyStatus.REVOKED)


def application_queue(*, decided_limit: int = 50) -> list[AccessApplication]:
    """Pending applications, oldest first, then the most recently decided ones."""
    base = AccessApplication.objects.select_related("user", "decided_by")
    pending = base.filter(status=ApplicationStatus.PENDING).order_by("created_at")
    decided = base.exclude(status=ApplicationStatus.PENDING).order_by("-decided_at", "-id")
    return [*pending, *decided[:decided_limit]]


def user_search(*, query: str = "", status: str = ""):
    """Users matching `query` (e-mail, name or organisation) and `status`, newest first."""
    users = User.objects.order_by("-date_joined")
    if query:
        users = users.filter(
            Q(email__icontains=query) | Q(name__icontains=query) | Q(organisation__icontains=query)
        )
    if status:
        users = users.filter(status=status)
    return users


def audit_search(*, actor: str = "", action: str = "", target: str = ""):
    """Audit rows, newest first, filtered by actor e-mail, action (prefix, e.g. `key.`) and
    target (type, id or description)."""
    rows = AuditLog.objects.select_related("actor")
    if actor:
        rows = rows.filter(actor__email__icontains=actor)
    if action:
        rows = rows.filter(action__startswith=action)
    if target:
        rows = rows.filter(
            Q(target_repr__icontains=target) | Q(target_type__iexact=target) | Q(target_id=target)
        )
    return rows


def pending_applications_count() -> int:
    return AccessApplication.objects.filter(status=ApplicationStatus.PENDING).count()
