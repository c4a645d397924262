import datetime as dt
import threading

import pytest
from django.db import connection
from django.utils import timezone

from accounts.models import ServiceSettings
from metering import windows
from metering.budgets import (
    BudgetExceeded,
    budget_holds_alive_steps,
    budget_release_stale,
    budget_reserve,
    budget_settle,
    harvest_quota_consume,
)
from metering.models import BudgetReservation, ReservationStatus, UsagePeriod
from metering.sql import run_steps


def key_window(key, period):
    return UsagePeriod.objects.get(key=key, period=period)


def test_reservation_holds_worst_case_and_settle_records_actual(api_key):
    reservation = budget_reserve(key=api_key, prompt_tokens=10, max_tokens=20, completions=2)
    month = key_window(api_key, windows.MONTH.name)
    assert (month.reserved_tokens, month.used_tokens) == (50, 0)
    assert budget_settle(reservation_id=reservation.pk, prompt_tokens=10, completion_tokens=7)
    month.refresh_from_db()
    assert (month.reserved_tokens, month.used_tokens) == (0, 17)
    assert (month.used_input, month.used_output) == (10, 7)
    account = UsagePeriod.objects.get(user=api_key.user, key=None)
    assert account.used_tokens == 17


def test_settling_twice_counts_once(api_key):
    reservation = budget_reserve(key=api_key, prompt_tokens=5, max_tokens=5)
    assert budget_settle(reservation_id=reservation.pk, prompt_tokens=5, completion_tokens=5)
    assert not budget_settle(reservation_id=reservation.pk, prompt_tokens=5, completion_tokens=5)
    assert key_window(api_key, windows.DAY.name).used_tokens == 10


def test_max_tokens_is_clamped_to_remaining_budget(api_key):
    api_key.daily_token_budget = 100
    api_key.save()
    reservation = budget_reserve(key=api_key, prompt_tokens=40, max_tokens=50, completions=2)
    assert (reservation.max_tokens_requested, reservation.max_tokens_applied) == (50, 30)
    assert reservation.clamped


def test_request_whose_prompt_does_not_fit_is_refused(api_key):
    api_key.daily_token_budget = 100
    api_key.save()
    with pytest.raises(BudgetExceeded) as refused:
        budget_reserve(key=api_key, prompt_tokens=100, max_tokens=1)
    assert refused.value.code == "budget_exceeded"


def test_account_budget_spans_all_keys(api_key):
    from accounts.services.keys import api_key_create

    user = api_key.user
    user.monthly_token_budget = 100
    user.save()
    second, _ = api_key_create(user=user, name="second", acting_user=None)
    budget_reserve(key=api_key, prompt_tokens=50, max_tokens=40)
    with pytest.raises(BudgetExceeded):
        budget_reserve(key=second, prompt_tokens=10, max_tokens=5)


def test_input_and_output_budgets(api_key):
    api_key.monthly_input_budget = 10
    api_key.monthly_output_budget = 6
    api_key.save()
    with pytest.raises(BudgetExceeded):
        budget_reserve(key=api_key, prompt_tokens=11, max_tokens=1)
    reservation = budget_reserve(key=api_key, prompt_tokens=10, max_tokens=50, completions=2)
    assert reservation.max_tokens_applied == 3


def test_activation_quota(api_key):
    api_key.monthly_activation_quota = 1
    api_key.save()
    budget_reserve(key=api_key, prompt_tokens=1, max_tokens=1, activation=True)
    with pytest.raises(BudgetExceeded) as refused:
        budget_reserve(key=api_key, prompt_tokens=1, max_tokens=1, activation=True)
    assert refused.value.code == "activation_quota_exceeded"
    budget_reserve(key=api_key, prompt_tokens=1, max_tokens=1)


def test_harvest_quota(api_key):
    api_key.monthly_harvest_quota = 2
    api_key.save()
    harvest_quota_consume(key=api_key)
    harvest_quota_consume(key=api_key)
    with pytest.raises(BudgetExceeded) as refused:
        harvest_quota_consume(key=api_key)
    assert refused.value.code == "harvest_quota_exceeded"


def test_a_second_key_of_an_account_that_spent_its_activation_quota_is_refused(api_key):
    """The account's quota holds across its keys: a new key's own quota adds nothing."""
    from accounts.services.keys import api_key_create

    user = api_key.user
    user.monthly_activation_quota = 2
    user.save()
    second, _ = api_key_create(user=user, name="second", acting_user=None)
    budget_reserve(key=api_key, prompt_tokens=1, max_tokens=1, activation=True)
    budget_reserve(key=second, prompt_tokens=1, max_tokens=1, activation=True)
    third, _ = api_key_create(user=user, name="third", acting_user=None)
    with pytest.raises(BudgetExceeded) as refused:
        budget_reserve(key=third, prompt_tokens=1, max_tokens=1, activation=True)
    assert refused.value.code == "activation_quota_exceeded"
    assert refused.value.message.startswith("This account's monthly activation-request quota")
    budget_reserve(key=third, prompt_tokens=1, max_tokens=1)  # plain requests still pass


