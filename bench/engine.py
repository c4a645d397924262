"""Benchmark the embedded engine: `.venv-engine/bin/python bench/engine.py [--baseline REF]`.

Starts `python -m engine serve` on a free loopback port, once per compute dtype (auto, the one
the engine picks on this CPU, then bfloat16 and float32; see `engine.loader.compute_dtype`),
then prints medians over a few repetitions of:
single-stream decode tokens/s, aggregate tokens/s with 1, 4 and 16 concurrent requests (and
the ratio to one request), and time to first token for a 256-token prompt.

With `--baseline REF` it also checks out REF in a temporary git worktree, runs that commit's
engine (same virtualenv) beside this one, alternates the repetitions between the two so that
the machine's load changes hit both alike, and prints both with the speed-up of this code.

With `--peer llama.cpp` it also runs llama.cpp (`make bench-venv`, bench/llama_cpp_peer.py) on
the same weights, the shipped Q4_1 GGUF file and an F16 one requantised from it by llama.cpp
(cached beside the engine's cache), alternating with the auto dtype's repetitions, and prints
its single-stream decode and time to first token beside the engine's, with the CPU features
each side used.

With `--peer vllm` it also runs vLLM (`make .venv-vllm/.installed`) on the engine's weights,
started as docs/deploy.md §5 says (testsupport/vllm_lens.py) twice: as vLLM-Lens (the plugin loaded;
it forces eager mode) and as plain vLLM (VLLM_PLUGINS empty: no plugin, and vLLM compiles its
graphs, the first time for about ten minutes, later from ~/.cache/vllm). Both run every measure
beside the auto dtype's engine, alternating with its repetitions.
"""

import argparse
import contextlib
import functools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from unittest import mock

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from acs_client.protocol import in_vllm_xargs  # noqa: E402
from engine.loader import default_cache_dir, gguf_directory, model_spec  # noqa: E402
from testsupport import vllm_lens  # noqa: E402
from testsupport.servers import engine_command, free_port, stop, wait_ready  # noqa: E402

MODEL = "smollm2-135m"
REPETITIONS = 3
DECODE_TOKENS = 48
CONCURRENCY_LEVELS = (1, 4, 16)
TTFT_PROMPT_TOKENS = 256
PROMPTS = [
    "Once upon a time",
    "The history of the Roman Empire",
    "def fibonacci(n):",
    "My favourite recipe is",
]
BENCH_PYTHON = REPO_ROOT / ".venv-bench" / "bin" / "python"
PEER_SCRIPT = REPO_ROOT / "bench" / "llama_cpp_peer.py"
CPU_FLAGS_SHOWN = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16")
# What vLLM's log says of its engine: version, eager mode, compilation, its worker's cores.
VLLM_CONFIG = re.compile(
    r"LLM engine \((v[^)]+)\) with config: .*?enforce_eager=(\w+).*?'mode': <CompilationMode\.(\w+)"
)
VLLM_CORES = re.compile(r"core ids=(\[[\d, ]*\])")


def start_engine(dtype: str, code: Path = REPO_ROOT) -> tuple[subprocess.Popen, httpx.Client]:
    """The engine of the checkout `code`, computing in `dtype`, loaded and warmed up."""
    port = free_port()
    command = [*engine_command(port, python=sys.executable), "--log-level", "warning"]
    env = {**os.environ, "ACS_ENGINE_DTYPE": dtype}
    process = subprocess.Popen(command, cwd=code, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(f"{url}/health", process, f"the engine ({dtype}, {code})")
    except RuntimeError:
        stop(process)
        raise
    client = httpx.Client(base_url=url, timeout=600)
    aggregate_throughput(client, 2)  # warm-up
    return process, client


def token_times(client: httpx.Client, body: dict) -> list[float]:
    """Arrival time of each generated token of a streamed completion (logprobs count them)."""
    times = []
    payload = {"model": MODEL, "stream": True, "logprobs": 0, **body}
    with client.stream("POST", "/v1/completions", json=payload) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[len("data: ") :])["choices"]:
                    tokens = (choice.get("logprobs") or {}).get("tokens", [])
                    times += [time.perf_counter()] * len(tokens)
    return times


def single_stream_decode(client: httpx.Client) -> float:
    body = {"prompt": PROMPTS[0], "max_tokens": DECODE_TOKENS, "ignore_eos": True}
    times = token_times(client, body)
    return (len(times) - 1) / (times[-1] - times[0])


