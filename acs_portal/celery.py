"""The project's Celery app (`celery -A acs_portal`), configured from the Django settings
(CELERY_*), and what every task's process does around each task. Services send tasks with
`infra.tasks`."""

import os

from celery import Celery
from celery.signals import task_postrun, task_prerun
from django.db import close_old_connections

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "acs_portal.settings")

app = Celery("acs_portal")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


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
