"""Service-wide switches."""

from django.db import transaction

from accounts.models import ServiceSettings, User

from .audit import audit_log


def service_spend_cap_set(*, paused: bool, acting_user: User, reason: str = "") -> None:
    """Pause (429 spend_cap on every request) or resume all API traffic."""
    with transaction.atomic():
        current = ServiceSettings.objects.select_for_update().get_or_create(pk=1)[0]
        before = {"spend_cap_paused": current.spend_cap_paused}
        current.spend_cap_paused = paused
        current.spend_cap_reason = reason
        current.updated_by = acting_user
        current.save()
        audit_log(
            actor=acting_user,
            action="service.spend_cap",
            target=current,
            before=before,
            after={"spend_cap_paused": paused},
            note=reason,
        )
