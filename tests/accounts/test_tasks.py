"""The sweep of stale budget holds (a Celery task of metering) and its beat schedule."""

import datetime as dt

from django.conf import settings
from django.utils import timezone

from metering.budgets import budget_reserve
from metering.models import BudgetReservation, ReservationStatus
from metering.tasks import budget_release_stale_task


def test_stale_reservations_are_released_and_fresh_ones_kept(api_key):
    stale = budget_reserve(key=api_key, prompt_tokens=5, max_tokens=5)
    fresh = budget_reserve(key=api_key, prompt_tokens=5, max_tokens=5)
    BudgetReservation.objects.filter(pk=stale.pk).update(
        alive_at=timezone.now() - dt.timedelta(minutes=31)
    )
    assert budget_release_stale_task.delay().get() == 1
    stale.refresh_from_db()
    fresh.refresh_from_db()
    assert stale.status == ReservationStatus.RELEASED
    assert fresh.status == ReservationStatus.RESERVED


def test_sweep_runs_every_five_minutes():
    entry = settings.CELERY_BEAT_SCHEDULE["metering.budget_release_stale"]
    assert entry["task"] == budget_release_stale_task.name
    assert entry["schedule"] == 300


def test_stale_age_of_the_sweep_is_a_setting(api_key, settings):
    settings.ACS_STALE_RESERVATION_SECONDS = 60
    old = budget_reserve(key=api_key, prompt_tokens=5, max_tokens=5)
    BudgetReservation.objects.filter(pk=old.pk).update(
        alive_at=timezone.now() - dt.timedelta(minutes=2)
    )
    assert budget_release_stale_task.delay().get() == 1
    old.refresh_from_db()
    assert old.status == ReservationStatus.RELEASED
