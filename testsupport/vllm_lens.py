"""A vLLM server with the vLLM-Lens plugin on the embedded model's weights, started with the
command of docs/deploy.md §5 as it is written there (`.venv-vllm`, `make
.venv-vllm/.installed`). Plain Python (stdlib and httpx): the web suite's tests/vllm, the
engine suite's fidelity check against it and `bench/engine.py --peer vllm` share it.

`make test` starts one at its beginning (`scripts/vllm-lens start`), so that its start-up
(two to three minutes on a 2-core machine) overlaps the other suites, and stops it at the
end; `running()` finds it. Without one running, `vllm_lens_server()` starts its own.
"""

import json
import os
import secrets
import signal
import subprocess
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from .deploy_doc import start_doc_command
from .servers import REPO_ROOT, free_port

VLLM_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
ENGINE_PYTHON = REPO_ROOT / ".venv-engine" / "bin" / "python"
STATE = REPO_ROOT / ".run" / "vllm-lens" / "server.json"
MODEL = "smollm2-135m"
# The KV cache's memory: a few requests of this project's tests need little.
KV_CACHE_GIB = "1"
# Start-up took 107-181 s on a quiet 2-core machine; beside the other suites, longer.
STARTUP_TIMEOUT_S = 900


@dataclass
class VllmLens:
    url: str
    token: str  # its --api-key: every request but /health sends it
    pid: int
    log: str

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.token}"}


def weights_directory() -> str:
    """The engine's converted weights (built on first use), which vLLM loads as they are."""
    command = [str(ENGINE_PYTHON), "-m", "engine", "weights"]
    return subprocess.run(command, check=True, capture_output=True, text=True).stdout.strip()


def start(log_path: Path) -> VllmLens:
    """Start the server in a session of its own (a pytest run or make may outlive it) and
    return at once; `wait_ready` waits for its model."""
    port, token = free_port(), secrets.token_urlsafe(24)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        process = start_doc_command(
            "vllm-serve",
            etc=log_path.parent,
            env={**os.environ, "ACS_ENGINE_TOKEN": token},
            log=log,
            new_session=True,
            WEIGHTS=weights_directory(),
            VLLM_HOST="127.0.0.1",
            VLLM_PORT=str(port),
            KV_CACHE_GIB=KV_CACHE_GIB,
        )
    return VllmLens(f"http://127.0.0.1:{port}", token, process.pid, str(log_path))


def alive(server: VllmLens) -> bool:
    try:
        os.kill(server.pid, 0)
    except OSError:
        return False
    return True


def wait_ready(server: VllmLens) -> None:
    """Wait until the server lists its model; fail if it exits first, or on timeout (with the
    end of its log)."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        try:
            listed = httpx.get(f"{server.url}/v1/models", headers=server.headers(), timeout=5)
            if listed.status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if not alive(server) or time.monotonic() > deadline:
            tail = Path(server.log).read_text(errors="replace")[-3000:]
            raise RuntimeError(f"vLLM-Lens did not start (log {server.log}):\n{tail}")
        time.sleep(1)


def stop(server: VllmLens) -> None:
    """SIGTERM, then SIGKILL after 30 s, to the server's whole process group (its engine core
    and worker processes)."""
    try:
        os.killpg(server.pid, signal.SIGTERM)
    except OSError:
        return
    deadline = time.monotonic() + 30
    while alive(server) and time.monotonic() < deadline:
        time.sleep(0.2)
    if alive(server):
        os.killpg(server.pid, signal.SIGKILL)


def running() -> VllmLens | None:
    """The server `make test` started (`scripts/vllm-lens start`), if it still runs."""
    if not STATE.exists():
        return None
    server = VllmLens(**json.loads(STATE.read_text()))
    return server if alive(server) else None


def record(server: VllmLens) -> None:
    STATE.parent.mkdir(parents=True, exist_ok=True)
    STATE.write_text(json.dumps(asdict(server)))


@contextmanager
def vllm_lens_server():
    """The running server of `make test`, or one started here and stopped afterwards."""
    server = running()
    if server is not None:
        wait_ready(server)
        yield server
        return
    server = start(REPO_ROOT / ".run" / "vllm-lens" / f"pytest-{os.getpid()}.log")
    try:
        wait_ready(server)
        yield server
    finally:
        stop(server)
