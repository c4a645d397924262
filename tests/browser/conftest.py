"""Browser tests: Debian's Chromium through Playwright against the whole system (engine,
uvicorn, Celery worker) on the pytest-django test database, which the subprocesses share.

Data is seeded once per session (committed, outside any test transaction) so the server
processes see it; the test database is dropped at the end of the session.
"""

import os
from contextlib import contextmanager

import psycopg
import pytest
import redis as redis_lib
from django.conf import settings
from django.db import connections
from django.test.utils import override_settings
from playwright.sync_api import expect, sync_playwright

from accounts.models import AccessApplication, User, UserStatus
from api.models import LanguageModel
from tests.conftest import ENGINE_MODEL_FIELDS, PASSWORD, make_user
from testsupport.gate import UpstreamGate
from testsupport.second_factor import TOTP_KEY, authenticator_enrolled, totp_code

from .system import System, launch_chromium

BROWSER_USER = "browser@example.org"
STAFF_USER = "browser-staff@example.org"
# Harvests through the Jobs page, kept apart so the browser user's Jobs page draws no chart.
HARVEST_USER = "browser-harvest@example.org"
# Pending applicants the staff tests decide, one each (seeded once per session).
APPLICANTS = ["applicant-approve@example.org", "applicant-reject@example.org"]
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
def engine_gate(system) -> UpstreamGate:
    """The proxy between the system and its engine, through which a test holds requests."""
    return system.engine_gate


@pytest.fixture(scope="session")
def system(django_db_setup, django_db_blocker, tmp_path_factory):
    """The running system, with an approved user and the model registry pointing at the
    engine through an `UpstreamGate` (`system.engine_gate`). Yields the `System`; meanwhile
    this process uses the servers' secrets."""
    running = System(tmp_path_factory.mktemp("system"))
    running.engine_gate = UpstreamGate(running.engine_url)
    running.engine_gate.start()
    secrets = {name: running.production_env[name] for name in settings.DEVELOPMENT_SECRETS}
    try:
        with override_settings(**secrets):
            yield from _system(running, django_db_blocker)
    finally:
        running.engine_gate.stop()


def _system(running, django_db_blocker):
    with django_db_blocker.unblock():
        LanguageModel.objects.update_or_create(
            name="smollm2-135m",
            defaults={
                "upstream_urls": [running.engine_gate.url],
                "activation_upstream_urls": [],
                **ENGINE_MODEL_FIELDS,
                "max_logprobs": 100,
                "status": "live",
                "is_default": True,
            },
        )
        if not User.objects.filter(email=BROWSER_USER).exists():
            make_user(BROWSER_USER)
            # Staff with their authenticator enrolled (of TOTP_KEY): `sign_in` types its code.
            authenticator_enrolled(make_user(STAFF_USER, is_staff=True), key=TOTP_KEY)
            make_user(HARVEST_USER)
            for email in APPLICANTS:
                AccessApplication.objects.create(
                    user=make_user(email, status=UserStatus.PENDING),
                    planned_use="Steering vectors for honesty.",
                    accepted_usage_rules=True,
                )
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
def expected_http_errors() -> list[str]:
    """Paths (ending a request's URL) whose 4xx answers a test provokes on purpose: the `page`
    fixture accepts those, and the console's line about them."""
    return []


# Wraps EventSource.close so the test hears which event streams the page's own script ended.
# Requests the page's own scripts end: an event stream closed, an XMLHttpRequest aborted (htmx
# aborts a poll whose element a swap removes, or on `htmx:abort`).
REPORT_SCRIPT_CANCELLED = """
  const close = EventSource.prototype.close;
  EventSource.prototype.close = function () {
    window.reportScriptCancelled(this.url);
    return close.call(this);
  };
  const open = XMLHttpRequest.prototype.open;
  XMLHttpRequest.prototype.open = function (method, url, ...rest) {
    this.watchedUrl = new URL(url, document.baseURI).href;
    return open.call(this, method, url, ...rest);
  };
  const abort = XMLHttpRequest.prototype.abort;
  XMLHttpRequest.prototype.abort = function () {
    if (this.watchedUrl) window.reportScriptCancelled(this.watchedUrl);
    return abort.call(this);
  };
"""


