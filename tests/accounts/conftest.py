"""Fixtures of the portal tests: logged-in clients and e-mail sent by Celery inline."""

import pytest

from acs_portal.celery import app as celery_app

from .support import logged_in


@pytest.fixture(autouse=True)
def celery_runs_inline():
    """Tasks enqueued by services run in the test process (no broker needed)."""
    previous = celery_app.conf.task_always_eager
    celery_app.conf.task_always_eager = True
    yield
    celery_app.conf.task_always_eager = previous


@pytest.fixture
def commit(django_capture_on_commit_callbacks):
    """`with commit(): ...` runs the on-commit hooks (e-mail tasks) of what happens inside."""
    return lambda: django_capture_on_commit_callbacks(execute=True)


@pytest.fixture
def approved_client(approved_user):
    return logged_in(approved_user)


@pytest.fixture
def staff_client(staff_user):
    return logged_in(staff_user)


@pytest.fixture(autouse=True)
def fast_password_hashing(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
