"""A budget window is one entry of `metering.windows.WINDOWS`: a throw-away fourth token
window, a key's daily *output* window, declared only here, is reserved, settled, shown and
enforced by the live gateway with no other change.

Its limit is an attribute of the key, as every window's is. A real window would add a model
field (a migration) and a form field; here the attribute is a property that reads a setting,
so the test needs no migration."""

import pytest
from django.conf import settings as django_settings

from accounts.models import ApiKey, BudgetReservation, Period, ReservationStatus, UsagePeriod
from metering import windows
from tests.accounts.support import logged_in

from .conftest import key_day_window

pytestmark = pytest.mark.django_db(transaction=True)

KEY_DAILY_OUTPUT = windows.Window(
    name="key_daily_output",
    label="Key output, today (tokens)",
    scope=windows.KEY,
    period=Period.DAY,
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
    assert UsagePeriod.objects.get(key=api_key, period=Period.DAY).used_output == 12
