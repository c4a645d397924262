import os

from celery import Celery

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
