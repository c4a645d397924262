"""Celery tasks of the playground: thin, ids in; the work is in `services`."""

from celery import shared_task
from django.conf import settings

from . import services


@shared_task(bind=True, max_retries=settings.PLAYGROUND_RUN_MAX_RETRIES, acks_late=True)
def run_execute(self, run_id: str) -> None:
    """Execute one playground run; retried only on transient API errors."""
    try:
        services.run_execute(run_id=run_id, final_attempt=self.request.retries >= self.max_retries)
    except services.RunRetry as retry:
        raise self.retry(countdown=retry.countdown) from None


@shared_task
def runs_sweep() -> int:
    """Fail playground runs stuck in queued or running (see `services.runs_fail_stuck`)."""
    return services.runs_fail_stuck()
