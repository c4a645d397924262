import csv
import datetime as dt
import io
import json
import re
from collections import defaultdict

import pytest
from django.db.models import Sum

from accounts.services.keys import api_key_create
from metering.models import UsageRecord

from .conftest import table_rows, utc

pytestmark = pytest.mark.django_db

JAN = {"range": "custom", "from": "2025-01-01", "to": "2025-01-31"}


def _direct_sums(records):
    """Per UTC day and in total, summed straight from the records."""
    days = defaultdict(lambda: defaultdict(int))
    for r in records:
        day = days[r.created_at.astimezone(dt.UTC).date()]
        day["requests"] += 1
        day[f"{r.status_code // 100}xx"] += 1
        day["prompt_tokens"] += r.prompt_tokens
        day["completion_tokens"] += r.completion_tokens
    return days


@pytest.fixture
def january(record, api_key, approved_user):
    """A month of mixed traffic on two keys and two models, plus records just outside it."""
    second_key, _ = api_key_create(user=approved_user, name="second", acting_user=None)
    outcomes = [
        (200, ""),
        (200, ""),
        (429, "budget_exceeded"),
        (400, "invalid_request"),
        (502, "upstream_unreachable"),
    ]
    for i in range(40):
        status, error = outcomes[i % len(outcomes)]
        record(
            utc(2025, 1, 1 + i % 31, (i * 7) % 24, i % 60),
            key=second_key if i % 3 == 0 else api_key,
            model="smollm2-360m" if i % 4 == 0 else "smollm2-135m",
            status_code=status,
            error_code=error,
            prompt_tokens=10 + i,
            completion_tokens=0 if error else 5 * i,
            latency_ms=50.0 + i,
        )
    record(utc(2024, 12, 31, 23, 59, 59), prompt_tokens=1000, completion_tokens=1000)
    record(utc(2025, 2, 1, 0, 0, 0), prompt_tokens=1000, completion_tokens=1000)
    return second_key


def test_usage_numbers_equal_direct_sums_over_the_records(user_client, january):
    response = user_client.get("/usage/", JAN)

    assert response.status_code == 200
    in_window = UsageRecord.objects.filter(
        created_at__gte=utc(2025, 1, 1), created_at__lt=utc(2025, 2, 1)
    )
    expected = in_window.aggregate(p=Sum("prompt_tokens"), c=Sum("completion_tokens"))
    totals = response.context["summary"]["totals"]
    assert totals["requests"] == in_window.count() == 40
    assert totals["prompt_tokens"] == expected["p"]
    assert totals["completion_tokens"] == expected["c"]
    assert totals["4xx"] == in_window.filter(status_code__gte=400, status_code__lt=500).count()
    assert totals["5xx"] == in_window.filter(status_code__gte=500).count()
    by_day = _direct_sums(in_window)
    rows = table_rows(response.content.decode(), "usage-days")
    assert len(rows) == 31
    for row in rows:
        day = by_day[dt.date.fromisoformat(row[0])]
        assert [int(v) for v in row[1:8]] == [
            day["requests"],
            day["2xx"],
            day["4xx"],
            day["5xx"],
            day["prompt_tokens"],
            day["completion_tokens"],
            day["prompt_tokens"] + day["completion_tokens"],
        ]
    errors = {
        (int(r[0]), r[1]): int(r[2]) for r in table_rows(response.content.decode(), "usage-errors")
    }
    assert errors == {
        (429, "budget_exceeded"): in_window.filter(error_code="budget_exceeded").count(),
        (400, "invalid_request"): in_window.filter(error_code="invalid_request").count(),
        (502, "upstream_unreachable"): in_window.filter(error_code="upstream_unreachable").count(),
    }


def test_key_and_model_filters_narrow_the_sums(user_client, january):
    response = user_client.get("/usage/", {**JAN, "key": january.pk, "model": "smollm2-360m"})

    expected = UsageRecord.objects.filter(
        created_at__gte=utc(2025, 1, 1),
        created_at__lt=utc(2025, 2, 1),
        key=january,
        model="smollm2-360m",
    )
    totals = response.context["summary"]["totals"]
    assert totals["requests"] == expected.count() > 0
    assert totals["prompt_tokens"] == expected.aggregate(s=Sum("prompt_tokens"))["s"]