class PageWatch:
    """What a person would see as broken on a page, collected from the moment it is
    created: console errors, uncaught script errors, failed requests, and answers of 400
    or more (except 4xx answers of `expected_http_errors` paths, and the console's line
    about them).

    A request the browser cancels (net::ERR_ABORTED) is a failure too, unless the page
    cancelled it on purpose: it left for another page while the request was loading, or its
    script closed the event stream (`EventSource.close()`, once the run's `end` event came)
    or aborted the request (`XMLHttpRequest.abort()`: htmx replacing a polling panel).
    The browser's own fetch of the favicon, which it cancels as it pleases, is no page's.
    A stream the server cuts short (net::ERR_INCOMPLETE_CHUNKED_ENCODING) always fails."""

    def __init__(self, page, *, expected_http_errors: list[str]):
        # The test's own list: paths it adds later count too.
        self.expected_http_errors = expected_http_errors
        self.found: list[str] = []
        self.aborted: list = []
        self.cancelled_by_script: set[str] = set()
        self.navigations = 0
        self.started_at: dict = {}
        page.expose_function("reportScriptCancelled", lambda url: self.cancelled_by_script.add(url))
        page.add_init_script(REPORT_SCRIPT_CANCELLED)
        page.on("console", self._console)
        page.on("pageerror", lambda error: self.found.append(f"page error: {error}"))
        page.on("framenavigated", self._navigated)
        page.on("request", lambda request: self.started_at.__setitem__(request, self.navigations))
        page.on("requestfailed", self._failed)
        page.on("response", self._response)

    def _expected(self, url: str) -> bool:
        return url.split("?", 1)[0].endswith(tuple(self.expected_http_errors))

    def _console(self, message):
        if message.type == "error" and not self._expected(message.location.get("url", "")):
            self.found.append(f"console error: {message.text} ({message.location})")

    def _navigated(self, frame):
        if frame.parent_frame is None:
            self.navigations += 1

    def _failed(self, request):
        if request.failure == "net::ERR_ABORTED":
            self.aborted.append((request, self.navigations))
        else:
            self.found.append(f"request failed: {request.url} {request.failure}")

    def _response(self, response):
        if response.status >= 500 or (response.status >= 400 and not self._expected(response.url)):
            self.found.append(f"HTTP {response.status}: {response.url}")

    def problems(self) -> list[str]:
        """Everything found so far, the unintended cancellations included."""
        unintended = [
            f"request cancelled: {request.url}"
            for request, navigations in self.aborted
            if navigations == self.started_at.get(request, navigations)
            and request.url not in self.cancelled_by_script
            and "/favicon" not in request.url
        ]
        return self.found + unintended


# An assertion waits this long for the page to get there (Playwright's own default is 5 s):
# a page waiting on a worker or a tokenizer round trip on a busy 2-core machine (the suite
# beside the production smoke, or on two workers) took longer than 5 s, and a test must not
# pass only on a fast machine. A real failure still fails, 15 s later.
expect.set_options(timeout=15_000)


@contextmanager
def watched_page(browser, system, expected_http_errors: list[str], storage_state=None):
    """A page of a new browser context (with `storage_state`: cookies of an earlier one); on
    leaving the block the context closes and the test fails if any page it showed logged a
    console error, threw, or had a request fail (see `PageWatch`)."""
    context = browser.new_context(base_url=system.web_url, storage_state=storage_state)
    context.set_default_timeout(60_000)
    page = context.new_page()
    watch = PageWatch(page, expected_http_errors=expected_http_errors)
    try:
        yield page
        # What the pages showed until now; closing the context cuts whatever is still loading.
        problems = watch.problems()
    finally:
        context.close()
    assert problems == [], "the pages showed errors"


@pytest.fixture(scope="session")
def sign_in(system, browser):
    """`sign_in(email)`: that persona's browser storage (its session cookie) after signing in
    through the login form, once per session: the servers hash passwords at the production
    cost (a second of a core per sign-in), which each test's own sign-in paid before. Staff,
    whom the login sends on to their second factor, type their authenticator's code there."""
    states = {}

    def signed_in_state(email: str) -> dict:
        if email not in states:
            with watched_page(browser, system, []) as page:
                page.goto("/login/")
                page.fill("input[name=username]", email)
                page.fill("input[name=password]", PASSWORD)
                page.click("main form button[type=submit]")
                page.wait_for_url(lambda url: "/login/" not in url)
                if "/second-factor/" in page.url:
                    page.fill("input[name=code]", totp_code(TOTP_KEY))
                    page.click("main form button[type=submit]")
                    page.wait_for_url(lambda url: "/second-factor/" not in url)
                states[email] = page.context.storage_state()
        return states[email]

    return signed_in_state


@pytest.fixture
def page(system, browser, sign_in, expected_http_errors):
    """A logged-in page of the browser user (an approved researcher)."""
    with watched_page(browser, system, expected_http_errors, sign_in(BROWSER_USER)) as page:
        yield page


@pytest.fixture
def harvest_page(system, browser, sign_in, expected_http_errors):
    """A logged-in page of an approved researcher who runs harvests."""
    with watched_page(browser, system, expected_http_errors, sign_in(HARVEST_USER)) as page:
        yield page


@pytest.fixture
def staff_page(system, browser, sign_in, expected_http_errors):
    """A logged-in page of the staff user."""
    with watched_page(browser, system, expected_http_errors, sign_in(STAFF_USER)) as page:
        yield page
