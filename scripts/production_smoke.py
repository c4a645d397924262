"""Bring up the production configuration of docs/deploy.md on this machine and use it.

    DATABASE_URL=postgres://.../acs_smoke REDIS_URL=redis://.../14 scripts/production-smoke

Runs the page's commands as they are written (`testsupport/deploy_doc.py`), as root, with ACS_USER
root (this machine's interpreters live under /root, which no other user can read): §0's
service user and virtualenvs; §1's secrets and engine token and §2's copy of `.env.example`'s
production section into a temporary ACS_ETC, edited for this machine by appending its values
of the section's variables, then loaded with §2's `set -a; . …` line, and §2's folders.
Starts the embedded engine, (re)creates DATABASE_URL's database, runs §7's release commands,
starts the processes with §7's honcho line (two web replicas, worker, beat), all in that
environment (DEBUG=0); creates an approved account and key with the CLI; then runs §8's
health check on each replica by its address, sends a completion to one replica, a stream to
the other (it must end with `data: [DONE]`) and a playground run through the portal (log in,
submit the form, wait until the run succeeded). Stops everything it started; exits non-zero
with the reason (and the tail of the logs) when anything fails.
"""

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psycopg

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from testsupport.deploy_doc import (  # noqa: E402
    DocCommandFailed,
    loaded_environment,
    run_doc_block,
    start_doc_command,
)
from testsupport.servers import engine_command, free_port, stop, wait_ready  # noqa: E402

PYTHON = str(ROOT / ".venv" / "bin" / "python")
MODEL = "smollm2-135m"  # the registry row the first migrations create, at ENGINE_URL
# The site's name here (ALLOWED_HOSTS); the proxy would reach its replicas at 127.0.0.1.
SITE = "localhost"
EMAIL = "smoke@example.org"
PASSWORD = "smoke-test-password-1234"
RUN_TIMEOUT_S = 180
# What `check --deploy` may report here and only here: mail goes to the console (no SMTP
# server on this machine) and loopback is plain HTTP (behind the TLS proxy these are set).
LOOPBACK_CHECKS = {
    "mail.E001",
    "security.W004",
    "security.W008",
    "security.W012",
    "security.W016",
}


STARTED = time.monotonic()


def say(message: str) -> None:
    """Print a step with the seconds since the start, so a slow run shows where it waited."""
    print(f"[{time.monotonic() - STARTED:5.1f} s] {message}", flush=True)


class SmokeFailure(Exception):
    pass


def check(condition: bool, message: str) -> None:
    if not condition:
        raise SmokeFailure(message)


def manage(*args: str, env: dict) -> str:
    result = subprocess.run(
        [PYTHON, "manage.py", *args], cwd=ROOT, env=env, capture_output=True, text=True
    )
    if result.returncode != 0:
        raise SmokeFailure(f"manage.py {' '.join(args)} failed:\n{result.stdout}{result.stderr}")
    return result.stdout


