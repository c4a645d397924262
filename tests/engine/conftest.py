"""Fixtures for the engine suite: the real server in a subprocess, and a reference model.

The server runs `python -m engine serve` on a free loopback port and is shared by the whole
session. The reference model is a separate in-process copy (loaded from the same cache) used to
compute expected logprobs and hidden states directly.
"""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))

MODEL = "smollm2-135m"
STARTUP_TIMEOUT_S = 180


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class EngineProcess:
    """A running `python -m engine serve`; `client` talks to it."""

    def __init__(self, extra_env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, **(extra_env or {})}
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "engine",
                "serve",
                "--port",
                str(self.port),
                "--log-level",
                "warning",
            ],
            cwd=REPO_ROOT,
            env=env,
        )
        self.client = httpx.Client(base_url=self.url, timeout=120)

    def wait_until_loaded(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"engine exited with {self.process.returncode}")
            try:
                if self.client.get("/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError("engine did not load in time")

    def stats(self) -> dict:
        return self.client.get("/health").json()

    def close(self) -> None:
        self.client.close()
        self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()


@pytest.fixture(scope="session")
def engine():
    process = EngineProcess()
    try:
        process.wait_until_loaded()
        yield process
    finally:
        process.close()


@pytest.fixture(scope="session")
def client(engine) -> httpx.Client:
    return engine.client


@pytest.fixture
def complete(client):
    """POST a completion with the model filled in; assert 200 and return the body."""

    def _complete(**fields) -> dict:
        response = client.post("/v1/completions", json={"model": MODEL, **fields})
        assert response.status_code == 200, response.text
        return response.json()

    return _complete


@pytest.fixture(scope="session")
def reference():
    """An in-process copy of the model (eval, bf16); hidden_states[-1] is not the normed one."""
    from engine.loader import load_model

    loaded = load_model()
    loaded.model.config.tie_last_hidden_states = False
    return loaded


def reference_forward(reference, token_ids: list[int]):
    """Logits [tokens, vocab] (float32) and hidden states (tuple of [tokens, hidden] bf16)."""
    with torch.inference_mode():
        output = reference.model(torch.tensor([token_ids]), output_hidden_states=True)
    return output.logits[0].float(), [h[0] for h in output.hidden_states]
