import re

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from accounts.services.keys import api_key_create
from metering.models import UsageRecord
from metering.selectors import REQUEST_LOG_PAGE_SIZE

from .conftest import table_rows, utc

pytestmark = pytest.mark.django_db


def _ids(response):
    return [int(i) for i in re.findall(r'href="/usage/requests/(\d+)/"', response.content.decode())]


def _next_link(response):
    match = re.search(r'<a rel="next" href="([^"]+)"', response.content.decode())
    return match and match.group(1).replace("&amp;", "&")


def test_log_lists_own_requests_newest_first_with_metadata(user_client, record, other_user):
    old = record(
        utc(2025, 3, 1, 8), prompt_tokens=7, completion_tokens=3, ttft_ms=12.5, stream=True
    )
    new = record(
        utc(2025, 3, 2, 9),
        status_code=429,
        error_code="rate_limited",
        activation_layers=[0, 6],
    )
    others_key, _ = api_key_create(user=other_user, name="theirs", acting_user=None)
    record(utc(2025, 3, 3), key=others_key)

    response = user_client.get("/usage/requests/")

    assert _ids(response) == [new.pk, old.pk]
    rows = table_rows(response.content.decode(), "request-log")
    assert rows[0][0] == "2025-03-02 09:00:00 UTC"
    assert rows[0][4:6] == ["429", "rate_limited"]
    assert rows[0][11] == "0, 6"
    assert rows[1][6:11] == ["7", "3", "100.0", "12.5", "yes"]


def test_keyset_pages_walk_every_request_once_without_offset(user_client, record):
    # Ties on created_at straddle the page boundary: the id breaks them.
    created = [record(utc(2025, 3, 1, 12)) for _ in range(REQUEST_LOG_PAGE_SIZE + 5)]
    created += [record(utc(2025, 3, 1, 11, minute)) for minute in range(30)]
    url, seen = "/usage/requests/", []
    with CaptureQueriesContext(connection) as queries:
        while url:
            response = user_client.get(url)
            assert response.status_code == 200
            seen += _ids(response)
            url = _next_link(response)

    expected = list(UsageRecord.objects.order_by("-created_at", "-id").values_list("id", flat=True))
    assert seen == expected
    assert len(seen) == len(created)
    assert not any("OFFSET" in q["sql"].upper() for q in queries.captured_queries)


def test_filters_narrow_the_log(user_client, record, api_key, approved_user):
    second, _ = api_key_create(user=approved_user, name="second", acting_user=None)
    ok = record(utc(2025, 3, 1), model="smollm2-135m")
    limited = record(utc(2025, 3, 2), status_code=429, error_code="rate_limited")
    spent = record(utc(2025, 3, 3), status_code=429, error_code="budget_exceeded", key=second)
    failed = record(utc(2025, 3, 4), status_code=502, error_code="upstream_unreachable")
    other_model = record(utc(2025, 3, 5), model="smollm2-360m")

    def ids(**params):
        return _ids(user_client.get("/usage/requests/", params))

    assert ids(status="4xx") == [spent.pk, limited.pk]
    assert ids(status="502") == [failed.pk]
    assert ids(error_code="budget_exceeded") == [spent.pk]
    assert ids(key=second.pk) == [spent.pk]
    assert ids(model="smollm2-360m") == [other_model.pk]
    assert ids(**{"from": "2025-03-02", "to": "2025-03-03"}) == [spent.pk, limited.pk]
    assert ok.pk in ids()


def test_bad_log_filters_are_named(user_client, record):
    record(utc(2025, 3, 1))

    bad_status = user_client.get("/usage/requests/", {"status": "abc"})
    bad_cursor = user_client.get("/usage/requests/", {"before": "yesterday"})

    assert "Give a status code such as 429" in bad_status.content.decode()
    assert _ids(bad_status) == []
    assert "This page link is damaged" in bad_cursor.content.decode()


@pytest.mark.parametrize(
    "dates",
    [
        {"from": "9999-12-31", "to": "9999-12-31"},
        {"from": "9999-12-31"},
        {"to": "9999-12-31"},
    ],
)
def test_a_date_filter_on_the_last_representable_day_is_a_field_error(user_client, record, dates):
    record(utc(2025, 3, 1))

    response = user_client.get("/usage/requests/", dates)

    assert response.status_code == 200
    assert "Give a day no later than 9999-12-30." in response.content.decode()
    assert _ids(response) == []


