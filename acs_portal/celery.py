import os
from collections.abc import Callable

import kombu.exceptions
from celery import Celery
from celery.signals import task_postrun, task_prerun
from django.db import close_old_connections, transaction

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "acs_portal.settings")

app = Celery("acs_portal")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


def task_send(name: str, *args, countdown: int | None = None) -> None:
    """Enqueue the task `name` with `args`. Services enqueue their tasks by name: the tasks
    modules import the services, never the other way round. With CELERY_TASK_ALWAYS_EAGER
    the task runs at once, in this process."""
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


@task_prerun.connect
@task_postrun.connect
def database_connections_checked(sender=None, **kwargs) -> None:
    """Before and after every task, what Django does around every request: give the
    connection back to the process's pool (taking one again checks it: CONN_HEALTH_CHECKS).
    Celery's Django fixup, with CELERY_DB_REUSE_MAX set, does nothing for 2 × N task events:
    the task's connection would stay out of the pool and unchecked, and one that PostgreSQL
    ended (a restart, a failover, pg_terminate_backend) failed every task until the worker
    was restarted. An eager task runs inside its caller's connection and transaction
    (tests): it is left alone, as the fixup leaves it."""
    if not getattr(sender.request, "is_eager", False):
        close_old_connections()