def aggregate_throughput(client: httpx.Client, concurrency: int) -> float:
    def one(index: int) -> int:
        body = {
            "model": MODEL,
            "prompt": PROMPTS[index % len(PROMPTS)],
            "max_tokens": DECODE_TOKENS,
            "ignore_eos": True,
            "seed": index,
        }
        return client.post("/v1/completions", json=body).json()["usage"]["completion_tokens"]

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        tokens = sum(pool.map(one, range(concurrency)))
    return tokens / (time.perf_counter() - started)


def ttft_prompt() -> list[int]:
    return [(1000 + 37 * i) % 40000 for i in range(TTFT_PROMPT_TOKENS)]


def time_to_first_token(client: httpx.Client) -> float:
    started = time.perf_counter()
    times = token_times(client, {"prompt": [ttft_prompt()], "max_tokens": 1})
    return times[0] - started


def measure_once(client: httpx.Client) -> dict:
    results = {"decode": single_stream_decode(client), "ttft": time_to_first_token(client)}
    for level in CONCURRENCY_LEVELS:
        results[level] = aggregate_throughput(client, level)
    return results


class EngineRunner:
    """One engine process (checkout `code`, computing in `dtype`), loaded and warmed up."""

    def __init__(self, dtype: str, code: Path):
        self.process, self.client = start_engine(dtype, code)
        try:
            self.features = self._features()
        except Exception:
            self.close()
            raise

    def _features(self) -> str:
        # The baseline's /health may not say the dtype; every version's model card does.
        dtype = self.client.get("/v1/models").json()["data"][0]["dtype"]
        health = self.client.get("/health").json()
        rows = health.get("half_weight_rows", "?")
        half = "every product" if rows == sys.maxsize else f"products of up to {rows} rows"
        capability = health.get("cpu_capability", "?")
        native_rows = health.get("native_decode_rows", 0)
        native = f"decode steps of up to {native_rows} rows" if native_rows else "none"
        onednn_rows = health.get("onednn_weight_rows", 0)
        onednn = f"products of up to {onednn_rows} rows" if onednn_rows else "none"
        return (
            f"torch, {dtype}, CPU capability {capability}, float16-weight kernel: {half},"
            f" oneDNN on reordered weights: {onednn},"
            f" native decode step (engine/csrc/decode.c): {native}"
        )

    def measure_once(self) -> dict:
        return measure_once(self.client)

    def close(self) -> None:
        self.client.close()
        stop(self.process)


class LlamaCppRunner:
    """llama.cpp on one GGUF file, in .venv-bench (bench/llama_cpp_peer.py), warmed up."""

    def __init__(self, model: Path):
        command = [str(BENCH_PYTHON), str(PEER_SCRIPT), "serve", str(model), str(os.cpu_count())]
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.features = self._answer()["system_info"].strip()
        self.measure_once()

    def measure_once(self) -> dict:
        request = {
            "decode_prompt": PROMPTS[0],
            "decode_tokens": DECODE_TOKENS,
            "ttft_ids": ttft_prompt(),
        }
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return self._answer()

    def _answer(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"llama.cpp ({PEER_SCRIPT.name}) exited: {self.process.wait()}")
        return json.loads(line)

    def close(self) -> None:
        self.process.stdin.close()
        stop(self.process)


class VllmRunner:
    """vLLM on the engine's weights (testsupport/vllm_lens.py), with the vLLM-Lens plugin or, when
    `plugin` is false, without it (VLLM_PLUGINS empty), loaded and warmed up; refuses to run
    if a capture request gets activations without the plugin or none with it."""

    def __init__(self, plugin: bool):
        log = REPO_ROOT / ".run" / "vllm-lens" / f"bench-{'lens' if plugin else 'plain'}.log"
        log.unlink(missing_ok=True)
        with mock.patch.dict(os.environ, {} if plugin else {"VLLM_PLUGINS": ""}):
            self.server = vllm_lens.start(log)
        self.client = httpx.Client(
            base_url=self.server.url, headers=self.server.headers(), timeout=600
        )
        try:
            vllm_lens.wait_ready(self.server)
            captured = self._captures()
            if captured != plugin:
                raise RuntimeError(f"vLLM (plugin={plugin}) captured: {captured}; log {log}")
            self.features = self._features(log.read_text(), captured)
            aggregate_throughput(self.client, 2)  # warm-up
        except Exception:
            self.close()
            raise

    def _captures(self) -> bool:
        """Whether a capture request's answer has activations."""
        body = {
            "model": MODEL,
            "prompt": PROMPTS[0],
            "max_tokens": 1,
            "output_residual_stream": [0],
        }
        response = self.client.post("/v1/completions", json=in_vllm_xargs(body))
        return "activations" in response.raise_for_status().json()

    @staticmethod
    def _features(log: str, captured: bool) -> str:
        version, eager, compilation = VLLM_CONFIG.search(log).groups()
        cores = VLLM_CORES.search(log)
        return (
            f"vLLM {version}, bfloat16, enforce_eager={eager}, compilation {compilation},"
            f" worker on cores {cores[1] if cores else '?'},"
            f" capture {'answers' if captured else 'gets no'} activations"
        )

    def measure_once(self) -> dict:
        return measure_once(self.client)

    def close(self) -> None:
        self.client.close()
        vllm_lens.stop(self.server)