def test_htmx_log_returns_only_the_log_partial(user_client, record):
    row = record(utc(2025, 3, 1))

    partial = user_client.get("/usage/requests/", headers={"HX-Request": "true"})
    full = user_client.get("/usage/requests/")

    assert partial.content.decode().lstrip().startswith('<div id="log" hx-history="false">')
    assert "<html" not in partial.content.decode()
    assert _ids(partial) == _ids(full) == [row.pk]
    assert "<html" in full.content.decode()


def test_request_detail_shows_own_metadata(user_client, record):
    row = record(
        utc(2025, 3, 1, 8, 0, 1),
        request_id="req-detail-1",
        prompt_tokens=11,
        completion_tokens=22,
        ttft_ms=33.0,
        activation_layers=[3],
    )

    response = user_client.get(f"/usage/requests/{row.pk}/")

    assert response.status_code == 200
    text = response.content.decode()
    assert "req-detail-1" in text
    cells = dict(table_rows(text, "request-metadata"))
    assert cells["Prompt tokens"] == "11"
    assert cells["Completion tokens"] == "22"
    assert cells["Time to first token (ms)"] == "33.0"
    assert cells["Activation layers"] == "3"


def test_another_users_request_detail_is_not_found(user_client, record, other_user):
    others_key, _ = api_key_create(user=other_user, name="theirs", acting_user=None)
    theirs = record(utc(2025, 3, 1), key=others_key)

    assert user_client.get(f"/usage/requests/{theirs.pk}/").status_code == 404
    assert user_client.get("/usage/requests/999999999/").status_code == 404


def test_request_from_the_playground_links_to_its_run(user_client, record, approved_user):
    from accounts.services.playground_key import playground_key_get_or_create
    from playground.models import Run

    playground_key, _ = playground_key_get_or_create(user=approved_user)
    sent = record(utc(2025, 3, 1), key=playground_key, request_id="req-from-playground")
    scored = record(utc(2025, 3, 1), key=playground_key, request_id="req-of-a-score")
    elsewhere = record(utc(2025, 3, 2), request_id="req-from-a-script")
    run = Run.objects.create(
        user=approved_user,
        request={"model": "smollm2-135m", "prompt": "Hi"},
        request_id="req-from-playground",
    )

    linked = user_client.get(f"/usage/requests/{sent.pk}/").content.decode()
    plain = user_client.get(f"/usage/requests/{elsewhere.pk}/").content.decode()

    assert 'href="/playground/requests/req-from-playground/"' in linked
    opened = user_client.get("/playground/requests/req-from-playground/")
    assert opened.status_code == 302 and opened["Location"] == f"/playground/runs/{run.pk}/"
    # A playground request that no run sent (a score's, a comparison's) has no run to open.
    assert user_client.get(f"/playground/requests/{scored.request_id}/").status_code == 404
    assert 'id="playground-rerun"' not in plain
    assert "cannot be re-run from here" in plain


def test_a_harvest_batch_shows_what_was_billed_and_why(user_client, record):
    # One record per harvest batch of 8 prompts: 40 prompt tokens, one generated token each.
    batch = record(
        utc(2025, 3, 1, 8),
        endpoint="harvest",
        request_id="harvest-0123456789ab-0",
        prompt_tokens=40,
        completion_tokens=8,
        activation_layers=[2, 8],
    )
    rows = table_rows(user_client.get("/usage/requests/").content.decode(), "request-log")
    assert rows[0][12].startswith("48 tokens + 8 activation requests (harvest batch of 8 prompts")
    assert "1 generated per captured prompt" in rows[0][12]
    cells = dict(
        table_rows(
            user_client.get(f"/usage/requests/{batch.pk}/").content.decode(), "request-metadata"
        )
    )
    assert cells["Billed (as /v1/usage counts)"].startswith(
        "48 tokens + 8 activation requests: harvest batch of 8 prompts"
    )


def test_an_ordinary_request_is_billed_its_tokens(user_client, record):
    record(utc(2025, 3, 1, 8), prompt_tokens=7, completion_tokens=3)
    rows = table_rows(user_client.get("/usage/requests/").content.decode(), "request-log")
    assert rows[0][12] == "10 tokens"
