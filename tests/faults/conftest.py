"""The fault suite (issue #12): the whole system as real processes, on this session's test
database and on a Redis server of its own, with faults injected from outside.

- `system` starts a redis-server, the embedded engine, a uvicorn gateway and a Celery worker
  (each a subprocess on a free port; the stub upstream runs in a thread of this process for
  fast load) and seeds two models. Tests kill and restart these processes themselves, so the
  shared PostgreSQL and Redis of other test runs are never touched.
- Tests commit what they write (`transactional_db`: the subprocesses must see it); each test
  works with a fresh user and key.
- Each test records a row of the fault table (`fault_table.add`); the session's terminal
  summary prints the table and writes it to `.run/faults-table.md` (`table.py`).
- Under pytest-xdist one worker runs them all (tests/conftest.py), so a run starts one system.
"""

import os
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
import redis as redis_lib
from celery import Celery
from django.conf import settings
from django.db import connections
from django.utils import timezone

from accounts.models import User
from accounts.services.keys import api_key_create
from acs_portal.celery import app as celery_app
from api.models import LanguageModel
from infra.redis import redis_sync_reset
from metering import windows
from metering.models import BudgetLease, UsagePeriod
from tests.conftest import ENGINE_MODEL_FIELDS, make_user
from testsupport.servers import (
    REPO_ROOT,
    TEST_SERVER_DB_POOL,
    engine_command,
    free_port,
    wait_ready,
)
from testsupport.stub import StubUpstream

from . import table

WEB_BIN = REPO_ROOT / ".venv" / "bin"
ENGINE_MODEL = "faults-engine"
STUB_MODEL = "faults-stub"
# Job leases of the worker and gateway processes: a killed worker's job is found by the sweep
# this many seconds after its claim (16 and 10 minutes in production).
JOB_LEASE_S = 4


# ---------------------------------------------------------------------------------------
# The fault table


class FaultTable:
    def add(self, *, fault: str, client_saw: str, metered: str, produced: str, recovery: str):
        table.ROWS.append(table.FaultRow(fault, client_saw, metered, produced, recovery))


@pytest.fixture
def fault_table() -> FaultTable:
    return FaultTable()


def pytest_sessionfinish(session):
    """On a pytest-xdist worker: the rows go to the controller, which prints the table."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["fault_rows"] = table.rows_as_dicts()


# ---------------------------------------------------------------------------------------
# Processes


class Service:
    """A subprocess on a fixed port that a test can SIGKILL and start again."""

    def __init__(self, name: str, command: list[str], env: dict, log_dir: Path, ready_url=""):
        self.name, self.command, self.env = name, command, env
        self.log_path = log_dir / f"{name}.log"
        self.ready_url = ready_url
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        log = open(self.log_path, "ab")  # noqa: SIM115 - closed with the process
        self.process = subprocess.Popen(
            self.command, cwd=REPO_ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT
        )
        log.close()

    def wait_ready(self) -> None:
        if self.ready_url:
            wait_ready(self.ready_url, self.process, self.name)

    def kill(self) -> None:
        """SIGKILL: the process gets no chance to clean up."""
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.kill()

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


class RedisService(Service):
    def __init__(self, log_dir: Path):
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        command = [
            "redis-server",
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
        ]
        super().__init__("redis", command, dict(os.environ), log_dir)

    def wait_ready(self) -> None:
        client = redis_lib.Redis.from_url(self.url)
        deadline = time.monotonic() + 30
        while True:
            try:
                client.ping()
                return
            except redis_lib.ConnectionError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start:\n{self.log_tail()}") from None
                time.sleep(0.05)
            finally:
                client.close()


def _database_url() -> str:
    db = connections["default"].settings_dict
    host = db.get("HOST") or "127.0.0.1"
    port = db.get("PORT") or 5432
    password = f":{db['PASSWORD']}" if db.get("PASSWORD") else ""
    return f"postgres://{db['USER']}{password}@{host}:{port}/{db['NAME']}"


class System:
    """The running processes and what the tests need to reach them."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.redis = RedisService(log_dir)
        self.engine_port, self.web_port = free_port(), free_port()
        self.engine_url = f"http://127.0.0.1:{self.engine_port}"
        self.web_url = f"http://127.0.0.1:{self.web_port}"
        self.database_url = _database_url()
        self.stub = StubUpstream()
        env = {
            **os.environ,
            "DATABASE_URL": self.database_url,
            "REDIS_URL": self.redis.url,
            "CELERY_BROKER_URL": self.redis.url,
            "ENGINE_URL": self.engine_url,
            "GATEWAY_URL": self.web_url,
            "SITE_URL": self.web_url,
            "DJANGO_SETTINGS_MODULE": "acs_portal.settings",
            "ACS_TOKENIZER_CACHE_DIR": str(log_dir / "tokenizers"),
            "MEDIA_ROOT": str(log_dir / "media"),
            "CELERY_TASK_ALWAYS_EAGER": "0",
            "ACS_COMPLETION_JOB_LEASE_SECONDS": str(JOB_LEASE_S),
            "ACS_HARVEST_JOB_LEASE_SECONDS": str(JOB_LEASE_S),
            "ACS_HARVEST_BATCH_SIZE": "1",
            "LOG_LEVEL": "WARNING",
            "PYTHONUNBUFFERED": "1",
            **TEST_SERVER_DB_POOL,
        }
        self.engine = Service(
            "engine",
            [*engine_command(self.engine_port), "--log-level", "warning"],
            {**env, "ACS_ENGINE_THREADS": "1"},
            log_dir,
            ready_url=f"{self.engine_url}/health",
        )
        self.gateway = Service(
            "gateway",
            [
                str(WEB_BIN / "uvicorn"),
                "acs_portal.asgi:application",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.web_port),
                "--log-level",
                "warning",
            ],
            env,
            log_dir,
            ready_url=f"{self.web_url}/login/",
        )
        self.worker = Service(
            "worker",
            [
                str(WEB_BIN / "celery"),
                "-A",
                "acs_portal",
                "worker",
                "--pool",
                "solo",
                "--loglevel",
                "warning",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
            ],
            env,
            log_dir,
        )
        # Sends tasks to this system's broker (the test process's own Celery app is bound
        # to the shared test Redis). Not the current app: the test thread's shared tasks would
        # then resolve to this app's copies, and later tests patching them would patch copies
        # the code under test (in other threads) never calls.
        self.celery = Celery("faults", broker=self.redis.url, set_as_current=False)

    def start(self) -> None:
        self.redis.start()
        self.redis.wait_ready()
        for service in (self.engine, self.gateway, self.worker):
            service.start()
        # The engine loads its model meanwhile; tests that need it wait (`engine_ready`).
        self.gateway.wait_ready()

    def stop(self) -> None:
        for service in (self.worker, self.gateway, self.engine, self.redis):
            service.stop()
        self.stub.stop()
        self.celery.close()

    def send_task(self, name: str, *args) -> None:
        self.celery.send_task(name, args=list(args))

    def terminate_db_backends(self) -> int:
        """pg_terminate_backend every other connection to this session's test database."""
        name = connections["default"].settings_dict["NAME"]
        with psycopg.connect(self.database_url, autocommit=True) as admin:
            rows = admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = %s AND pid <> pg_backend_pid()",
                [name],
            ).fetchall()
        # This process's own connection was one of them.
        connections.close_all()
        return len(rows)