def test_the_accounts_harvest_quota_spans_its_keys_and_a_refund_gives_it_back(api_key):
    from accounts.services.keys import api_key_create
    from metering.budgets import harvest_quota_refund

    user = api_key.user
    user.monthly_harvest_quota = 1
    user.save()
    second, _ = api_key_create(user=user, name="second", acting_user=None)
    harvest_quota_consume(key=api_key)
    with pytest.raises(BudgetExceeded) as refused:
        harvest_quota_consume(key=second)
    assert refused.value.code == "harvest_quota_exceeded"
    assert refused.value.message.startswith("This account's harvest-job quota is spent")
    harvest_quota_refund(key_id=api_key.pk, submitted_at=timezone.now())
    harvest_quota_consume(key=second)
    account = UsagePeriod.objects.get(user=user, key=None, period=windows.MONTH.name)
    assert account.harvest_jobs == 1


def test_spend_cap_pauses_everything(api_key):
    ServiceSettings.objects.create(pk=1, spend_cap_paused=True)
    with pytest.raises(BudgetExceeded) as refused:
        budget_reserve(key=api_key, prompt_tokens=1, max_tokens=1)
    assert refused.value.code == "spend_cap"


def test_stale_reservations_are_released(api_key):
    reservation = budget_reserve(key=api_key, prompt_tokens=10, max_tokens=10)
    BudgetReservation.objects.filter(pk=reservation.pk).update(
        alive_at=reservation.created_at - dt.timedelta(hours=1)
    )
    assert budget_release_stale(older_than=dt.timedelta(minutes=30)) == 1
    assert key_window(api_key, windows.MONTH.name).reserved_tokens == 0


def test_the_sweep_gives_back_a_dead_holds_activation_requests(api_key):
    reservation = budget_reserve(key=api_key, prompt_tokens=8, max_tokens=1, activation=3)
    assert key_window(api_key, windows.MONTH.name).activation_requests == 3
    BudgetReservation.objects.filter(pk=reservation.pk).update(
        alive_at=reservation.created_at - dt.timedelta(hours=1)
    )
    assert budget_release_stale(older_than=dt.timedelta(minutes=30)) == 1
    assert [w.activation_requests for w in UsagePeriod.objects.all()] == [0, 0, 0]


def test_a_settle_after_the_sweep_charges_the_usage_once(api_key):
    reservation = budget_reserve(key=api_key, prompt_tokens=10, max_tokens=20, activation=True)
    BudgetReservation.objects.filter(pk=reservation.pk).update(
        alive_at=reservation.created_at - dt.timedelta(hours=1)
    )
    assert budget_release_stale(older_than=dt.timedelta(minutes=30)) == 1
    # The request was still running: its settle charges what it used, and only once.
    assert budget_settle(reservation_id=reservation.pk, prompt_tokens=10, completion_tokens=15)
    assert not budget_settle(reservation_id=reservation.pk, prompt_tokens=10, completion_tokens=15)
    assert budget_release_stale(older_than=dt.timedelta(minutes=30)) == 0
    for window in UsagePeriod.objects.all():
        assert (window.used_tokens, window.reserved_tokens) == (25, 0)
        assert (window.used_input, window.used_output) == (10, 15)
        assert (window.reserved_input, window.reserved_output) == (0, 0)
        assert window.activation_requests == 1  # given back by the sweep, counted again
    assert BudgetReservation.objects.get().status == ReservationStatus.SETTLED


def test_a_hold_marked_alive_is_not_swept(api_key):
    reservation = budget_reserve(key=api_key, prompt_tokens=10, max_tokens=10)
    hour_ago = reservation.created_at - dt.timedelta(hours=1)
    BudgetReservation.objects.filter(pk=reservation.pk).update(
        created_at=hour_ago, alive_at=hour_ago
    )
    run_steps(
        lambda: budget_holds_alive_steps(reservation_ids=[reservation.pk], now=timezone.now())
    )
    assert budget_release_stale(older_than=dt.timedelta(minutes=30)) == 0
    assert key_window(api_key, windows.MONTH.name).reserved_tokens == 20


