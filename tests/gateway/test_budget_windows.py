"""A budget window is one entry of `metering.windows.WINDOWS`: throw-away windows declared
only here are reserved, settled, shown and enforced by the live gateway with no other change.

A key's daily *output* window, whose limit is a property that reads a setting; and a key's
*weekly* token window, on the week period, whose limit is a model field as a real window's
is (a real window adds it with a migration; here it is added to the model and its table for
the test alone), which the key's owner sets in the keys page's budget form."""

import datetime as dt

import pytest
from django.conf import settings as django_settings
from django.db import connection, models
from django.urls import reverse
from django.utils import timezone

from accounts.models import ApiKey, AuditLog
from metering import windows
from metering.models import BudgetReservation, ReservationStatus, UsagePeriod
from tests.accounts.support import logged_in

from .conftest import key_day_window

pytestmark = pytest.mark.django_db(transaction=True)

KEY_DAILY_OUTPUT = windows.Window(
    name="key_daily_output",
    label="Key output, today (tokens)",
    scope=windows.KEY,
    period=windows.DAY,
    counter=windows.OUTPUT,
    limit="test_daily_output_budget",
)
BODY = {"model": "stub-model", "prompt": "hello", "max_tokens": 4}


@pytest.fixture
def daily_output_window(monkeypatch, settings):
    settings.TEST_KEY_DAILY_OUTPUT_TOKENS = 10
    monkeypatch.setattr(
        ApiKey,
        "test_daily_output_budget",
        property(lambda key: django_settings.TEST_KEY_DAILY_OUTPUT_TOKENS),
        raising=False,
    )
    monkeypatch.setattr(windows, "WINDOWS", (*windows.WINDOWS, KEY_DAILY_OUTPUT))


def usage_windows(client) -> dict:
    return {window["name"]: window for window in client.get("/v1/usage").json()["windows"]}


def test_a_window_declared_in_the_table_is_reserved_settled_shown_and_enforced(
    client, stub, api_key, daily_output_window
):
    # Reserved: the first request holds its worst case against the new window, exactly (a
    # key with an output window is never served from a budget lease).
    first = client.post("/v1/completions", json=BODY)
    assert first.status_code == 200
    # Settled: the request's actual output is used in the key's day row, nothing held.
    reservation = BudgetReservation.objects.get()
    assert (reservation.status, reservation.output_tokens) == (ReservationStatus.SETTLED, 4)
    day = key_day_window(api_key)
    assert (day.used_output, day.reserved_output) == (4, 0)

    # The window has 6 tokens left: the next request's max_tokens is clamped to them.
    clamped = client.post("/v1/completions", json={**BODY, "max_tokens": 8})
    assert clamped.status_code == 200
    assert clamped.headers["X-Acs-Max-Tokens-Clamped"] == "requested=8,applied=6,reason=budget"
    assert clamped.json()["usage"]["completion_tokens"] == 6

    # Shown: in GET /v1/usage and in the budget panel of the dashboard.
    shown = usage_windows(client)
    assert shown["key_daily_output"] | {"resets_at": None} == {
        "name": "key_daily_output",
        "label": "Key output, today (tokens)",
        "used": 10,
        "reserved": 0,
        "limit": 10,
        "remaining": 0,
        "resets_at": None,
    }
    assert shown["key_daily"]["remaining"] > 0  # only the new window is spent
    page = logged_in(api_key.user).get("/").content.decode()
    assert "Key output, today (tokens)" in page

    # Enforced: the contract's 429 budget_exceeded, which resending cannot fix.
    refused = client.post("/v1/completions", json=BODY)
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "budget_exceeded"
    assert refused.headers["X-Should-Retry"] == "false"
    assert "Retry-After" not in refused.headers
    assert len(stub.requests) == 2


def test_without_the_entry_the_same_traffic_is_not_limited(client, stub, api_key, settings):
    settings.TEST_KEY_DAILY_OUTPUT_TOKENS = 10
    for _ in range(3):
        assert client.post("/v1/completions", json=BODY).status_code == 200
    assert "key_daily_output" not in usage_windows(client)
    assert UsagePeriod.objects.get(key=api_key, period=windows.DAY.name).used_output == 12


