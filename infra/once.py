"""One row per form submission: forms carry a one-time token (`submit_token`), stored on the
row the submission creates, under a unique (user, submit_token) constraint, so that a double
click or a resent page finds what the first post made instead of making it again."""

from collections.abc import Callable
from typing import TypeVar

from django.db import IntegrityError, models

Row = TypeVar("Row", bound=models.Model)


def created_once(
    model: type[Row],
    *,
    user,
    submit_token,
    create: Callable[[], object],
    existing: Callable[[Row], object] = lambda row: row,
):
    """`create()`, unless `user`'s form submission `submit_token` already created its row of
    `model`: then `existing(that row)`. `create` stores the token on the row it creates, in a
    transaction of its own; the unique (user, submit_token) constraint makes a concurrent
    duplicate fail there and roll back whole, so one submission creates once."""

    def previous() -> Row | None:
        if submit_token is None:
            return None
        return model.objects.filter(user=user, submit_token=submit_token).first()

    if (row := previous()) is not None:
        return existing(row)
    try:
        return create()
    except IntegrityError:
        if (row := previous()) is None:
            raise
        return existing(row)
