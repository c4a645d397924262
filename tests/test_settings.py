"""The settings fail closed: without DEBUG they refuse to start on a missing or published
secret, read every security setting from the environment, and refuse malformed values; the
documented production environment passes `check --deploy`."""

import os
import re
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from testsupport.deploy_doc import DEPLOY_DOC, doc_block, production_environment
from testsupport.servers import REPO_ROOT, generated_secrets

SETTINGS_FILE = REPO_ROOT / "acs_portal" / "settings.py"
# Every variable these tests vary, cleared first so the test's own environment decides.
VARIABLES = [
    "DEBUG",
    *settings.DEVELOPMENT_SECRETS,
    "ALLOWED_HOSTS",
    "CSRF_TRUSTED_ORIGINS",
    "SECURE_SSL_REDIRECT",
    "SESSION_COOKIE_SECURE",
    "CSRF_COOKIE_SECURE",
    "SECURE_HSTS_SECONDS",
    "SECURE_HSTS_INCLUDE_SUBDOMAINS",
    "SECURE_HSTS_PRELOAD",
    "SECURE_PROXY_SSL_HEADER",
    "EMAIL_BACKEND",
]


def load_settings(monkeypatch, **env) -> dict:
    """Run the settings module afresh under exactly `env` (for the variables above)."""
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return runpy.run_path(str(SETTINGS_FILE))


def production(**overrides) -> dict:
    return {"DEBUG": "0", "ALLOWED_HOSTS": "acs.example.org", **generated_secrets(), **overrides}


def documented_production_env() -> dict:
    """The production environment as docs/deploy.md makes it: its secrets and the production
    section of .env.example, loaded by sh (`set -a; . file`)."""
    with tempfile.TemporaryDirectory() as etc:
        return production_environment(Path(etc))


def test_debug_is_off_unless_set(monkeypatch):
    env = production()
    del env["DEBUG"]
    assert load_settings(monkeypatch, **env)["DEBUG"] is False


@pytest.mark.parametrize("name", list(settings.DEVELOPMENT_SECRETS))
def test_without_debug_a_missing_secret_refuses_to_start(monkeypatch, name):
    env = production()
    del env[name]
    with pytest.raises(ImproperlyConfigured, match=f"{name} is unset"):
        load_settings(monkeypatch, **env)


@pytest.mark.parametrize("name", list(settings.DEVELOPMENT_SECRETS))
def test_without_debug_a_published_development_secret_refuses_to_start(monkeypatch, name):
    env = production(**{name: settings.DEVELOPMENT_SECRETS[name]})
    with pytest.raises(ImproperlyConfigured, match=f"{name} is the published development value"):
        load_settings(monkeypatch, **env)


def test_without_debug_the_secrets_must_differ(monkeypatch):
    env = production()
    env["API_KEY_HMAC_SECRET"] = env["SECRET_KEY"]
    with pytest.raises(ImproperlyConfigured, match="must all be different"):
        load_settings(monkeypatch, **env)


def test_without_debug_allowed_hosts_must_be_set(monkeypatch):
    with pytest.raises(ImproperlyConfigured, match="ALLOWED_HOSTS is unset"):
        load_settings(monkeypatch, **production(ALLOWED_HOSTS=" , "))


def test_a_playground_key_that_is_not_a_fernet_key_is_refused(monkeypatch):
    with pytest.raises(ImproperlyConfigured, match="PLAYGROUND_KEY_ENCRYPTION_KEY is not a Fernet"):
        load_settings(monkeypatch, **production(PLAYGROUND_KEY_ENCRYPTION_KEY="short"))


def test_with_debug_the_development_secrets_fill_in(monkeypatch):
    loaded = load_settings(monkeypatch, DEBUG="1")
    assert loaded["SECRET_KEY"] == settings.DEVELOPMENT_SECRETS["SECRET_KEY"]
    assert loaded["SECURE_SSL_REDIRECT"] is False
    assert "127.0.0.1" in loaded["ALLOWED_HOSTS"]


@pytest.mark.parametrize("value", ["flase", "2", "enabled"])
def test_a_malformed_boolean_is_refused_naming_variable_and_value(monkeypatch, value):
    with pytest.raises(ImproperlyConfigured, match=f"SESSION_COOKIE_SECURE='{value}' is not a"):
        load_settings(monkeypatch, **production(SESSION_COOKIE_SECURE=value))