KEY_WEEKLY = windows.Window(
    name="key_weekly",
    label="Key, this week (tokens)",
    scope=windows.KEY,
    period=windows.WEEK,
    counter=windows.TOKENS,
    limit="weekly_token_budget",
    owner_sets=True,
    optional=True,
    at_most="key_monthly",
)


@pytest.fixture
def weekly_window(monkeypatch):
    """KEY_WEEKLY in the table, and its limit a nullable field of ApiKey and its table."""
    field = models.PositiveBigIntegerField(null=True, blank=True)
    field.contribute_to_class(ApiKey, "weekly_token_budget")
    with connection.schema_editor() as editor:
        editor.add_field(ApiKey, field)
    monkeypatch.setattr(windows, "WINDOWS", (*windows.WINDOWS, KEY_WEEKLY))
    yield
    with connection.schema_editor() as editor:
        editor.remove_field(ApiKey, field)
    ApiKey._meta.local_fields.remove(field)
    ApiKey._meta._expire_cache()
    delattr(ApiKey, "weekly_token_budget")


def owner_budgets(key, **values) -> dict:
    """A POST of the keys page's budget form of `key`, the other budgets unchanged."""
    data = {
        "monthly_token_budget": key.monthly_token_budget,
        "daily_token_budget": key.daily_token_budget,
        "monthly_input_budget": "",
        "monthly_output_budget": "",
        **values,
    }
    return {f"budget-{key.pk}-{name}": value for name, value in data.items()}


def test_a_weekly_window_declared_in_the_table_is_set_by_its_owner_and_enforced(
    weekly_window, client, stub, api_key
):
    owner = logged_in(api_key.user)
    # Shown in the owner's budget form, and set there: never above the key's monthly budget.
    keys_page = owner.get("/keys/").content.decode()
    assert f'name="budget-{api_key.pk}-weekly_token_budget"' in keys_page
    too_much = owner.post(
        reverse("key_budget", args=[api_key.pk]),
        owner_budgets(api_key, monthly_token_budget=1000, weekly_token_budget=1001),
    )
    assert too_much.status_code == 200
    assert too_much.context["rows"][0]["budget_form"].errors["weekly_token_budget"] == [
        "At most the key's monthly budget (1,000 tokens)."
    ]
    saved = owner.post(
        reverse("key_budget", args=[api_key.pk]), owner_budgets(api_key, weekly_token_budget=30)
    )
    assert saved.status_code == 302
    api_key.refresh_from_db()
    assert api_key.weekly_token_budget == 30
    audit = AuditLog.objects.get(action="key.budget_set")
    assert (audit.before["weekly_token_budget"], audit.after["weekly_token_budget"]) == (None, 30)

    # Reserved and settled in the key's row of this UTC week.
    first = client.post("/v1/completions", json=BODY)
    assert first.status_code == 200
    spent = first.json()["usage"]["total_tokens"]
    today = timezone.now().astimezone(dt.UTC).date()
    week = UsagePeriod.objects.get(key=api_key, period="week")
    assert week.start == today - dt.timedelta(days=today.weekday())  # its Monday
    assert (week.used_tokens, week.reserved_tokens) == (spent, 0)

    # The window has 30 - spent tokens left: the next request's max_tokens is clamped to them.
    prompt_tokens = first.json()["usage"]["prompt_tokens"]
    applied = 30 - spent - prompt_tokens
    clamped = client.post("/v1/completions", json={**BODY, "max_tokens": 40})
    assert clamped.status_code == 200
    assert clamped.headers["X-Acs-Max-Tokens-Clamped"] == (
        f"requested=40,applied={applied},reason=budget"
    )

    # Shown: in GET /v1/usage, resetting next Monday at 00:00 UTC, and on the dashboard.
    shown = usage_windows(client)["key_weekly"]
    monday = week.start + dt.timedelta(days=7)
    assert shown == {
        "name": "key_weekly",
        "label": "Key, this week (tokens)",
        "used": 30,
        "reserved": 0,
        "limit": 30,
        "remaining": 0,
        "resets_at": f"{monday.isoformat()}T00:00:00+00:00",
    }
    page = owner.get("/").content.decode()
    assert "Key, this week (tokens)" in page
    assert "weekly on Mondays" in page

    # Enforced: the contract's 429 budget_exceeded; the other windows have room.
    refused = client.post("/v1/completions", json=BODY)
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "budget_exceeded"
    assert usage_windows(client)["key_daily"]["remaining"] > 0
