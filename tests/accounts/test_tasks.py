"""Celery tasks and beat schedule of the accounts app."""

import datetime as dt

from django.conf import settings
from django.utils import timezone

from accounts.models import BudgetReservation, ReservationStatus
from accounts.services import budget_reserve
from accounts.tasks import release_stale_budget_reservations


def test_stale_reservations_are_released_and_fresh_ones_kept(api_key):
    stale = budget_reserve(key=api_key, prompt_tokens=5, max_tokens=5)
    fresh = budget_reserve(key=api_key, prompt_tokens=5, max_tokens=5)
    BudgetReservation.objects.filter(pk=stale.pk).update(
        alive_at=timezone.now() - dt.timedelta(minutes=31)
    )
    assert release_stale_budget_reservations.delay().get() == 1
    stale.refresh_from_db()
    fresh.refresh_from_db()
    assert stale.status == ReservationStatus.RELEASED
    assert fresh.status == ReservationStatus.RESERVED


def test_sweep_runs_every_five_minutes():
    entry = settings.CELERY_BEAT_SCHEDULE["accounts.release_stale_budget_reservations"]
    assert entry["task"] == release_stale_budget_reservations.name
    assert entry["schedule"] == 300


def test_stale_age_of_the_sweep_is_a_setting(api_key, settings):
    settings.ACS_STALE_RESERVATION_SECONDS = 60
    old = budget_reserve(key=api_key, prompt_tokens=5, max_tokens=5)
    BudgetReservation.objects.filter(pk=old.pk).update(
        alive_at=timezone.now() - dt.timedelta(minutes=2)
    )
    assert release_stale_budget_reservations.delay().get() == 1
    old.refresh_from_db()
    assert old.status == ReservationStatus.RELEASED
