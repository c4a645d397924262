"""Benchmark the embedded engine: `.venv-engine/bin/python bench/engine.py`.

Starts `python -m engine serve` on a free loopback port, once per compute dtype (bfloat16,
the baseline, and float32; see `engine.loader.compute_dtype`), then prints medians over a few
repetitions of: single-stream decode tokens/s, aggregate tokens/s with 1, 4 and 16 concurrent
requests (and the ratio to one request), and time to first token for a 256-token prompt.
"""

import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
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


def start_engine(dtype: str) -> tuple[subprocess.Popen, httpx.Client]:
    port = free_port()
    command = [*engine_command(port, python=sys.executable), "--log-level", "warning"]
    env = {**os.environ, "ACS_ENGINE_DTYPE": dtype}
    process = subprocess.Popen(command, cwd=REPO_ROOT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(f"{url}/health", process, f"the engine ({dtype})")
    except RuntimeError:
        stop(process)
        raise
    return process, httpx.Client(base_url=url, timeout=600)


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


def measure_all(client: httpx.Client) -> dict:
    """Every measure once per repetition, interleaved, so that load changes hit them alike."""
    samples: dict = {}
    for repetition in range(REPETITIONS):
        results = {"decode": single_stream_decode(client), "ttft": time_to_first_token(client)}
        for level in CONCURRENCY_LEVELS:
            results[level] = aggregate_throughput(client, level)
        for key, value in results.items():
            samples.setdefault(key, []).append(value)
        print(f"repetition {repetition + 1}: {results}", file=sys.stderr, flush=True)
    return {key: statistics.median(values) for key, values in samples.items()}


DTYPES = ("bfloat16", "float32")


def measure_dtype(dtype: str) -> dict:
    process, client = start_engine(dtype)
    try:
        aggregate_throughput(client, 2)  # warm-up
        return measure_all(client)
    finally:
        client.close()
        stop(process)


def main() -> None:
    medians = {dtype: measure_dtype(dtype) for dtype in DTYPES}
    print(
        f"engine bench ({os.cpu_count()} CPUs, {DECODE_TOKENS} tokens/request, "
        f"median of {REPETITIONS}; ratios are vs 1 concurrent request of the same dtype)"
    )
    print("| measure | " + " | ".join(DTYPES) + " |")
    print("|---|" + "---|" * len(DTYPES))
    print(
        "| single-stream decode (tok/s) | "
        + " | ".join(f"{medians[d]['decode']:.1f}" for d in DTYPES)
        + " |"
    )
    for level in CONCURRENCY_LEVELS:
        cells = [
            f"{medians[d][level]:.1f} ({medians[d][level] / medians[d][1]:.1f}x)" for d in DTYPES
        ]
        print(f"| aggregate, {level} concurrent (tok/s) | " + " | ".join(cells) + " |")
    print(
        f"| time to first token, {TTFT_PROMPT_TOKENS}-token prompt (ms) | "
        + " | ".join(f"{medians[d]['ttft'] * 1000:.0f}" for d in DTYPES)
        + " |"
    )


if __name__ == "__main__":
    main()
