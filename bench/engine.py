"""Benchmark the embedded engine: `.venv-engine/bin/python bench/engine.py [--baseline REF]`.

Starts `python -m engine serve` on a free loopback port, once per compute dtype (bfloat16 and
float32; see `engine.loader.compute_dtype`), then prints medians over a few repetitions of:
single-stream decode tokens/s, aggregate tokens/s with 1, 4 and 16 concurrent requests (and
the ratio to one request), and time to first token for a 256-token prompt.

With `--baseline REF` it also checks out REF in a temporary git worktree, runs that commit's
engine (same virtualenv) beside this one, alternates the repetitions between the two so that
the machine's load changes hit both alike, and prints both with the speed-up of this code.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from tests.servers import engine_command, free_port, stop, wait_ready  # noqa: E402

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


def time_to_first_token(client: httpx.Client) -> float:
    prompt = [(1000 + 37 * i) % 40000 for i in range(TTFT_PROMPT_TOKENS)]
    started = time.perf_counter()
    times = token_times(client, {"prompt": [prompt], "max_tokens": 1})
    return times[0] - started


def measure_once(client: httpx.Client) -> dict:
    results = {"decode": single_stream_decode(client), "ttft": time_to_first_token(client)}
    for level in CONCURRENCY_LEVELS:
        results[level] = aggregate_throughput(client, level)
    return results


def measure(dtype: str, codes: dict[str, Path], repetitions: int) -> dict[str, dict]:
    """Medians per code (name -> checkout) in `dtype`: every measure once per repetition,
    the codes taking turns (first one first, then the other), so load changes hit them alike."""
    engines = {}
    try:
        for name, code in codes.items():
            engines[name] = start_engine(dtype, code)
        samples: dict[str, dict] = {name: {} for name in codes}
        for repetition in range(repetitions):
            order = list(codes) if repetition % 2 == 0 else list(reversed(codes))
            for name in order:
                results = measure_once(engines[name][1])
                for key, value in results.items():
                    samples[name].setdefault(key, []).append(value)
                print(f"{dtype} {name} {repetition + 1}: {results}", file=sys.stderr, flush=True)
        return {
            name: {key: statistics.median(values) for key, values in measures.items()}
            for name, measures in samples.items()
        }
    finally:
        for process, client in engines.values():
            client.close()
            stop(process)


DTYPES = ("bfloat16", "float32")


def rows(medians: dict) -> list[tuple[str, str]]:
    """(measure, cell) rows of one engine's medians in one dtype."""
    table = [("single-stream decode (tok/s)", f"{medians['decode']:.1f}")]
    for level in CONCURRENCY_LEVELS:
        ratio = medians[level] / medians[1]
        table.append(
            (f"aggregate, {level} concurrent (tok/s)", f"{medians[level]:.1f} ({ratio:.1f}x)")
        )
    table.append(
        (
            f"time to first token, {TTFT_PROMPT_TOKENS}-token prompt (ms)",
            f"{medians['ttft'] * 1000:.0f}",
        )
    )
    return table


def speed_ups(new: dict, old: dict) -> list[str]:
    """This code's speed-up over the baseline, per row of `rows` (a shorter time is faster)."""
    cells = [f"{new['decode'] / old['decode']:.2f}x"]
    cells += [f"{new[level] / old[level]:.2f}x" for level in CONCURRENCY_LEVELS]
    cells.append(f"{old['ttft'] / new['ttft']:.2f}x")
    return cells


@contextmanager
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
    for dtype in DTYPES:
        if baseline:
            columns += [f"{dtype} {baseline}", f"{dtype} this code", f"{dtype} speed-up"]
        else:
            columns.append(dtype)
    print("| measure | " + " | ".join(columns) + " |")
    print("|---|" + "---|" * len(columns))
    for index, (measure_name, _) in enumerate(rows(medians[DTYPES[0]]["new"])):
        cells = []
        for dtype in DTYPES:
            if baseline:
                old, new = medians[dtype]["baseline"], medians[dtype]["new"]
                cells += [rows(old)[index][1], rows(new)[index][1], speed_ups(new, old)[index]]
            else:
                cells.append(rows(medians[dtype]["new"])[index][1])
        print(f"| {measure_name} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", metavar="REF", help="also run the engine at this git ref")
    parser.add_argument("--repetitions", type=int, default=REPETITIONS)
    args = parser.parse_args()
    if args.baseline is None:
        medians = {dtype: measure(dtype, {"new": REPO_ROOT}, args.repetitions) for dtype in DTYPES}
    else:
        with worktree(args.baseline) as checkout:
            codes = {"baseline": checkout, "new": REPO_ROOT}
            medians = {dtype: measure(dtype, codes, args.repetitions) for dtype in DTYPES}
    print_table(medians, args.baseline, args.repetitions)


if __name__ == "__main__":
    main()
