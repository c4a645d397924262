"""Celery tasks of the linear probes: thin, ids in; the work is in `services`."""

from celery import shared_task
from django.conf import settings

from acs_client.client import AcsApiError

from .models import Probe
from .services import probe_follow, probe_harvest_cancel, probe_submit


@shared_task(acks_late=True)
def probe_submit_task(probe_id: str) -> None:
    """Submit a probe's harvest to /v1 (re-sent by the service when the API asks to retry)."""
    probe_submit(probe_id=probe_id)


@shared_task(acks_late=True)
def probe_follow_task(probe_id: str) -> None:
    """Look at a probe's harvest once (it queues itself again while the harvest runs), then
    fit the probes."""
    probe_follow(probe_id=probe_id)


@shared_task(bind=True, max_retries=settings.PLAYGROUND_RUN_MAX_RETRIES, acks_late=True)
def probe_harvest_cancel_task(self, probe_id: str) -> None:
    """Cancel a cancelled probe's harvest through /v1."""
    probe = Probe.objects.select_related("user").get(pk=probe_id)
    try:
        probe_harvest_cancel(probe=probe)
    except AcsApiError as error:
        if not error.should_retry:
            raise
        raise self.retry(countdown=error.retry_after or 1) from error
