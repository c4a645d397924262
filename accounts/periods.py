"""UTC budget periods: months start on the 1st, days at midnight, both in UTC."""

import datetime as dt


def _utc(moment: dt.datetime) -> dt.datetime:
    return moment.astimezone(dt.UTC)


def month_start(moment: dt.datetime) -> dt.date:
    return _utc(moment).date().replace(day=1)


def day_start(moment: dt.datetime) -> dt.date:
    return _utc(moment).date()


def next_month_reset(moment: dt.datetime) -> dt.datetime:
    """The instant the monthly window containing `moment` resets."""
    first = month_start(moment)
    year, month = (first.year + 1, 1) if first.month == 12 else (first.year, first.month + 1)
    return dt.datetime(year, month, 1, tzinfo=dt.UTC)


def next_day_reset(moment: dt.datetime) -> dt.datetime:
    """The instant the daily window containing `moment` resets."""
    day = day_start(moment) + dt.timedelta(days=1)
    return dt.datetime(day.year, day.month, day.day, tzinfo=dt.UTC)