def check_deploy(env: dict) -> None:
    result = subprocess.run(
        [PYTHON, "manage.py", "check", "--deploy"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    output = result.stdout + result.stderr
    reported = set(re.findall(r"\(([a-z_]+\.[EWC]\d+)\)", output))
    check(reported <= LOOPBACK_CHECKS, f"check --deploy:\n{output}")
    check(result.returncode == 0 or reported, f"check --deploy failed:\n{output}")
    say(f"check --deploy: only the loopback differences {sorted(reported)}")


def recreate_database(url: str) -> None:
    check(url.startswith("postgres"), "DATABASE_URL must be a PostgreSQL URL")
    server, name = url.rsplit("/", 1)
    with psycopg.connect(f"{server}/postgres", autocommit=True) as connection:
        connection.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        connection.execute(f'CREATE DATABASE "{name}"')


def two_free_ports() -> int:
    """A base port P with P and P+1 free: honcho gives web.1 port P and web.2 port P+1."""
    for _ in range(50):
        base = free_port()
        try:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", base + 1))
            return base
        except OSError:
            continue
    raise SmokeFailure("no two consecutive free ports")


def machine_edits(*, work: Path, base_port: int, web_urls: list[str], engine_url: str) -> dict:
    """The edits docs/deploy.md §2 asks for, made for this machine: its host names, URLs,
    database, Redis and folders, console mail, Procfile.production's knobs, and plain HTTP."""
    redis_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/14")
    return {
        # Plain HTTP on loopback; behind the TLS proxy these stay as .env.example has them.
        "SECURE_SSL_REDIRECT": "0",
        "SESSION_COOKIE_SECURE": "0",
        "CSRF_COOKIE_SECURE": "0",
        "SECURE_HSTS_SECONDS": "0",
        # The site's name; not the replicas' address, which §8's health check uses.
        "ALLOWED_HOSTS": SITE,
        "CSRF_TRUSTED_ORIGINS": ",".join(web_urls),
        "SITE_URL": web_urls[0],
        "GATEWAY_URL": web_urls[0],
        "DATABASE_URL": os.environ["DATABASE_URL"],
        "REDIS_URL": redis_url,
        "CELERY_BROKER_URL": redis_url,
        "ENGINE_URL": engine_url,
        "ACS_ENGINE_ALLOWED_HOSTS": "127.0.0.1",
        "MEDIA_ROOT": str(work / "media"),
        # The repository's own collectstatic output, kept between runs (it takes a while).
        "STATIC_ROOT": str(ROOT / "staticfiles"),
        "ACS_TOKENIZER_CACHE_DIR": str(work / "tokenizers"),
        # No SMTP server here: mail (the approval e-mail) goes to the worker's log.
        "EMAIL_BACKEND": "django.core.mail.backends.console.EmailBackend",
        # Procfile.production's knobs: two web replicas of one uvicorn worker each, on
        # base_port and the next (honcho numbers them from PORT).
        "WEB_HOST": "127.0.0.1",
        "PORT": str(base_port),
        "WEB_WORKERS": "1",
        "FORWARDED_ALLOW_IPS": "127.0.0.1",
        "WORKER_CONCURRENCY": "2",
        # In a folder that only §2's `install -d` line creates: beat does not start without.
        "BEAT_SCHEDULE_FILE": str(work / "beat" / "celerybeat-schedule"),
    }


def production_env(*, etc: Path, edits: dict) -> dict:
    """docs/deploy.md §1 and §2 run as written into `etc`, `edits` appended to acs.env as a
    person edits it (each a variable of the production section), both files loaded with §2's
    line: the environment of every process; then §2's folders created."""
    run_doc_block("secrets", etc=etc)
    run_doc_block("environment", etc=etc)
    section = {line.split("=", 1)[0] for line in (etc / "acs.env").read_text().splitlines()}
    missing = sorted(edits.keys() - section)
    check(not missing, f".env.example's production section lacks {missing}, set here")
    with open(etc / "acs.env", "a") as env_file:
        env_file.write("# This machine (scripts/production_smoke.py)\n")
        env_file.writelines(f"{name}={shlex.quote(value)}\n" for name, value in edits.items())
    loaded = loaded_environment(etc)
    check(loaded["DEBUG"] == "0" and "ACS_ENGINE_TOKEN" in loaded, f"loaded: {sorted(loaded)}")
    env = {**os.environ, **loaded, "CELERY_TASK_ALWAYS_EAGER": "0", "PYTHONUNBUFFERED": "1"}
    run_doc_block("folders", etc=etc, env=env)
    return env


def completion(web_url: str, secret: str) -> None:
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8}
    response = httpx.post(
        f"{web_url}/v1/completions",
        json=body,
        headers={"Authorization": f"Bearer {secret}"},
        timeout=120,
    )
    check(response.status_code == 200, f"completion: {response.status_code} {response.text}")
    payload = response.json()
    check(payload["usage"]["completion_tokens"] >= 1, f"completion without tokens: {payload}")
    say(f"completion on {web_url}: {payload['choices'][0]['text']!r}")


def stream(web_url: str, secret: str) -> None:
    body = {
        "model": MODEL,
        "prompt": "Five reasons to learn Rust:\n1.",
        "max_tokens": 12,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    frames = []
    with httpx.stream(
        "POST",
        f"{web_url}/v1/completions",
        json=body,
        headers={"Authorization": f"Bearer {secret}"},
        timeout=120,
    ) as response:
        check(response.status_code == 200, f"stream: {response.status_code} {response.read()}")
        frames = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    check(frames and frames[-1] == "[DONE]", f"stream did not end with [DONE]: {frames[-3:]}")
    chunks = [json.loads(frame) for frame in frames[:-1]]
    check(not any("error" in chunk for chunk in chunks), f"stream error: {chunks}")
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    say(f"stream on {web_url}: {len(frames)} frames, {text!r}, ends with [DONE]")


def playground_run(web_url: str) -> None:
    """As a browser would without JavaScript: log in, submit the playground form, follow the
    redirect to the run and reload it until the worker has run it through the gateway."""
    with httpx.Client(base_url=web_url, timeout=60) as browser:
        browser.get("/login/")
        login = browser.post(
            "/login/",
            data={"username": EMAIL, "password": PASSWORD},
            headers={"X-CSRFToken": browser.cookies["csrftoken"]},
        )
        check(login.status_code == 302, f"login: {login.status_code}")
        page = browser.get("/playground/")
        check(page.status_code == 200, f"playground page: {page.status_code}")
        submitted = browser.post(
            "/playground/runs/new/",
            data={"model": MODEL, "prompt": "Once upon a time", "max_tokens": "8", "stream": "on"},
            headers={"X-CSRFToken": browser.cookies["csrftoken"]},
        )
        check(submitted.status_code == 302, f"run submit: {submitted.status_code}")
        run_url = submitted.headers["location"]
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while True:
            status = re.search(r'data-run-status="(\w+)"', browser.get(run_url).text)
            check(status is not None, f"{run_url} shows no run status")
            if status[1] == "succeeded":
                say(f"playground run {run_url} succeeded")
                return
            check(status[1] != "failed", f"playground run {run_url} failed")
            check(time.monotonic() < deadline, f"playground run still {status[1]}")
            time.sleep(0.5)


def wait_for_beat(log: Path, honcho: subprocess.Popen) -> None:
    """Wait until beat's log shows a sweep sent: with a new schedule file, one interval (60 s)
    after beat started, which sets the floor of this script's time."""
    deadline = time.monotonic() + 60
    while "Sending due task" not in log.read_text(errors="replace"):
        check(honcho.poll() is None, "honcho exited")
        check(time.monotonic() < deadline, "beat sent no task within 60 s")
        time.sleep(0.5)
    say("beat is sending its sweeps")


def main() -> int:
    check("DATABASE_URL" in os.environ, "set DATABASE_URL to a PostgreSQL database to (re)create")
    check(os.geteuid() == 0, "run it as root: docs/deploy.md starts the processes with setpriv")
    work = Path(tempfile.mkdtemp(prefix="acs-production-smoke-"))
    base_port = two_free_ports()
    replicas = [f"http://127.0.0.1:{base_port}", f"http://127.0.0.1:{base_port + 1}"]
    web_urls = [replica.replace("127.0.0.1", SITE) for replica in replicas]
    engine_port = free_port()
    engine_url = f"http://127.0.0.1:{engine_port}"
    etc = work / "etc"
    processes: list[subprocess.Popen] = []
    honcho_log = work / "honcho.log"
    try:
        run_doc_block("user", etc=etc)
        run_doc_block("install", etc=etc, quiet=False)
        # As on a fresh machine: the settings do not load before the secrets exist.
        edits = machine_edits(
            work=work, base_port=base_port, web_urls=web_urls, engine_url=engine_url
        )
        env = production_env(etc=etc, edits=edits)
        # The engine needs neither the database nor the static files: it loads the model
        # (the longest start) while the release commands run.
        with open(work / "engine.log", "wb") as log:
            processes.append(
                subprocess.Popen(
                    [*engine_command(engine_port), "--log-level", "warning"],
                    cwd=ROOT,
                    env={**env, "ACS_ENGINE_THREADS": env.get("ACS_ENGINE_THREADS", "1")},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
        recreate_database(env["DATABASE_URL"])
        run_doc_block("release", etc=etc, env=env, skip=("check --deploy",), quiet=False)
        check_deploy(env)
        with open(honcho_log, "wb") as log:
            honcho = start_doc_command("start", etc=etc, env=env, log=log)
            processes.append(honcho)
        manage("acs_accounts", "create", EMAIL, "--password", PASSWORD, "--approve", env=env)
        secret = manage("acs_keys", "create", EMAIL, "--name", "smoke", env=env).split()[-1]
        for url in web_urls:
            wait_ready(f"{url}/login/", honcho, f"web replica {url}")
        wait_ready(f"{engine_url}/health", processes[0], "the engine")
        say(f"up: web {web_urls[0]} and {web_urls[1]}, engine {engine_url}, logs in {work}")
        for replica in replicas:
            run_doc_block("health", etc=etc, env=env, SITE=SITE, REPLICA=replica)
            say(f"health check of {replica} with Host: {SITE}: 200")
        completion(web_urls[0], secret)
        stream(web_urls[1], secret)
        playground_run(web_urls[1])
        wait_for_beat(honcho_log, honcho)
        say("production smoke: OK")
        return 0
    except (SmokeFailure, DocCommandFailed, RuntimeError) as failure:
        print(f"production smoke FAILED: {failure}", file=sys.stderr)
        for log in sorted(work.glob("*.log")):
            tail = log.read_text(errors="replace").splitlines()[-30:]
            print(f"--- {log.name} (last lines)", *tail, sep="\n", file=sys.stderr)
        return 1
    finally:
        for process in reversed(processes):
            stop(process)


if __name__ == "__main__":
    sys.exit(main())
