"""The one way pages show a moment: "2026-12-01 00:56 UTC". A builtin of the templates (see
TEMPLATES in settings), so every template has it without a `{% load %}`."""

import datetime as dt

from django import template

register = template.Library()


@register.filter
def utc(value, precision="minutes"):
    """`value` in UTC to the minute, or to the second with `|utc:"seconds"` (the request
    log, where many requests share a minute). None (it has not happened) stays "", so that
    `|default:"never"` can say so."""
    if value is None or value == "":
        return ""
    shown = "%Y-%m-%d %H:%M:%S UTC" if precision == "seconds" else "%Y-%m-%d %H:%M UTC"
    return value.astimezone(dt.UTC).strftime(shown)