def test_a_malformed_debug_is_refused_rather_than_read_as_off(monkeypatch):
    with pytest.raises(ImproperlyConfigured, match="DEBUG='ture' is not a boolean"):
        load_settings(monkeypatch, **production(DEBUG="ture"))


def test_a_malformed_integer_is_refused_naming_variable_and_value(monkeypatch):
    with pytest.raises(ImproperlyConfigured, match="SECURE_HSTS_SECONDS='1y' is not an integer"):
        load_settings(monkeypatch, **production(SECURE_HSTS_SECONDS="1y"))


def test_an_integer_below_its_minimum_is_refused(monkeypatch):
    with pytest.raises(ImproperlyConfigured, match="SECURE_HSTS_SECONDS=-1 is below its minimum"):
        load_settings(monkeypatch, **production(SECURE_HSTS_SECONDS="-1"))
    monkeypatch.setenv("ACS_JOB_MAX_ATTEMPTS", "0")
    with pytest.raises(ImproperlyConfigured, match="ACS_JOB_MAX_ATTEMPTS=0 is below its minimum"):
        load_settings(monkeypatch, **production())
    monkeypatch.setenv("ACS_JOB_MAX_ATTEMPTS", "1")
    assert load_settings(monkeypatch, **production())["ACS_JOB_MAX_ATTEMPTS"] == 1


def test_a_proxy_ssl_header_without_a_value_is_refused(monkeypatch):
    with pytest.raises(ImproperlyConfigured, match="SECURE_PROXY_SSL_HEADER="):
        load_settings(monkeypatch, **production(SECURE_PROXY_SSL_HEADER="HTTP_X_FORWARDED_PROTO"))


def test_without_debug_the_site_defaults_to_https_only(monkeypatch):
    loaded = load_settings(monkeypatch, **production())
    assert loaded["SECURE_SSL_REDIRECT"] is True
    assert loaded["SESSION_COOKIE_SECURE"] is True
    assert loaded["CSRF_COOKIE_SECURE"] is True
    assert loaded["SECURE_HSTS_SECONDS"] == 365 * 24 * 3600
    assert loaded["MAILERS"]["default"]["BACKEND"] == "django.core.mail.backends.smtp.EmailBackend"


def test_every_security_setting_comes_from_the_environment(monkeypatch):
    loaded = load_settings(
        monkeypatch,
        **production(
            ALLOWED_HOSTS="acs.example.org, www.acs.example.org",
            CSRF_TRUSTED_ORIGINS="https://acs.example.org",
            SECURE_SSL_REDIRECT="off",
            SESSION_COOKIE_SECURE="No",
            CSRF_COOKIE_SECURE="false",
            SECURE_HSTS_SECONDS="600",
            SECURE_HSTS_INCLUDE_SUBDOMAINS="yes",
            SECURE_HSTS_PRELOAD="TRUE",
            SECURE_PROXY_SSL_HEADER="HTTP_X_FORWARDED_PROTO,https",
        ),
    )
    assert loaded["ALLOWED_HOSTS"] == ["acs.example.org", "www.acs.example.org"]
    assert loaded["CSRF_TRUSTED_ORIGINS"] == ["https://acs.example.org"]
    assert loaded["SECURE_SSL_REDIRECT"] is False
    assert loaded["SESSION_COOKIE_SECURE"] is False
    assert loaded["CSRF_COOKIE_SECURE"] is False
    assert loaded["SECURE_HSTS_SECONDS"] == 600
    assert loaded["SECURE_HSTS_INCLUDE_SUBDOMAINS"] is True
    assert loaded["SECURE_HSTS_PRELOAD"] is True
    assert loaded["SECURE_PROXY_SSL_HEADER"] == ("HTTP_X_FORWARDED_PROTO", "https")


