"""Celery tasks of metering: the periodic sweeps, thin."""

import datetime as dt

from celery import shared_task
from django.conf import settings

from .budgets import budget_release_stale


@shared_task
def budget_release_stale_task() -> int:
    """Free the budget holds of requests that never settled and the leases never returned
    (beat: every 5 minutes); past ACS_STALE_RESERVATION_SECONDS they belong to a dead process."""
    age = dt.timedelta(seconds=settings.ACS_STALE_RESERVATION_SECONDS)
    return budget_release_stale(older_than=age)
