import datetime as dt
import statistics

import pytest
from django.core.management import call_command
from django.db.models import Sum
from django.utils import timezone

from accounts.services.keys import api_key_create
from accounts.services.service import service_spend_cap_set
from metering.models import UsageDaily, UsageRecord
from metering.selectors import UsageDateRange, latency_percentiles, usage_summary

from .conftest import table_rows, utc

pytestmark = pytest.mark.django_db

JAN = {"range": "custom", "from": "2025-01-01", "to": "2025-01-31"}
UPSTREAMS = [
    {
        "model": "smollm2-135m",
        "url": "http://127.0.0.1:8001",
        "kind": "completions",
        "state": "open",
        "recent_failures": 7,
        "open_until": utc(2025, 1, 1, 12),
    }
]


@pytest.fixture(autouse=True)
def upstreams(monkeypatch):
    monkeypatch.setattr("api.selectors.upstream_states", lambda: UPSTREAMS)


@pytest.fixture
def service_traffic(record, api_key, other_user):
    """January traffic of two users; the other user spends more tokens."""
    others_key, _ = api_key_create(user=other_user, name="theirs", acting_user=None)
    for day in range(1, 11):
        record(utc(2025, 1, day, 10), prompt_tokens=10, completion_tokens=5)
        record(utc(2025, 1, day, 11), key=others_key, prompt_tokens=100, completion_tokens=50)
        record(utc(2025, 1, day, 12), key=others_key, status_code=503, error_code="circuit_open")
    record(utc(2025, 2, 1), key=others_key, prompt_tokens=10**6)
    return others_key


@pytest.mark.parametrize(
    "path", ["/usage/staff/", "/usage/staff/users/{id}/", "/usage/staff/users/{id}/export.csv"]
)
def test_staff_pages_refuse_non_staff(client, approved_user, path):
    url = path.format(id=approved_user.pk)
    assert client.get(url).status_code == 302
    client.force_login(approved_user)
    assert client.get(url).status_code == 403


def test_overview_numbers_equal_direct_sums_across_the_service(
    staff_client, service_traffic, approved_user, other_user
):
    response = staff_client.get("/usage/staff/", JAN)

    assert response.status_code == 200
    january = UsageRecord.objects.filter(
        created_at__gte=utc(2025, 1, 1), created_at__lt=utc(2025, 2, 1)
    )
    totals = response.context["summary"]["totals"]
    assert totals["requests"] == january.count() == 30
    assert totals["total_tokens"] == sum(r.prompt_tokens + r.completion_tokens for r in january)
    top_users = table_rows(response.content.decode(), "top-users")
    assert [row[0] for row in top_users] == [other_user.email, approved_user.email]
    for row, user in zip(top_users, [other_user, approved_user], strict=True):
        own = january.filter(user=user).aggregate(
            p=Sum("prompt_tokens"), c=Sum("completion_tokens")
        )
        assert [int(v) for v in row[1:5]] == [
            january.filter(user=user).count(),
            own["p"],
            own["c"],
            own["p"] + own["c"],
        ]
    top_keys = table_rows(response.content.decode(), "top-keys")
    assert top_keys[0][0].startswith(f"acs-{service_traffic.prefix}")
    errors = table_rows(response.content.decode(), "usage-errors")
    assert errors == [["503", "circuit_open", "10", "33.33%"]]
    assert f'href="/usage/staff/users/{other_user.pk}/"' in response.content.decode()
    assert f'href="/staff/users/{other_user.pk}/"' in response.content.decode()


def test_overview_shows_upstreams_applications_and_spend_cap(
    staff_client, staff_user, pending_user
):
    service_spend_cap_set(paused=True, acting_user=staff_user, reason="invoice review")

    response = staff_client.get("/usage/staff/")

    text = response.content.decode()
    assert table_rows(text, "upstreams") == [
        [
            "smollm2-135m",
            "http://127.0.0.1:8001",
            "completions",
            "Open",
            "7",
            "2025-01-01 12:00:00 UTC",
        ]
    ]
    assert '<strong id="pending-applications">1</strong>' in text
    assert 'href="/staff/applications/"' in text
    assert 'href="/staff/spend-cap/"' in text
    assert "invoice review" in text


