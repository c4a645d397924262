"""Every page shows a moment one way: to the minute (or second), in UTC, saying so."""

import datetime as dt

from django.template import engines

from accounts.templatetags.timestamps import utc


def test_a_moment_is_shown_in_utc_to_the_minute_without_microseconds():
    berlin = dt.timezone(dt.timedelta(hours=1))
    moment = dt.datetime(2026, 12, 1, 1, 56, 53, 4293, tzinfo=berlin)
    assert utc(moment) == "2026-12-01 00:56 UTC"
    assert utc(moment, "seconds") == "2026-12-01 00:56:53 UTC"


def test_a_moment_that_has_not_happened_leaves_room_for_a_default():
    rendered = engines["django"].from_string('{{ never|utc|default:"never" }}')
    assert rendered.render({"never": None}) == "never"