def manage(*args, env):
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_check_deploy_is_clean_under_the_documented_production_environment():
    base = {name: value for name, value in os.environ.items() if name not in VARIABLES}
    result = manage(
        "check", "--deploy", "--fail-level", "WARNING", env={**base, **documented_production_env()}
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no issues" in result.stdout


def test_manage_py_without_debug_and_secrets_refuses_to_start_naming_them():
    base = {name: value for name, value in os.environ.items() if name not in VARIABLES}
    result = manage("check", env={**base, "ALLOWED_HOSTS": "acs.example.org"})
    assert result.returncode != 0
    assert "SECRET_KEY is unset" in result.stderr
    assert "API_KEY_HMAC_SECRET is unset" in result.stderr


def test_a_stale_hold_age_shorter_than_a_non_streaming_request_is_refused(monkeypatch):
    """The sweep would free the budget hold of a request still running (a stream marks its
    hold alive, a non-streaming request does not), and others could spend it again."""
    monkeypatch.setenv("ACS_STALE_RESERVATION_SECONDS", "299")
    with pytest.raises(
        ImproperlyConfigured,
        match="ACS_STALE_RESERVATION_SECONDS=299 is below its minimum, 900: a non-streaming",
    ):
        load_settings(monkeypatch, **production())
    monkeypatch.setenv("ACS_STALE_RESERVATION_SECONDS", "900")
    assert load_settings(monkeypatch, **production())["ACS_STALE_RESERVATION_SECONDS"] == 900


def test_the_shortest_stale_hold_age_outlasts_every_hold_that_is_not_marked_alive():
    from api.upstream import NON_STREAMING_TIMEOUT_S
    from metering.gateway import SETTLE_RETRY_S

    longest_unmarked = NON_STREAMING_TIMEOUT_S + sum(SETTLE_RETRY_S)
    assert longest_unmarked < settings.ACS_STALE_RESERVATION_MIN_SECONDS


def test_the_documented_production_environment_loads_in_sh_value_for_value():
    env = documented_production_env()
    assert env["DEBUG"] == "0"
    assert env["DEFAULT_FROM_EMAIL"] == "ACS Portal <access@acs.example.org>"
    assert env["SECURE_HSTS_PRELOAD"] == "1"
    assert env["DATABASE_URL"] == "postgres://acs:CHANGE-ME@db.example.org:5432/acs"
    for secret in (*settings.DEVELOPMENT_SECRETS, "ACS_ENGINE_TOKEN"):
        assert len(env[secret]) >= 32, secret
    prod_lines = [
        line
        for line in (REPO_ROOT / ".env.example").read_text().splitlines()
        if line[:6] == "#prod "
    ]
    assert {line[6:].split("=", 1)[0] for line in prod_lines} <= set(env)


def test_the_development_env_file_loads_in_sh():
    """`.env.example` copied to .env is loaded with `set -a; . ./.env` (and by honcho)."""
    result = subprocess.run(
        ["bash", "-ec", 'set -a; . ./.env.example; set +a; printf %s "$DEFAULT_FROM_EMAIL"'],
        cwd=REPO_ROOT,
        env={"PATH": os.environ["PATH"]},
        capture_output=True,
        text=True,
    )
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout == "ACS Portal <access@acs.local>"


def test_the_processes_in_the_deploy_doc_are_procfile_production():
    lines = (REPO_ROOT / "Procfile.production").read_text().splitlines()
    assert doc_block("procfile") == [line for line in lines if line and line[0] != "#"]


def test_the_production_environment_sets_the_engine_and_every_procfile_knob():
    """Where the first migrate points the embedded model's row, the names the engine
    answers, and each `${NAME:-default}` of Procfile.production: a person edits them in
    the production section, so they must be there (scripts/production-smoke edits no other)."""
    env = documented_production_env()
    knobs = set(re.findall(r"\$\{(\w+):-", (REPO_ROOT / "Procfile.production").read_text()))
    assert "WEB_WORKERS" in knobs
    assert {"ENGINE_URL", "ACS_ENGINE_ALLOWED_HOSTS", *knobs} <= set(env)


def test_the_deploy_docs_connection_count_is_the_example_environments(monkeypatch):
    """docs/deploy.md §3 works its formula out for the example environment on two web
    machines, and the max_connections it sets holds the result."""
    env = documented_production_env()
    for name in ("ACS_DB_POOL_MAX_SIZE", "ACS_ORM_POOL_MAX_SIZE"):
        monkeypatch.delenv(name, raising=False)
    defaults = load_settings(monkeypatch, **production())
    workers, slots = int(env["WEB_WORKERS"]), int(env["WORKER_CONCURRENCY"])
    hot, orm = defaults["ACS_DB_POOL_MAX_SIZE"], defaults["ACS_ORM_POOL_MAX_SIZE"]
    total = 2 * workers * (hot + orm) + slots + 10
    doc = " ".join(DEPLOY_DOC.read_text().split())
    assert f"2 × {workers} × ({hot} + {orm}) + {slots} + 10 = {total}" in doc
    assert int(re.search(r"SET max_connections = (\d+)", doc)[1]) >= total