def test_daily_window_resets_at_utc_midnight_and_monthly_on_the_first(api_key):
    api_key.daily_token_budget = 100
    api_key.save()
    late = dt.datetime(2026, 1, 31, 23, 59, 59, tzinfo=dt.UTC)
    budget_reserve(key=api_key, prompt_tokens=90, max_tokens=10, now=late)
    with pytest.raises(BudgetExceeded):
        budget_reserve(key=api_key, prompt_tokens=1, max_tokens=1, now=late)
    next_day = dt.datetime(2026, 2, 1, 0, 0, 0, tzinfo=dt.UTC)
    budget_reserve(key=api_key, prompt_tokens=90, max_tokens=10, now=next_day)
    starts = set(UsagePeriod.objects.filter(key=api_key).values_list("period", "start"))
    assert starts == {
        (windows.MONTH.name, dt.date(2026, 1, 1)),
        (windows.DAY.name, dt.date(2026, 1, 31)),
        (windows.MONTH.name, dt.date(2026, 2, 1)),
        (windows.DAY.name, dt.date(2026, 2, 1)),
    }


def test_period_helpers_use_utc():
    tokyo = dt.timezone(dt.timedelta(hours=9))
    moment = dt.datetime(2026, 3, 1, 8, 0, tzinfo=tokyo)  # 2026-02-28 23:00 UTC
    day = windows.utc_day(moment)
    assert day == dt.date(2026, 2, 28)
    assert windows.MONTH.start(day) == dt.date(2026, 2, 1)
    assert windows.DAY.next_reset(day) == dt.datetime(2026, 3, 1, tzinfo=dt.UTC)
    assert windows.MONTH.next_reset(dt.date(2026, 12, 15)) == dt.datetime(2027, 1, 1, tzinfo=dt.UTC)


@pytest.mark.parametrize(
    ("day", "start", "reset"),
    [
        (dt.date(2026, 12, 2), dt.date(2026, 11, 30), dt.date(2026, 12, 7)),  # a Wednesday
        (dt.date(2026, 11, 30), dt.date(2026, 11, 30), dt.date(2026, 12, 7)),  # its Monday
        (dt.date(2027, 1, 3), dt.date(2026, 12, 28), dt.date(2027, 1, 4)),  # across a year
    ],
)
def test_a_week_runs_from_monday_to_the_next_monday_in_utc(day, start, reset):
    assert windows.WEEK.start(day) == start
    assert windows.WEEK.next_reset(day) == dt.datetime.combine(reset, dt.time.min, tzinfo=dt.UTC)


def test_every_period_starts_on_or_before_its_day_and_resets_after_it():
    day = dt.date(2026, 1, 1)
    for _ in range(800):
        for period in windows.PERIODS:
            assert period.start(day) <= day < period.following(day)
            assert period.start(period.following(day)) == period.following(day)
        day += dt.timedelta(days=1)


@pytest.mark.django_db(transaction=True)
def test_concurrent_reservations_never_overspend(api_key):
    """50 threads, each its own PostgreSQL connection, race for a budget that fits 10."""
    assert connection.vendor == "postgresql"
    api_key.daily_token_budget = 100
    api_key.save()
    barrier = threading.Barrier(50)
    outcomes = []

    def reserve():
        from django.db import connections

        try:
            barrier.wait()
            budget_reserve(key=api_key, prompt_tokens=5, max_tokens=5)
            outcomes.append("ok")
        except BudgetExceeded:
            outcomes.append("refused")
        finally:
            connections.close_all()

    threads = [threading.Thread(target=reserve) for _ in range(50)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert outcomes.count("ok") == 10
    assert outcomes.count("refused") == 40
    day = key_window(api_key, windows.DAY.name)
    assert day.reserved_tokens == 100
    assert BudgetReservation.objects.filter(key=api_key).count() == 10


def test_budget_windows_report_used_remaining_and_reset(api_key):
    from metering.selectors import budget_windows

    moment = dt.datetime(2026, 5, 20, 12, tzinfo=dt.UTC)
    reservation = budget_reserve(key=api_key, prompt_tokens=10, max_tokens=10, now=moment)
    budget_settle(reservation_id=reservation.pk, prompt_tokens=10, completion_tokens=4)
    windows = {w["name"]: w for w in budget_windows(key=api_key, now=moment)}
    assert windows["key_daily"]["used"] == 14
    assert windows["key_daily"]["remaining"] == api_key.daily_token_budget - 14
    assert windows["key_daily"]["resets_at"] == dt.datetime(2026, 5, 21, tzinfo=dt.UTC)
    assert windows["account_monthly"]["resets_at"] == dt.datetime(2026, 6, 1, tzinfo=dt.UTC)
    assert windows["key_monthly_input"]["limit"] is None


def test_spend_cap_switch_is_audited(api_key, staff_user):
    from accounts.models import AuditLog
    from accounts.services.service import service_spend_cap_set

    service_spend_cap_set(paused=True, acting_user=staff_user, reason="monthly cap reached")
    with pytest.raises(BudgetExceeded):
        budget_reserve(key=api_key, prompt_tokens=1, max_tokens=1)
    service_spend_cap_set(paused=False, acting_user=staff_user)
    budget_reserve(key=api_key, prompt_tokens=1, max_tokens=1)
    assert AuditLog.objects.filter(action="service.spend_cap").count() == 2