def _model_defaults(url: str, **fields) -> dict:
    return {
        "upstream_urls": [url],
        "activation_upstream_urls": [url],
        **ENGINE_MODEL_FIELDS,
        "max_logprobs": 100,
        "status": "live",
        "is_default": False,
        **fields,
    }


@pytest.fixture(scope="package")
def system(django_db_setup, tmp_path_factory):
    """The running system (stopped before the test database is dropped)."""
    running = System(tmp_path_factory.mktemp("faults"))
    shared_redis_url = settings.REDIS_URL
    # Signals of this process (the access generation bump) and playground streams must reach
    # the system's Redis.
    settings.REDIS_URL = running.redis.url
    running.stub.start()
    try:
        running.start()
        yield running
    finally:
        running.stop()
        settings.REDIS_URL = shared_redis_url


@pytest.fixture(autouse=True)
def models(system, transactional_db):
    """The registry rows of the engine and of the stub upstream. Every fault test commits
    its rows (`transactional_db`): the system's processes must see them."""
    LanguageModel.objects.update_or_create(
        name=ENGINE_MODEL,
        defaults=_model_defaults(system.engine_url, served_model_name="smollm2-135m"),
    )
    LanguageModel.objects.update_or_create(
        name=STUB_MODEL,
        defaults=_model_defaults(
            system.stub.url, max_model_len=64, n_layers=4, hidden_size=8, vocab_size=1000
        ),
    )
    yield
    # The gateway gives budget leases back LEASE_IDLE_S after a key's last request: let it,
    # before the test database is flushed under it.
    wait_for(
        lambda: not BudgetLease.objects.filter(returned_at=None).exists(),
        timeout=30,
        what="the gateway to give its budget leases back",
    )
    connections.close_all()


@pytest.fixture
def playground_sends_to_system(system, monkeypatch):
    """run_create enqueues on the system's broker."""
    monkeypatch.setattr(
        celery_app, "send_task", lambda name, args, countdown=None: system.send_task(name, *args)
    )
    redis_sync_reset()


@pytest.fixture
def engine_ready(system) -> None:
    system.engine.wait_ready()


@dataclass
class Account:
    user: User
    key: object
    secret: str

    def windows(self) -> dict[str, UsagePeriod]:
        """The key's budget windows of the current day and month, and the account's."""
        today = windows.utc_day(timezone.now())
        starts = {period.name: period.start(today) for period in windows.PERIODS}
        return {
            ("key_" if row.key_id else "account_") + row.period: row
            for row in self._all_windows()
            if row.start == starts[row.period]
        }

    def used_tokens(self) -> int:
        """Tokens the key used, over all its day windows: a test can run across midnight UTC
        (one that did saw only the new day's window and missed a batch billed before it)."""
        return sum(
            row.used_tokens
            for row in self._all_windows()
            if row.key_id and row.period == windows.DAY.name
        )

    def reserved_tokens(self) -> int:
        """Tokens still held in any window of the key or the account, of any day."""
        return sum(row.reserved_tokens for row in self._all_windows())

    def _all_windows(self) -> list[UsagePeriod]:
        rows = UsagePeriod.objects.filter(user=self.user)
        return [row for row in rows if row.key_id in (None, self.key.pk)]


def make_account(*, exact_budgets: bool = False) -> Account:
    """A fresh approved user with one key (so a test's counts are its own). With
    `exact_budgets` the key has an input budget, so the gateway reserves every request of
    it on its own (a database transaction per request) instead of out of a lease."""
    user = make_user(f"{uuid.uuid4().hex[:12]}@faults.example.org")
    key, secret = api_key_create(user=user, name="faults", acting_user=None)
    if exact_budgets:
        key.monthly_input_budget = 10**9
        key.save(update_fields=["monthly_input_budget"])
    return Account(user=user, key=key, secret=secret)


@pytest.fixture
def account(system) -> Account:
    return make_account()


def wait_for(condition, *, timeout: float, what: str, interval: float = 0.1):
    """Poll `condition()` until it returns something truthy (returned); fail after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)