def peer_runners(peer: str) -> dict[str, Callable[[], object]]:
    """The runners of `--peer` (name -> a function that starts it)."""
    if peer == "llama.cpp":
        return {
            name: functools.partial(LlamaCppRunner, model) for name, model in peer_models().items()
        }
    if not vllm_lens.VLLM_PYTHON.exists():
        raise SystemExit("--peer vllm needs .venv-vllm: run `make .venv-vllm/.installed` first")
    return {
        "vLLM-Lens": functools.partial(VllmRunner, plugin=True),
        "plain vLLM": functools.partial(VllmRunner, plugin=False),
    }


def peer_models() -> dict[str, Path]:
    """The GGUF files llama.cpp runs: the shipped Q4_1 and an F16 requantised from it."""
    if not BENCH_PYTHON.exists():
        raise SystemExit("--peer llama.cpp needs .venv-bench: run `make bench-venv` first")
    spec = model_spec()
    q4_1 = gguf_directory(spec) / spec.gguf_file
    cache = default_cache_dir()
    f16 = cache.with_name(f"{cache.name}-gguf") / spec.gguf_file.replace("Q4_1", "F16")
    if not f16.exists():
        f16.parent.mkdir(parents=True, exist_ok=True)
        command = [str(BENCH_PYTHON), str(PEER_SCRIPT), "quantize", str(q4_1), str(f16), "F16"]
        subprocess.run(command, check=True)
    return {"llama.cpp F16": f16, "llama.cpp Q4_1": q4_1}


def measure(runners: dict[str, Callable[[], object]], label: str, repetitions: int):
    """Medians per runner (name -> a function that starts it): every measure once per
    repetition, the runners taking turns (in order, then reversed), so load changes hit them
    alike. Also each runner's features line."""
    started = {}
    try:
        for name, start in runners.items():
            started[name] = start()
        samples: dict[str, dict] = {name: {} for name in runners}
        for repetition in range(repetitions):
            order = list(runners) if repetition % 2 == 0 else list(reversed(runners))
            for name in order:
                results = started[name].measure_once()
                for key, value in results.items():
                    samples[name].setdefault(key, []).append(value)
                print(f"{label} {name} {repetition + 1}: {results}", file=sys.stderr, flush=True)
        medians = {
            name: {key: statistics.median(values) for key, values in measures.items()}
            for name, measures in samples.items()
        }
        return medians, {name: runner.features for name, runner in started.items()}
    finally:
        for runner in started.values():
            runner.close()


DTYPES = ("auto", "bfloat16", "float32")


MEASURES = {
    "decode": "single-stream decode (tok/s)",
    **{level: f"aggregate, {level} concurrent (tok/s)" for level in CONCURRENCY_LEVELS},
    "ttft": f"time to first token, {TTFT_PROMPT_TOKENS}-token prompt (ms)",
}


def cell(medians: dict, key) -> str:
    """One runner's median of the measure `key` of MEASURES, as the tables print it."""
    if key == "ttft":
        return f"{medians[key] * 1000:.0f}"
    if key == "decode":
        return f"{medians[key]:.1f}"
    return f"{medians[key]:.1f} ({medians[key] / medians[1]:.1f}x)"


def speed_up(new: dict, old: dict, key) -> str:
    """The speed-up of `new` over `old` in the measure `key` (a shorter time is faster)."""
    ratio = old[key] / new[key] if key == "ttft" else new[key] / old[key]
    return f"{ratio:.2f}x"


