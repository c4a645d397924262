"""Filter forms of the usage pages. They read the query string (GET), so every filtered view
is a plain link that can be bookmarked, shared and opened without JavaScript."""

import datetime as dt
import re

from django import forms
from django.core.validators import MaxValueValidator

from metering.selectors import RequestLogFilter, UsageDateRange

RANGE_CHOICES = [
    ("7", "Last 7 days"),
    ("30", "Last 30 days"),
    ("90", "Last 90 days"),
    ("custom", "Custom (from/to)"),
]
DEFAULT_RANGE = "30"
MAX_RANGE_DAYS = 366
_STATUS = re.compile(r"^(?:[1-5][0-9]{2}|[245]xx)$")
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
# A date range ends at the midnight after its last day, which date.max does not have.
LAST_DAY = dt.date.max - dt.timedelta(days=1)


def _date_field(label):
    # A text field, not the browser's date picker: the picker shows the day in the browser's
    # locale (mm/dd/yyyy in en-US) beside pages that print every day as YYYY-MM-DD.
    return forms.DateField(
        label=label,
        required=False,
        input_formats=["%Y-%m-%d"],
        validators=[MaxValueValidator(LAST_DAY, message=f"Give a day no later than {LAST_DAY}.")],
        error_messages={"invalid": "Give the day as YYYY-MM-DD, e.g. 2026-12-01."},
        widget=forms.DateInput(
            format="%Y-%m-%d",
            attrs={
                "class": "date",
                "placeholder": "YYYY-MM-DD",
                "inputmode": "numeric",
                "autocomplete": "off",
            },
        ),
        help_text="A whole day in UTC.",
    )


class UsageFilterForm(forms.Form):
    """A range of whole UTC days (last 7/30/90 days up to `today`, or custom from/to), and
    optionally one of the given keys and one of the given models. Build the date range with
    `date_range(user_id=...)` once valid. An empty query string means the default range."""

    range = forms.ChoiceField(choices=RANGE_CHOICES, required=False)

    def __init__(self, data, *, today: dt.date, keys=None, models=(), **kwargs):
        if not data.get("range"):
            data = data.copy()
            data["range"] = DEFAULT_RANGE
        super().__init__(data, **kwargs)
        self.today = today
        self.fields["from"] = _date_field("From")
        self.fields["to"] = _date_field("To")
        if keys is not None:
            self.fields["key"] = forms.ModelChoiceField(
                queryset=keys, required=False, empty_label="All keys"
            )
            self.fields["model"] = forms.ChoiceField(
                choices=[("", "All models"), *((m, m) for m in models)], required=False
            )

    def clean(self):
        cleaned = super().clean()
        chosen = cleaned.get("range")
        if chosen is None:
            return cleaned
        if chosen != "custom":
            cleaned["start"] = self.today - dt.timedelta(days=int(chosen) - 1)
            cleaned["end"] = self.today
            return cleaned
        start, end = cleaned.get("from"), cleaned.get("to")
        if "from" not in self.errors and start is None:
            self.add_error("from", "Give the first day of a custom range.")
        if "to" not in self.errors and end is None:
            self.add_error("to", "Give the last day of a custom range.")
        if start is None or end is None:
            return cleaned
        if start > end:
            self.add_error("to", "The last day must not be before the first day.")
        elif (end - start).days + 1 > MAX_RANGE_DAYS:
            self.add_error("to", f"A custom range spans at most {MAX_RANGE_DAYS} days.")
        cleaned["start"], cleaned["end"] = start, end
        return cleaned

    def date_range(self, *, user_id: int | None) -> UsageDateRange:
        key = self.cleaned_data.get("key")
        return UsageDateRange(
            start=self.cleaned_data["start"],
            end=self.cleaned_data["end"],
            user_id=user_id,
            key_id=key.pk if key else None,
            model=self.cleaned_data.get("model") or None,
        )


def cursor_encode(created_at: dt.datetime, record_id: int) -> str:
    """The `before` parameter naming a request-log row: microseconds since the epoch, '.',
    the row id (URL-safe, exact)."""
    return f"{(created_at - _EPOCH) // dt.timedelta(microseconds=1)}.{record_id}"


def cursor_decode(value: str) -> tuple[dt.datetime, int]:
    micros, _, record_id = value.partition(".")
    return _EPOCH + dt.timedelta(microseconds=int(micros)), int(record_id)


class RequestLogFilterForm(forms.Form):
    """Filters of the request log, plus the keyset cursor `before`."""

    status = forms.CharField(
        required=False,
        max_length=3,
        help_text="A status code (429) or class (2xx, 4xx, 5xx)",
    )
    error_code = forms.CharField(required=False, max_length=64, label="Error code")
    before = forms.CharField(required=False, widget=forms.HiddenInput)

    def __init__(self, data, *, keys, models=(), **kwargs):
        super().__init__(data, **kwargs)
        self.fields["key"] = forms.ModelChoiceField(
            queryset=keys, required=False, empty_label="All keys"
        )
        self.fields["model"] = forms.ChoiceField(
            choices=[("", "All models"), *((m, m) for m in models)], required=False
        )
        self.fields["from"] = _date_field("From")
        self.fields["to"] = _date_field("To")

    def clean_status(self):
        status = self.cleaned_data["status"].strip().lower()
        if status and not _STATUS.match(status):
            raise forms.ValidationError("Give a status code such as 429, or 2xx, 4xx or 5xx.")
        return status

    def clean_before(self):
        before = self.cleaned_data["before"]
        if not before:
            return None
        try:
            return cursor_decode(before)
        except (ValueError, OverflowError):
            raise forms.ValidationError(
                "This page link is damaged; start again from the first page."
            ) from None

    def clean(self):
        cleaned = super().clean()
        start, end = cleaned.get("from"), cleaned.get("to")
        if start and end and start > end:
            self.add_error("to", "The last day must not be before the first day.")
        return cleaned

    def log_filter(self, *, user_id: int) -> RequestLogFilter:
        status = self.cleaned_data["status"]
        key = self.cleaned_data.get("key")
        return RequestLogFilter(
            user_id=user_id,
            key_id=key.pk if key else None,
            model=self.cleaned_data.get("model") or None,
            status_code=int(status) if status.isdigit() else None,
            status_class=status if status.endswith("xx") else None,
            error_code=self.cleaned_data["error_code"].strip() or None,
            start=self.cleaned_data.get("from"),
            end=self.cleaned_data.get("to"),
        )
