"""Fixtures for the engine suite: the real server in a subprocess, and a reference model.

The server runs `python -m engine serve` on a free loopback port and is shared by the whole
session. The reference model is a separate in-process copy (loaded from the same cache) used to
compute expected logprobs and hidden states directly. Servers with other settings (a token, tiny
limits, float32) serve those in-process copies (`InProcessEngine`): a model load is seconds of
two busy cores, so the session loads each dtype once.
"""

import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))

from reference_model import ReferenceModel, cpu_description  # noqa: E402

from acs_client.protocol import in_vllm_xargs  # noqa: E402
from testsupport.servers import (  # noqa: E402
    engine_command,
    free_port,
    serve_in_thread,
    stop,
    stop_server,
    wait_ready,
)
from testsupport.vllm_lens import vllm_lens_server  # noqa: E402

MODEL = "smollm2-135m"


def pytest_report_header(config) -> list[str]:
    """Which machine this run tested, so a failure says where it came from."""
    from engine.loader import compute_dtype, engine_device

    return [
        f"CPU: {cpu_description()}",
        f"kernels: {kernel_paths()}",
        f"engine: {engine_device()} device, computes in {compute_dtype()} unless a test says",
    ]


# The largest error each numeric comparison saw in this run, beside its bound (by name):
# printed at the end, so that a run under another kernel path (scripts/test-kernels) shows
# what that path moved.
MEASURED: dict[str, tuple[float, float]] = {}


def measured(name: str, value: float, bound: float) -> None:
    """Keep `value` as `name`'s largest error if it is larger than those seen so far."""
    largest = MEASURED.get(name, (0.0, bound))[0]
    MEASURED[name] = (max(largest, float(value)), bound)


def pytest_terminal_summary(terminalreporter) -> None:
    if MEASURED:
        terminalreporter.section(f"largest errors seen, {kernel_paths()}")
        for name, (value, bound) in sorted(MEASURED.items()):
            terminalreporter.write_line(f"{name:<58} {value:10.3g}   bound {bound:.3g}")


def kernel_paths() -> str:
    """The instruction sets torch, oneDNN and MKL may use in this run: the CPU's own, or
    those scripts/test-kernels capped them at (ACS_KERNEL_PATH names the CPU kind)."""
    caps = {
        name: os.environ.get(variable, "the CPU's best")
        for name, variable in [("oneDNN", "ONEDNN_MAX_CPU_ISA"), ("MKL", "MKL_ENABLE_INSTRUCTIONS")]
    }
    kind = os.environ.get("ACS_KERNEL_PATH", "this CPU's own")
    capped = ", ".join(f"{name} up to {cap}" for name, cap in caps.items())
    return f"{kind}: ATen {torch.backends.cpu.get_cpu_capability()}, {capped}"


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


class InProcessEngine:
    """The engine's app (`create_app(config)`: routes, guard, scheduler) served by uvicorn in a
    thread of this process, on a model this process has already loaded; the same surface as
    `EngineProcess`."""

    def __init__(self, url: str):
        self.url = url
        self.pid = os.getpid()
        self.client = httpx.Client(base_url=url, timeout=120)

    def stats(self) -> dict:
        return self.client.get("/health").json()


@contextmanager
def engine_in_process(loaded, **settings):
    """An `InProcessEngine` on `loaded` with `EngineConfig(**settings)`, until the block ends."""
    from engine import server
    from engine.config import EngineConfig

    config = EngineConfig(threads=torch.get_num_threads(), **settings)
    with pytest.MonkeyPatch.context() as patch:
        # The app's loader thread takes this model instead of loading one.
        patch.setattr(server, "load_model", lambda cache_dir: loaded)
        uvicorn_server, thread, url = serve_in_thread(server.create_app(config), lifespan="on")
        running = InProcessEngine(url)
        try:
            deadline = time.monotonic() + 30
            while running.client.get("/health").status_code != 200:
                assert time.monotonic() < deadline, "the in-process engine did not start"
                time.sleep(0.01)
            yield running
        finally:
            running.client.close()
            stop_server(uvicorn_server, thread)


