"""Browser tests: Debian's Chromium through Playwright against the whole system (engine,
uvicorn, Celery worker) on the pytest-django test database, which the subprocesses share.

Data is seeded once per session (committed, outside any test transaction) so the server
processes see it; the test database is dropped at the end of the session.
"""

import os

import psycopg
import pytest
import redis as redis_lib
from django.conf import settings
from django.db import connections
from django.test.utils import override_settings
from playwright.sync_api import sync_playwright

from accounts.models import User
from api.models import LanguageModel
from tests.conftest import ENGINE_MODEL_FIELDS, PASSWORD, make_user

from .system import System, launch_chromium

BROWSER_USER = "browser@example.org"
# Playwright's sync API keeps an event loop running in this thread; Django's own database
# calls here (pytest-django's per-test transaction) are still plain synchronous code.
os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")


def _database_url() -> str:
    db = connections["default"].settings_dict
    host = db.get("HOST") or "127.0.0.1"
    port = db.get("PORT") or 5432
    password = f":{db['PASSWORD']}" if db.get("PASSWORD") else ""
    return f"postgres://{db['USER']}{password}@{host}:{port}/{db['NAME']}"


@pytest.fixture(scope="session")
def system(django_db_setup, django_db_blocker, tmp_path_factory):
    """The running system, with an approved user and the model registry pointing at the
    engine. Yields the `System`; meanwhile this process uses the servers' secrets."""
    running = System(tmp_path_factory.mktemp("system"))
    secrets = {name: running.production_env[name] for name in settings.DEVELOPMENT_SECRETS}
    with override_settings(**secrets):
        yield from _system(running, django_db_blocker)


def _system(running, django_db_blocker):
    with django_db_blocker.unblock():
        LanguageModel.objects.update_or_create(
            name="smollm2-135m",
            defaults={
                "upstream_urls": [running.engine_url],
                "activation_upstream_urls": [],
                **ENGINE_MODEL_FIELDS,
                "max_logprobs": 100,
                "status": "live",
                "is_default": True,
            },
        )
        if not User.objects.filter(email=BROWSER_USER).exists():
            make_user(BROWSER_USER)
        database_url = _database_url()
        connections.close_all()
    redis_lib.Redis.from_url(settings.REDIS_URL).flushdb()
    try:
        running.start(database_url=database_url, redis_url=settings.REDIS_URL)
        yield running
    finally:
        running.stop()
        with django_db_blocker.unblock():
            connections.close_all()
            # pytest-django's per-test connection was opened inside Playwright's event-loop
            # context, where close_all() cannot reach it; end it so the test database can
            # be dropped.
            with psycopg.connect(database_url.rsplit("/", 1)[0] + "/postgres") as admin:
                admin.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s",
                    [database_url.rsplit("/", 1)[1]],
                )


@pytest.fixture(scope="session")
def browser():
    with sync_playwright() as playwright:
        chromium = launch_chromium(playwright)
        yield chromium
        chromium.close()


@pytest.fixture
def page(system, browser):
    """A logged-in page of the browser user."""
    context = browser.new_context(base_url=system.web_url)
    context.set_default_timeout(60_000)
    page = context.new_page()
    page.goto("/login/")
    page.fill("input[name=username]", BROWSER_USER)
    page.fill("input[name=password]", PASSWORD)
    page.click("main form button[type=submit]")
    page.wait_for_load_state()
    yield page
    context.close()
