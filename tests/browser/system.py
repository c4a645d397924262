"""The whole system for browser tests and the playground benchmark: the real embedded engine,
uvicorn serving acs_portal.asgi (portal, playground and the /v1 gateway) and a Celery worker,
each on a free loopback port, all stopped by `System.stop`."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[2]
WEB_BIN = REPO_ROOT / ".venv" / "bin"
ENGINE_PYTHON = REPO_ROOT / ".venv-engine" / "bin" / "python"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
STARTUP_TIMEOUT_S = 180


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait(url: str, ready, process: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode}")
        try:
            if ready(httpx.get(url, timeout=2)):
                return
        except (httpx.HTTPError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start in time")
        time.sleep(0.3)


class System:
    """Start with `start(database_url=..., redis_url=...)`; `engine_url` is known before
    start so the model registry can point at it."""

    def __init__(self, log_dir: Path):
        self.engine_port, self.web_port = free_port(), free_port()
        self.engine_url = f"http://127.0.0.1:{self.engine_port}"
        self.web_url = f"http://127.0.0.1:{self.web_port}"
        self.log_dir = log_dir
        self.processes: list[subprocess.Popen] = []

    def _spawn(self, name: str, command: list[str], env: dict) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        process = subprocess.Popen(
            command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
        )
        self.processes.append(process)
        return process

    def start(self, *, database_url: str, redis_url: str) -> None:
        env = {
            **os.environ,
            "DATABASE_URL": database_url,
            "REDIS_URL": redis_url,
            "CELERY_BROKER_URL": redis_url,
            "ENGINE_URL": self.engine_url,
            "GATEWAY_URL": self.web_url,
            "SITE_URL": self.web_url,
            "DJANGO_SETTINGS_MODULE": "acs_portal.settings",
            "ACS_TOKENIZER_CACHE_DIR": str(self.log_dir / "tokenizers"),
            "CELERY_TASK_ALWAYS_EAGER": "0",
            "PYTHONUNBUFFERED": "1",
        }
        engine = self._spawn(
            "engine",
            [
                str(ENGINE_PYTHON),
                "-m",
                "engine",
                "serve",
                "--port",
                str(self.engine_port),
                "--log-level",
                "warning",
            ],
            {**env, "ACS_ENGINE_THREADS": env.get("ACS_ENGINE_THREADS", "1")},
        )
        web = self._spawn(
            "web",
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
        )
        self._spawn(
            "worker",
            [
                str(WEB_BIN / "celery"),
                "-A",
                "acs_portal",
                "worker",
                "--pool",
                "threads",
                "--concurrency",
                "4",
                "--loglevel",
                "warning",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
            ],
            env,
        )
        _wait(f"{self.web_url}/login/", lambda r: r.status_code == 200, web, "uvicorn")
        _wait(
            f"{self.engine_url}/health",
            lambda r: r.json().get("model_loaded"),
            engine,
            "engine",
        )

    def stop(self) -> None:
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.processes.clear()


def launch_chromium(playwright):
    """Debian's Chromium, by path (no browser download)."""
    if not Path(CHROMIUM).exists():
        sys.exit(f"{CHROMIUM} is missing: apt-get install chromium")
    return playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
