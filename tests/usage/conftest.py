"""Helpers of the usage-page tests: records at chosen instants, logged-in clients, and a
reader of the rendered tables."""

import datetime as dt
import itertools
from html.parser import HTMLParser

import pytest

from metering.usage import usage_record_create
from testsupport.second_factor import sign_in

_request_ids = itertools.count()


def utc(*args) -> dt.datetime:
    return dt.datetime(*args, tzinfo=dt.UTC)


@pytest.fixture
def record(api_key):
    """`record(at, key=..., **fields)` writes one usage record through the gateway's service,
    at instant `at`, for `key` (default: the approved user's key)."""

    def make(at, *, key=None, **fields):
        values = {
            "request_id": f"req-{next(_request_ids)}",
            "endpoint": "/v1/completions",
            "status_code": 200,
            "latency_ms": 100.0,
            "model": "smollm2-135m",
            **fields,
        }
        return usage_record_create(key=key or api_key, now=at, **values)

    return make


@pytest.fixture
def user_client(client, approved_user):
    client.force_login(approved_user)
    return client


@pytest.fixture
def staff_client(client, staff_user):
    """Signed in as staff, their second factor passed."""
    return sign_in(client, staff_user)


class _TableReader(HTMLParser):
    def __init__(self, table_id):
        super().__init__()
        self.table_id, self.depth, self.rows, self.cell = table_id, 0, [], None
        self.section = None

    def handle_starttag(self, tag, attrs):
        if tag == "table" and dict(attrs).get("id") == self.table_id:
            self.depth = 1
        elif self.depth and tag == "tbody":
            self.section = "body"
        elif self.depth and self.section == "body" and tag == "tr":
            self.rows.append([])
        elif self.depth and self.section == "body" and tag in ("td", "th"):
            self.cell = []

    def handle_endtag(self, tag):
        if not self.depth:
            return
        if tag in ("td", "th") and self.cell is not None:
            self.rows[-1].append("".join(self.cell).strip())
            self.cell = None
        elif tag == "tbody":
            self.section = None
        elif tag == "table":
            self.depth = 0

    def handle_data(self, data):
        if self.cell is not None:
            self.cell.append(data)


def table_rows(html: str, table_id: str) -> list[list[str]]:
    """The text of every body cell of the table with this id, row by row."""
    reader = _TableReader(table_id)
    reader.feed(html)
    return reader.rows