@contextlib.contextmanager
def worktree(ref: str):
    """A temporary git worktree of this repository at `ref`."""
    with tempfile.TemporaryDirectory(prefix="engine-baseline-") as parent:
        path = Path(parent) / "checkout"
        git = ["git", "-C", str(REPO_ROOT), "worktree"]
        subprocess.run([*git, "add", "--detach", str(path), ref], check=True, capture_output=True)
        try:
            yield path
        finally:
            subprocess.run([*git, "remove", "--force", str(path)], check=True)


def print_table(medians: dict[str, dict[str, dict]], baseline: str | None, repetitions: int):
    print(
        f"engine bench ({os.cpu_count()} CPUs, {DECODE_TOKENS} tokens/request, median of "
        f"{repetitions}; (Nx) is vs 1 concurrent request of the same engine and dtype"
        + (f"; speed-up is this code over {baseline}" if baseline else "")
        + ")"
    )
    columns = []
    for dtype in medians:
        if baseline:
            columns += [f"{dtype} {baseline}", f"{dtype} this code", f"{dtype} speed-up"]
        else:
            columns.append(dtype)
    print("| measure | " + " | ".join(columns) + " |")
    print("|---|" + "---|" * len(columns))
    for key, measure_name in MEASURES.items():
        cells = []
        for dtype in medians:
            new = medians[dtype]["new"]
            if baseline:
                old = medians[dtype]["baseline"]
                cells += [cell(old, key), cell(new, key), speed_up(new, old, key)]
            else:
                cells.append(cell(new, key))
        print(f"| {measure_name} | " + " | ".join(cells) + " |")


def print_peer_table(auto: dict[str, dict], baseline: str | None) -> None:
    """The measures every one took (llama.cpp: single-stream decode and time to first token)
    of the auto dtype's engines and the peers, measured in the same alternation."""
    names = [name for name in auto if name not in ("baseline", "new")]
    engines = (["baseline"] if baseline else []) + ["new"]
    labels = {"baseline": f"auto {baseline}", "new": "auto this code"}
    columns = [labels[name] for name in engines] + names + [f"this code / {names[0]}"]
    print("\n| measure | " + " | ".join(columns) + " |")
    print("|---|" + "---|" * len(columns))
    for key, measure_name in MEASURES.items():
        if all(key in medians for medians in auto.values()):
            cells = [cell(auto[name], key) for name in [*engines, *names]]
            cells.append(speed_up(auto["new"], auto[names[0]], key))
            print(f"| {measure_name} | " + " | ".join(cells) + " |")


def print_features(features: dict[str, dict[str, str]]) -> None:
    flags = (
        set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else set()
    )
    print("\nCPU flags: " + " ".join(flag for flag in CPU_FLAGS_SHOWN if flag in flags))
    for dtype, by_runner in features.items():
        for name, line in by_runner.items():
            print(f"- {dtype} {name}: {line}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", metavar="REF", help="also run the engine at this git ref")
    parser.add_argument(
        "--peer", choices=["llama.cpp", "vllm"], help="also run this peer on the same weights"
    )
    parser.add_argument("--repetitions", type=int, default=REPETITIONS)
    parser.add_argument(
        "--dtypes", default=",".join(DTYPES), help=f"comma-separated, of {', '.join(DTYPES)}"
    )
    args = parser.parse_args()
    dtypes = args.dtypes.split(",")
    if not set(dtypes) <= set(DTYPES):
        parser.error(f"--dtypes: each of {', '.join(DTYPES)}")
    peers = peer_runners(args.peer) if args.peer else {}
    with contextlib.ExitStack() as stack:
        codes = {"new": REPO_ROOT}
        if args.baseline is not None:
            codes = {"baseline": stack.enter_context(worktree(args.baseline)), **codes}
        medians, features = {}, {}
        for dtype in dtypes:
            runners = {
                name: functools.partial(EngineRunner, dtype, code) for name, code in codes.items()
            }
            if dtype == "auto":
                runners |= peers
            medians[dtype], features[dtype] = measure(runners, dtype, args.repetitions)
    print_table(medians, args.baseline, args.repetitions)
    if peers and "auto" in medians:
        print_peer_table(medians["auto"], args.baseline)
    print_features(features)


if __name__ == "__main__":
    main()
