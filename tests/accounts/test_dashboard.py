"""The approved user's dashboard: a budget panel per key with a warning past 80%."""

import datetime as dt

from django.urls import reverse

from accounts.models import KeyStatus
from accounts.services.keys import api_key_create
from metering import windows
from metering.budgets import budget_reserve, budget_settle
from metering.models import UsagePeriod
from metering.selectors import budget_panel


def test_dashboard_shows_budget_panel_per_active_key(approved_client, approved_user, api_key):
    revoked, _ = api_key_create(user=approved_user, name="old key", acting_user=None)
    revoked.status = KeyStatus.REVOKED
    revoked.save()
    html = approved_client.get(reverse("home")).content.decode()
    assert f"acs-{api_key.prefix}" in html
    assert f"acs-{revoked.prefix}" not in html
    assert "Key, today (tokens)" in html
    assert "Resets" in html and " UTC</time>" in html
    assert "% of the limit is used" not in html


def test_dashboard_warns_when_a_window_passes_80_percent(approved_client, api_key):
    api_key.daily_token_budget = 1000
    api_key.save()
    reservation = budget_reserve(key=api_key, prompt_tokens=10, max_tokens=900)
    budget_settle(reservation_id=reservation.pk, prompt_tokens=10, completion_tokens=800)
    html = approved_client.get(reverse("home")).content.decode()
    assert "Key, today (tokens): 81% of the limit is used." in html


def test_budget_panel_reports_used_remaining_and_next_utc_reset(api_key):
    now = dt.datetime(2026, 3, 31, 23, 59, tzinfo=dt.UTC)
    UsagePeriod.objects.create(
        user=api_key.user,
        key=api_key,
        period=windows.MONTH.name,
        start=windows.MONTH.start(windows.utc_day(now)),
        used_tokens=api_key.monthly_token_budget // 2,
        reserved_tokens=0,
    )
    panel = {w["name"]: w for w in budget_panel(key=api_key, now=now)}
    monthly = panel["key_monthly"]
    assert monthly["remaining"] == api_key.monthly_token_budget - monthly["used"]
    assert monthly["percent"] == 50
    assert not monthly["warning"]
    assert monthly["resets_at"] == dt.datetime(2026, 4, 1, tzinfo=dt.UTC)
    assert panel["key_daily"]["resets_at"] == dt.datetime(2026, 4, 1, tzinfo=dt.UTC)
    assert panel["key_monthly_input"]["percent"] is None


def test_budget_panel_warns_on_a_zero_limit(api_key):
    api_key.monthly_harvest_quota = 0
    api_key.save()
    panel = {w["name"]: w for w in budget_panel(key=api_key)}
    assert panel["harvest_jobs"]["warning"]
