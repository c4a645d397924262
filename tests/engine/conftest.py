"""Fixtures for the engine suite: the real server in a subprocess, and a reference model.

The server runs `python -m engine serve` on a free loopback port and is shared by the whole
session. The reference model is a separate in-process copy (loaded from the same cache) used to
compute expected logprobs and hidden states directly.
"""

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))

from reference_model import ReferenceModel, cpu_description  # noqa: E402

from tests.servers import engine_command, free_port, stop, wait_ready  # noqa: E402

MODEL = "smollm2-135m"


def pytest_report_header(config) -> list[str]:
    """Which machine this run tested, so a failure says where it came from."""
    from engine.loader import compute_dtype, engine_device

    return [
        f"CPU: {cpu_description()}",
        f"engine: {engine_device()} device, computes in {compute_dtype()} unless a test says",
    ]


class EngineProcess:
    """A running `python -m engine serve` (this virtualenv's Python); `client` talks to it."""

    def __init__(self, extra_env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen(
            [*engine_command(self.port, sys.executable), "--log-level", "warning"],
            cwd=REPO_ROOT,
            env={**os.environ, **(extra_env or {})},
        )
        self.client = httpx.Client(base_url=self.url, timeout=120)

    def wait_until_loaded(self) -> None:
        wait_ready(f"{self.url}/health", self.process, "the engine")

    def stats(self) -> dict:
        return self.client.get("/health").json()

    def close(self) -> None:
        self.client.close()
        stop(self.process)


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


@pytest.fixture(scope="session")
def float32_reference() -> ReferenceModel:
    """transformers' own model in float32 on the engine's weight directory (reference_model.py):
    the independent reference the fidelity tests hold the engine to."""
    from engine.loader import build_cache, default_cache_dir

    cache_dir = default_cache_dir()
    if not (cache_dir / "config.json").exists():
        build_cache(cache_dir)  # the weight directory, from the packaged GGUF file
    return ReferenceModel(cache_dir)


def decode_logprob_tolerance() -> float:
    """How far a logprob of a generated token may sit from a full forward pass's. The engine
    decodes with a KV cache and batches; in float32 that changes logits by ~1e-5, in bfloat16
    (the default on CPUs with native bf16) by up to one bf16 step of a logit of ~20 (0.125)."""
    from engine.loader import compute_dtype

    return 0.01 if compute_dtype() == torch.float32 else 0.15


def reference_forward(reference, token_ids: list[int]):
    """Logits [tokens, vocab] (float32) and hidden states (tuple of [tokens, hidden] bf16)."""
    with torch.inference_mode():
        output = reference.model(torch.tensor([token_ids]), output_hidden_states=True)
    return output.logits[0].float(), [h[0] for h in output.hidden_states]
