"""The audit log of changes of access or money."""

from accounts.models import AuditLog


def audit_log(*, actor, action, target, before=None, after=None, note=""):
    """Record one change of access or money. Call inside the transaction that makes it."""
    return AuditLog.objects.create(
        actor=actor,
        action=action,
        target_type=target._meta.model_name,
        target_id=str(target.pk),
        target_repr=str(target)[:200],
        before=before,
        after=after,
        note=note,
    )