def test_records_at_utc_day_and_month_boundaries_land_on_their_own_days(user_client, record):
    record(utc(2025, 1, 31, 23, 59, 59), prompt_tokens=1)
    record(utc(2025, 2, 1, 0, 0, 0), prompt_tokens=2)
    # 00:30 in UTC+1 is still 23:30 UTC on the 31st.
    record(
        dt.datetime(2025, 2, 1, 0, 30, tzinfo=dt.timezone(dt.timedelta(hours=1))), prompt_tokens=4
    )

    both = user_client.get("/usage/", {"range": "custom", "from": "2025-01-31", "to": "2025-02-01"})
    february = user_client.get(
        "/usage/", {"range": "custom", "from": "2025-02-01", "to": "2025-02-28"}
    )

    rows = {r[0]: int(r[5]) for r in table_rows(both.content.decode(), "usage-days")}
    assert rows == {"2025-01-31": 5, "2025-02-01": 2}
    assert february.context["summary"]["totals"]["prompt_tokens"] == 2
    assert "UTC" in both.content.decode()


def test_default_range_is_the_last_30_utc_days_including_today(user_client, record):
    from django.utils import timezone

    today = timezone.now().astimezone(dt.UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    record(today, prompt_tokens=1)
    record(today - dt.timedelta(days=29), prompt_tokens=10)
    record(today - dt.timedelta(seconds=29 * 86400 + 1), prompt_tokens=100)

    response = user_client.get("/usage/")

    assert response.context["form"]["range"].value() == "30"
    assert len(response.context["summary"]["days"]) == 30
    assert response.context["summary"]["totals"]["prompt_tokens"] == 11


def test_csv_export_matches_the_table(user_client, january):
    page = user_client.get("/usage/", JAN)
    export = user_client.get("/usage/export.csv", JAN)

    assert export.status_code == 200
    assert export["Content-Type"].startswith("text/csv")
    assert "2025-01-01-2025-01-31-utc.csv" in export["Content-Disposition"]
    header, *rows = list(csv.reader(io.StringIO(export.content.decode())))
    assert header[0] == "day" and header[1] == "requests"
    assert rows == table_rows(page.content.decode(), "usage-days")


def test_invalid_custom_range_is_named_next_to_its_field(user_client):
    bad = {"range": "custom", "from": "2025-02-10", "to": "2025-02-01"}

    page = user_client.get("/usage/", bad)
    export = user_client.get("/usage/export.csv", bad)
    missing = user_client.get("/usage/", {"range": "custom", "to": "2025-02-01"})
    too_long = user_client.get(
        "/usage/", {"range": "custom", "from": "2020-01-01", "to": "2025-02-01"}
    )

    assert page.status_code == 200
    assert "The last day must not be before the first day." in page.content.decode()
    assert "summary" not in page.context
    assert export.status_code == 400
    assert b"to: The last day must not be before the first day." in export.content
    assert "Give the first day of a custom range." in missing.content.decode()
    assert "spans at most 366 days" in too_long.content.decode()


def test_the_last_representable_day_is_a_field_error_not_a_500(user_client):
    last = {"range": "custom", "from": "9999-12-31", "to": "9999-12-31"}

    page = user_client.get("/usage/", last)
    export = user_client.get("/usage/export.csv", last)

    assert page.status_code == 200
    assert "Give a day no later than 9999-12-30." in page.content.decode()
    assert "summary" not in page.context
    assert export.status_code == 400


def test_another_users_key_is_not_a_valid_filter(user_client, other_user, january):
    others_key, _ = api_key_create(user=other_user, name="theirs", acting_user=None)

    response = user_client.get("/usage/", {**JAN, "key": others_key.pk})

    assert "summary" not in response.context
    assert "Select a valid choice" in response.content.decode()


def test_a_user_sees_only_their_own_usage(user_client, record, other_user, january):
    others_key, _ = api_key_create(user=other_user, name="theirs", acting_user=None)
    record(utc(2025, 1, 15, 12), key=others_key, prompt_tokens=99999)

    response = user_client.get("/usage/", JAN)

    assert response.context["summary"]["totals"]["requests"] == 40
    assert "99999" not in response.content.decode()


def test_htmx_filter_returns_only_the_results_partial(user_client, january):
    partial = user_client.get("/usage/", JAN, headers={"HX-Request": "true"})
    full = user_client.get("/usage/", JAN)

    assert partial.content.decode().lstrip().startswith('<div id="results" hx-history="false">')
    assert "<html" not in partial.content.decode()
    assert 'id="usage-days"' in partial.content.decode()
    assert "<html" in full.content.decode()
    assert 'hx-get="/usage/"' in full.content.decode()
    assert 'action="/usage/"' in full.content.decode()
    assert table_rows(partial.content.decode(), "usage-days") == table_rows(
        full.content.decode(), "usage-days"
    )


@pytest.mark.parametrize("path", ["/usage/", "/usage/requests/"])
def test_a_filtered_view_is_the_whole_page_for_a_bookmark_and_for_the_back_button(
    user_client, january, path
):
    """The filters are the URL (htmx pushes it): the page, its htmx fragment and htmx's
    restore of that history entry are three answers of one URL. The browser's cache must
    tell the fragment from the page (Vary), and a restore gets the whole page, which htmx
    puts in place of the body (hx-history="false": it keeps no copy of pages with charts)."""
    page = user_client.get(path, JAN)
    fragment = user_client.get(path, JAN, headers={"HX-Request": "true"})
    restored = user_client.get(
        path, JAN, headers={"HX-Request": "true", "HX-History-Restore-Request": "true"}
    )
    for response in (page, fragment, restored):
        assert "HX-Request" in response["Vary"]
    assert "<html" not in fragment.content.decode()
    assert restored.content.decode().lstrip().lower().startswith("<!doctype html>")
    assert 'hx-history="false"' in page.content.decode()
    assert 'hx-push-url="true"' in page.content.decode()


def test_date_filters_are_typed_as_the_page_prints_days(user_client, january):
    page = user_client.get("/usage/", JAN).content.decode()
    field = re.search(r'<input[^>]*name="from"[^>]*>', page).group(0)
    assert 'type="text"' in field and 'placeholder="YYYY-MM-DD"' in field
    assert 'value="2025-01-01"' in field
    american = user_client.get("/usage/", {"range": "custom", "from": "01/02/2025", "to": ""})
    assert "Give the day as YYYY-MM-DD, e.g. 2026-12-01." in american.content.decode()


def test_page_carries_plotly_figures_of_the_same_numbers(user_client, january):
    response = user_client.get("/usage/", JAN)

    text = response.content.decode()
    embedded = re.search(
        r'<script id="usage-figure-tokens" type="application/json">(.*?)</script>', text
    )
    tokens = json.loads(embedded.group(1))
    requests = response.context["figures"]["requests"]
    days = response.context["summary"]["days"]
    prompt, completion = tokens["data"]
    assert prompt["x"] == [d["day"].isoformat() for d in days]
    assert prompt["y"] == [d["prompt_tokens"] for d in days]
    assert completion["y"] == [d["completion_tokens"] for d in days]
    assert [trace["name"] for trace in requests["data"]] == ["2xx", "4xx", "5xx"]
    assert requests["data"][2]["y"] == [d["5xx"] for d in days]
    assert tokens["layout"]["barmode"] == "stack"
    assert "vendor/plotly-acs-" in response.content.decode()


def test_pending_user_is_refused_and_anonymous_is_sent_to_log_in(client, pending_user):
    assert client.get("/usage/").status_code == 302
    client.force_login(pending_user)
    assert client.get("/usage/").status_code == 403
    assert client.get("/usage/export.csv").status_code == 403
    assert client.get("/usage/requests/").status_code == 403


def test_project_urls_mount_the_usage_pages_under_usage():
    from django.urls import resolve

    from portal import usage_views

    assert resolve("/usage/", urlconf="acs_portal.urls").func is usage_views.usage_page
    assert resolve("/usage/staff/", urlconf="acs_portal.urls").func is usage_views.staff_overview
