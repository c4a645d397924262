"""Shared personas: an approved user with a key, a pending applicant, a suspended user, staff.

Run through `make test-web` (or set DATABASE_URL to PostgreSQL and REDIS_URL to a scratch
Redis database): the suite uses real PostgreSQL and Redis.
"""

import os
from pathlib import Path

import pytest
import redis as redis_lib
from asgiref.sync import sync_to_async
from django.conf import settings
from django.contrib.auth.hashers import PBKDF2PasswordHasher
from django.db import connections
from django.db.backends.postgresql.operations import DatabaseOperations
from django.test.utils import override_settings

from accounts.models import AccessApplication, User, UserStatus
from accounts.services.keys import api_key_create
from testsupport.servers import engine_server

from .faults import table as fault_table

PASSWORD = "correct-horse-battery-staple"
# The fields of every registry row in front of the real engine. Its sizes are left blank:
# the registry fills them from the engine's GET /v1/models (its config.json).
ENGINE_MODEL_FIELDS = {"supports_activations": True}


FAULTS_DIR = Path(__file__).resolve().parent / "faults"
REPLICAS_MODULE = Path(__file__).resolve().parent / "gateway" / "test_replicas.py"


def pytest_configure(config):
    """Under pytest-xdist (`make test-web` runs two workers, WEB_WORKERS) each worker
    has a test database of its own (pytest-django adds the worker's name) and a Redis database
    of its own: worker N takes the database N below REDIS_URL's (15 gives 15 and 14)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        settings.REDIS_URL = redis_url_of_worker(settings.REDIS_URL, int(worker.removeprefix("gw")))


def redis_url_of_worker(url: str, worker: int) -> str:
    base, _, database = url.rpartition("/")
    number = int(database or 0) - worker
    if number < 0:
        raise pytest.UsageError(f"REDIS_URL {url}: no Redis database {number} for worker {worker}")
    return f"{base}/{number}"


# First: pytest-xdist's own hook reads the groups (into each test's id); run after it, this
# one's groups went unseen and these tests were spread over both workers.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """pytest-xdist (`--dist loadgroup`) runs each group on one worker: the fault suite, so a
    run starts its system once, and the tests of the real engine (`engine_url`), so a run
    loads that model once; and the gateway replica tests, so a run starts one shared pair of
    replicas (two workers each started one, and a killed-replica test's own pair beside them
    took PostgreSQL past its connection limit)."""
    for item in items:
        if item.path.is_relative_to(FAULTS_DIR):
            item.add_marker(pytest.mark.xdist_group("faults"))
        elif item.path == REPLICAS_MODULE:
            item.add_marker(pytest.mark.xdist_group("replicas"))
        elif "engine_url" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("engine"))


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """On the pytest-xdist controller: the fault table's rows of a worker that finished."""
    fault_table.rows_add_dicts(getattr(node, "workeroutput", {}).get("fault_rows", []))


def pytest_terminal_summary(terminalreporter):
    fault_table.table_report(terminalreporter)


class FastPBKDF2PasswordHasher(PBKDF2PasswordHasher):
    """Django's PBKDF2 at 1,000 iterations instead of 1,500,000 (a second or more per hash on
    a busy 2-core machine, paid by every persona and every login). Its hashes are still
    `pbkdf2_sha256$<iterations>$...`, which the servers that the browser and fault suites
    start (with the default hashers) check as they are."""

    iterations = 1000


@pytest.fixture(scope="session", autouse=True)
def fast_password_hashing():
    with override_settings(PASSWORD_HASHERS=[f"{__name__}.FastPBKDF2PasswordHasher"]):
        yield


def make_user(email, *, status=UserStatus.APPROVED, is_staff=False, **fields):
    user = User.objects.create_user(
        email, PASSWORD, status=status, is_staff=is_staff, name=email.split("@")[0], **fields
    )
    if status == UserStatus.APPROVED:
        user.monthly_token_budget = settings.ACS_DEFAULT_ACCOUNT_MONTHLY_TOKENS
        user.save(update_fields=["monthly_token_budget"])
    return user


@pytest.fixture
def approved_user(db):
    return make_user("ada@example.org", organisation="Analytical Engines")


@pytest.fixture
def api_key_pair(approved_user):
    """`(ApiKey, secret)` of the approved user's first key."""
    return api_key_create(user=approved_user, name="first key", acting_user=None)


@pytest.fixture
def api_key(api_key_pair):
    return api_key_pair[0]


@pytest.fixture
def api_secret(api_key_pair):
    return api_key_pair[1]


@pytest.fixture
def pending_user(db):
    user = make_user("pat@example.org", status=UserStatus.PENDING)
    AccessApplication.objects.create(
        user=user, planned_use="Probing truthfulness directions.", accepted_usage_rules=True
    )
    return user


@pytest.fixture
def suspended_user(db):
    return make_user("sam@example.org", status=UserStatus.SUSPENDED)


@pytest.fixture
def staff_user(db):
    return make_user("staff@example.org", is_staff=True)


@pytest.fixture
def other_user(db):
    return make_user("eve@example.org")


@pytest.fixture
def redis_client():
    """The test Redis database, emptied before and after the test."""
    client = redis_lib.Redis.from_url(settings.REDIS_URL)
    client.flushdb()
    yield client
    client.flushdb()


@pytest.fixture(scope="session", autouse=True)
def tables_emptied_by_delete():
    """Transactional tests (the live gateway's, the playground's) end with Django's flush, a
    TRUNCATE of every table: about a second on a busy machine, as PostgreSQL gives each
    table new files and drops its buffers. DELETE of the few rows a test wrote empties them
    in a tenth of that. Every foreign key Django creates is DEFERRABLE INITIALLY DEFERRED, so
    the order of the DELETEs within flush's transaction does not matter. A flush that resets
    sequences or cascades keeps the TRUNCATE."""
    truncate = DatabaseOperations.sql_flush

    def sql_flush(self, style, tables, *, reset_sequences=False, allow_cascade=False):
        if reset_sequences or allow_cascade:
            return truncate(
                self, style, tables, reset_sequences=reset_sequences, allow_cascade=allow_cascade
            )
        return [f"{style.SQL_KEYWORD('DELETE FROM')} {self.quote_name(t)};" for t in tables]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(DatabaseOperations, "sql_flush", sql_flush)
        yield


@pytest.fixture(scope="session")
def engine_url():
    """Base URL of the real embedded engine, one per test session (it takes seconds to load)."""
    with engine_server() as url:
        yield url


@pytest.fixture
async def async_db_connections_closed():
    """Close the connections the async ORM opened in its worker thread, so the test database
    can be dropped at the end of the session."""
    yield
    await sync_to_async(connections.close_all)()
