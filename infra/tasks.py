"""Sending Celery tasks from services, by name: the tasks modules import the services, never
the other way round. The app is the process's current one (`acs_portal.celery` makes the
project's current when Django loads it)."""

from collections.abc import Callable

import kombu.exceptions
from celery import current_app
from django.db import transaction


def task_send(name: str, *args, countdown: int | None = None) -> None:
    """Enqueue the task `name` with `args`. Services enqueue their tasks by name: the tasks
    modules import the services, never the other way round. With CELERY_TASK_ALWAYS_EAGER
    the task runs at once, in this process."""
    app = current_app
    if app.conf.task_always_eager:
        app.loader.import_default_modules()
        app.tasks[name].apply_async(args, countdown=countdown)
    else:
        app.send_task(name, args=args, countdown=countdown)


class TaskQueueUnreachable(Exception):
    """The broker could not be reached, so a task was not enqueued: what it was for did not
    happen. The message is for the person who asked for it; `code` for the row it failed."""

    code = "queue_unreachable"

    def __init__(self):
        super().__init__(
            "The task queue is unreachable; nothing was run or billed — try again in a moment."
        )


def task_send_on_commit(name: str, *args, unsent: Callable[[TaskQueueUnreachable], None]) -> None:
    """Enqueue the task `name` with `args` once the current transaction commits. If the broker
    cannot be reached (after Celery's publish retries), `unsent(error)` marks what the task was
    for as failed, since its committed row would otherwise wait as queued for a worker that
    never hears of it, and TaskQueueUnreachable is raised out of the commit, to the caller,
    whose page says so. The commit's later hooks are then not run (Django's rule)."""

    def send() -> None:
        try:
            task_send(name, *args)
        except kombu.exceptions.OperationalError as cause:
            error = TaskQueueUnreachable()
            unsent(error)
            raise error from cause

    transaction.on_commit(send)