@pytest.fixture(scope="session")
def engine():
    """The engine as a server, computing in the dtype this process measured (`compute_dtype`):
    the in-process reference and the tolerances of its tests go by that measurement, and two
    processes measuring apart on a busy machine (vLLM-Lens starting beside the suite) once
    disagreed, a bfloat16 server held to float32 bounds."""
    from engine.loader import compute_dtype

    dtype = str(compute_dtype()).removeprefix("torch.")
    process = EngineProcess(extra_env={"ACS_ENGINE_DTYPE": dtype})
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
    return completer(client)


def completer(client: httpx.Client):
    """`complete(**fields)` on `client`: see the `complete` fixture."""

    def _complete(**fields) -> dict:
        # Fields as the gateway takes them, sent in the upstream dialect as it sends them.
        response = client.post("/v1/completions", json=in_vllm_xargs({"model": MODEL, **fields}))
        assert response.status_code == 200, response.text
        return response.json()

    return _complete


@pytest.fixture(scope="session")
def reference(model_loaded_with):
    """An in-process copy of the model (eval, in the engine's default dtype); hidden_states[-1]
    is not the normed one (the engine's own decoder, which in-process servers and schedulers
    run on this copy, reads no such flag)."""
    loaded = model_loaded_with()
    loaded.model.config.tie_last_hidden_states = False
    return loaded


@pytest.fixture(scope="session")
def model_loaded_with():
    """`model_loaded_with(**environment)`: the engine's model as `load_model()` loads it with
    these ACS_ENGINE_* variables set (`ACS_ENGINE_DTYPE="float32"`), loaded once per session
    for each device and dtype they resolve to."""
    from engine.loader import compute_dtype, engine_device, load_model

    loaded = {}

    def load(**environment) -> object:
        with pytest.MonkeyPatch.context() as patch:
            for name, value in environment.items():
                patch.setenv(name, value)
            device = engine_device()
            key = (device, compute_dtype(device))
            if key not in loaded:
                loaded[key] = load_model()
        return loaded[key]

    return load


@pytest.fixture(scope="module")
def vllm_lens():
    """An httpx client of vLLM-Lens (testsupport/vllm_lens.py: the server `make test` started,
    or one of the module's own). Only `make test-vllm` runs the modules that use it."""
    with (
        vllm_lens_server() as server,
        httpx.Client(base_url=server.url, headers=server.headers(), timeout=600) as client,
    ):
        yield client


@pytest.fixture(scope="session")
def float32_reference() -> ReferenceModel:
    """transformers' own model in float32 on the engine's weight directory (reference_model.py):
    the independent reference the fidelity tests hold the engine to."""
    from engine.loader import build_cache, default_cache_dir

    cache_dir = default_cache_dir()
    if not (cache_dir / "config.json").exists():
        build_cache(cache_dir)  # the weight directory, from the packaged GGUF file
    return ReferenceModel(cache_dir)


@pytest.fixture(scope="session")
def lens_weights(float32_reference):
    """The playground's logit-lens weights (`playground.lens.tables`) of the engine's weight
    directory, which `float32_reference` builds when missing."""
    from engine.loader import default_cache_dir
    from playground.lens.tables import lens_weights

    return lens_weights(str(default_cache_dir()))


def faster_up_to(row_counts, wins_up_to: int, *, candidate: int):
    """A stand-in for `engine.kernels.fastest_times` in a load-time measurement that times
    `row_counts` in turn: candidate number `candidate` is the faster up to `wins_up_to` rows
    and the slower beyond."""
    counts = iter(row_counts)

    def times(candidates) -> list[float]:
        faster = next(counts) <= wins_up_to
        return [(0.5 if faster else 2.0) if i == candidate else 1.0 for i in range(len(candidates))]

    return times


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
