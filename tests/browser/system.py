"""The whole system for browser tests and the playground benchmark: the real embedded engine,
uvicorn serving acs_portal.asgi (portal, playground and the /v1 gateway) and a Celery worker,
each on a free loopback port, all stopped by `System.stop`. They run with the production
settings (DEBUG off, collected static files) over plain HTTP on loopback."""

import os
import subprocess
import sys
from pathlib import Path

from testsupport.servers import engine_command, free_port, loopback_production_env, stop, wait_ready

REPO_ROOT = Path(__file__).resolve().parents[2]
WEB_BIN = REPO_ROOT / ".venv" / "bin"
# Chromium's old headless mode (Debian's chromium-headless-shell, as Playwright runs headless
# tests): the same engine without the desktop browser's shell. The browser suite took 269 s
# and ~310 s of CPU with it, 305 s and ~390 s with the full `chromium --headless`.
CHROMIUM = "/usr/bin/chromium-headless-shell"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


class System:
    """Start with `start(database_url=..., redis_url=...)`; `engine_url` is known before
    start so the model registry can point at it."""

    def __init__(self, log_dir: Path):
        self.engine_port, self.web_port = free_port(), free_port()
        self.engine_url = f"http://127.0.0.1:{self.engine_port}"
        self.web_url = f"http://127.0.0.1:{self.web_port}"
        self.log_dir = log_dir
        # Whoever writes rows the servers read (API keys, playground keys) needs these secrets.
        self.production_env = loopback_production_env()
        self.processes: list[subprocess.Popen] = []
        # A proxy in front of the engine, where the browser suite sets one (its conftest).
        self.engine_gate = None

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
            **self.production_env,
            "STATIC_ROOT": str(self.log_dir / "static"),
        }
        # The engine loads the model (the longest start) while the static files are collected.
        engine = self._spawn(
            "engine",
            [*engine_command(self.engine_port), "--log-level", "warning"],
            {**env, "ACS_ENGINE_THREADS": env.get("ACS_ENGINE_THREADS", "1")},
        )
        subprocess.run(
            [str(WEB_BIN / "python"), "manage.py", "collectstatic", "--noinput", "-v", "0"],
            cwd=REPO_ROOT,
            env=env,
            check=True,
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
        wait_ready(f"{self.web_url}/login/", web, "uvicorn")
        wait_ready(f"{self.engine_url}/health", engine, "the engine")

    def stop(self) -> None:
        for process in self.processes:
            stop(process)
        self.processes.clear()


def launch_chromium(playwright):
    """Debian's Chromium headless shell, by path (no browser download)."""
    if not Path(CHROMIUM).exists():
        sys.exit(f"{CHROMIUM} is missing: apt-get install chromium-headless-shell")
    return playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
