"""Starting the project's servers for tests: free loopback ports, the real embedded engine as
a subprocess, an ASGI app under uvicorn in a thread, and waiting until a server is ready.
Plain Python (stdlib, httpx and uvicorn), so the engine suite (in .venv-engine) and the web
suites (in .venv) share it."""

import base64
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import uvicorn

REPO_ROOT = Path(__file__).resolve().parents[1]
ENGINE_PYTHON = REPO_ROOT / ".venv-engine" / "bin" / "python"
# The first start on a new machine dequantises the model (about 30 s on a quiet machine).
STARTUP_TIMEOUT_S = 240


# The servers that the web suite starts beside each other (gateway replicas, the fault suite's
# system) each pool this many connections instead of 16 (hot path) and 8 (Django): with both
# pytest workers' servers up at once, the defaults reached PostgreSQL's max_connections (100,
# its default) beside a CPU hog, where connections are held longer.
TEST_SERVER_DB_POOL = {"ACS_DB_POOL_MAX_SIZE": "4", "ACS_ORM_POOL_MAX_SIZE": "4"}


def generated_secrets() -> dict[str, str]:
    """Fresh values of the secrets that the settings require without DEBUG."""
    return {
        "SECRET_KEY": secrets.token_urlsafe(50),
        "API_KEY_HMAC_SECRET": secrets.token_urlsafe(50),
        "PLAYGROUND_KEY_ENCRYPTION_KEY": base64.urlsafe_b64encode(os.urandom(32)).decode(),
    }


def loopback_production_env() -> dict[str, str]:
    """The production settings (DEBUG off, fresh secrets) for servers on loopback: plain HTTP,
    as no TLS proxy is in front, and e-mail printed instead of sent."""
    return {
        "DEBUG": "0",
        **generated_secrets(),
        "ALLOWED_HOSTS": "127.0.0.1,localhost,testserver",
        "SECURE_SSL_REDIRECT": "0",
        "SESSION_COOKIE_SECURE": "0",
        "CSRF_COOKIE_SECURE": "0",
        "SECURE_HSTS_SECONDS": "0",
        "EMAIL_BACKEND": "django.core.mail.backends.console.EmailBackend",
    }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_ready(
    url: str,
    process: subprocess.Popen,
    what: str,
    ready: Callable[[httpx.Response], bool] = lambda response: response.status_code == 200,
) -> None:
    """Poll `url` until `ready(response)`; fail at once if `process` exits, or on timeout."""
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
            raise RuntimeError(f"{what} did not start within {STARTUP_TIMEOUT_S} s")
        time.sleep(0.3)


def engine_command(
    port: int, python: str | Path = ENGINE_PYTHON, host: str = "127.0.0.1"
) -> list[str]:
    return [str(python), "-m", "engine", "serve", "--host", host, "--port", str(port)]


def uvicorn_command(
    app: str, port: int, python: str | Path = sys.executable, *, lifespan: bool = True
) -> list[str]:
    """uvicorn serving `app` ("module:attribute") on 127.0.0.1:`port`, quietly."""
    command = [str(python), "-m", "uvicorn", app, "--host", "127.0.0.1", "--port", str(port)]
    command += ["--log-level", "warning", "--no-access-log"]
    return command if lifespan else [*command, "--lifespan", "off"]


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@contextmanager
def engine_server(extra_env: dict | None = None) -> Iterator[str]:
    """Run `python -m engine serve` (from .venv-engine) on a free port until the model is
    loaded; yields its base URL and stops it afterwards."""
    port = free_port()
    process = subprocess.Popen(
        [*engine_command(port), "--log-level", "warning"],
        cwd=REPO_ROOT,
        env={**os.environ, **(extra_env or {})},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(f"{url}/health", process, "the engine")
        yield url
    finally:
        stop(process)


def serve_in_thread(app, **config):
    """Run an ASGI app under uvicorn on a free loopback port; returns (server, thread, url)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = {"lifespan": "off", **config}
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, **config))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("server did not start")
        time.sleep(0.01)
    return server, thread, f"http://127.0.0.1:{port}"


def stop_server(server, thread) -> None:
    server.should_exit = True
    thread.join(timeout=10)