def test_latency_percentiles_cover_the_last_24_hours_per_model(staff_client, record):
    now = timezone.now()
    latencies = [float(x) for x in range(10, 210, 10)]
    for i, latency in enumerate(latencies):
        record(now - dt.timedelta(minutes=i + 1), latency_ms=latency)
    record(now - dt.timedelta(hours=25), latency_ms=99999.0)
    record(now - dt.timedelta(minutes=5), model="smollm2-360m", latency_ms=42.0)

    response = staff_client.get("/usage/staff/")

    cuts = statistics.quantiles(latencies, n=100, method="inclusive")
    rows = table_rows(response.content.decode(), "latencies")
    assert rows == [
        ["smollm2-135m", "20", f"{cuts[49]:.1f}", f"{cuts[94]:.1f}"],
        ["smollm2-360m", "1", "42.0", "42.0"],
    ]
    assert latency_percentiles(now=now)[0]["p95_ms"] == pytest.approx(cuts[94])


def test_staff_user_page_shows_that_users_usage(staff_client, service_traffic, other_user):
    response = staff_client.get(f"/usage/staff/users/{other_user.pk}/", JAN)
    export = staff_client.get(f"/usage/staff/users/{other_user.pk}/export.csv", JAN)

    theirs = UsageRecord.objects.filter(user=other_user, created_at__lt=utc(2025, 2, 1))
    totals = response.context["summary"]["totals"]
    assert totals["requests"] == theirs.count() == 20
    assert totals["prompt_tokens"] == theirs.aggregate(s=Sum("prompt_tokens"))["s"]
    assert f'action="/usage/staff/users/{other_user.pk}/"' in response.content.decode()
    assert export.status_code == 200
    assert export.content.decode().count("\n") == 32
    assert staff_client.get("/usage/staff/users/999999/").status_code == 404


def test_htmx_overview_returns_only_the_results_partial(staff_client, service_traffic):
    partial = staff_client.get("/usage/staff/", JAN, headers={"HX-Request": "true"})
    full = staff_client.get("/usage/staff/", JAN)

    assert partial.content.decode().lstrip().startswith('<div id="results" hx-history="false">')
    assert "<html" not in partial.content.decode()
    assert table_rows(partial.content.decode(), "top-users") == table_rows(
        full.content.decode(), "top-users"
    )
    assert "<html" in full.content.decode()
    assert "HX-Request" in partial["Vary"] and "HX-Request" in full["Vary"]
    restored = staff_client.get(
        "/usage/staff/", JAN, headers={"HX-Request": "true", "HX-History-Restore-Request": "true"}
    )
    assert "<html" in restored.content.decode()


def test_seed_command_writes_records_and_matching_daily_roll_ups(db):
    call_command("acs_seed_usage", records=3000, users=3, days=40, batch=1000, stdout=None)
    call_command("acs_seed_usage", records=500, users=3, days=40, seed=1, stdout=None)

    assert UsageRecord.objects.count() == 3500
    daily = UsageDaily.objects.aggregate(
        n=Sum("requests"), p=Sum("prompt_tokens"), c=Sum("completion_tokens")
    )
    direct = UsageRecord.objects.aggregate(p=Sum("prompt_tokens"), c=Sum("completion_tokens"))
    assert daily == {"n": 3500, **direct}
    today = timezone.now().date()
    date_range = UsageDateRange(start=today - dt.timedelta(days=45), end=today)
    summary = usage_summary(date_range)
    assert summary["totals"]["requests"] == 3500
    for day in summary["days"]:
        on_day = UsageRecord.objects.filter(
            created_at__gte=dt.datetime.combine(day["day"], dt.time.min, tzinfo=dt.UTC),
            created_at__lt=dt.datetime.combine(day["day"], dt.time.min, tzinfo=dt.UTC)
            + dt.timedelta(days=1),
        )
        assert day["requests"] == on_day.count()
    assert UsageRecord.objects.values("user_id").distinct().count() == 3
