"""Write the engine's answers to a fixed set of requests, the fidelity test's reference.

    .venv-engine/bin/python tests/engine/make_fidelity_reference.py --repo /path/to/checkout

runs `python -m engine serve` from the checkout `--repo` (an older commit in a git worktree,
say; this virtualenv's Python), once per compute dtype, and writes what it answers to
REQUESTS into fidelity_reference.json beside this file. The committed reference was made at
commit 74e4f92, before the engine had its own decoder: test_fidelity.py holds the current
engine to the same greedy tokens, logprobs and captured activations.
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
sys.path.insert(0, str(REPO_ROOT))

from acs_client.codec import encode_vector  # noqa: E402
from tests.servers import engine_command, free_port, stop, wait_ready  # noqa: E402

REFERENCE_FILE = HERE / "fidelity_reference.json"
MODEL = "smollm2-135m"
DTYPES = ("float32", "bfloat16")
CAPTURED_LAYERS = [0, 15, 29]
STEERING_VECTOR = np.random.default_rng(16).normal(size=(1, 576)).astype(np.float32)

# Greedy completions covering a lone prompt, a batch of prompts of different lengths (one
# left-padded prefill), prompt scoring, capture and steering.
REQUESTS = [
    {
        "prompt": "The capital of France is",
        "max_tokens": 16,
        "logprobs": 5,
        "output_residual_stream": CAPTURED_LAYERS,
    },
    {
        "prompt": ["def fibonacci(n):", "Once upon a time, in a land far away, there lived a"],
        "max_tokens": 24,
        "logprobs": 5,
        "prompt_logprobs": 3,
    },
    {
        "prompt": "My favourite recipe is",
        "max_tokens": 12,
        "logprobs": 5,
        "output_residual_stream": CAPTURED_LAYERS,
        "apply_steering_vectors": [
            {"activations": encode_vector(STEERING_VECTOR), "layer_indices": [10], "scale": 4.0}
        ],
    },
]


def request_body(request: dict) -> dict:
    return {"model": MODEL, "temperature": 0, "ignore_eos": True, **request}


def answers(client: httpx.Client) -> list[dict]:
    """The choices and activations the engine at `client` answers to REQUESTS."""
    results = []
    for request in REQUESTS:
        response = client.post("/v1/completions", json=request_body(request))
        response.raise_for_status()
        body = response.json()
        results.append({"choices": body["choices"], "activations": body.get("activations")})
    return results


def answers_of_checkout(repo: Path, dtype: str) -> list[dict]:
    port = free_port()
    process = subprocess.Popen(
        [*engine_command(port, sys.executable), "--log-level", "warning"],
        cwd=repo,
        env={**os.environ, "ACS_ENGINE_DTYPE": dtype, "ACS_ENGINE_DEVICE": "cpu"},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(f"{url}/health", process, f"the engine at {repo} ({dtype})")
        with httpx.Client(base_url=url, timeout=300) as client:
            return answers(client)
    finally:
        stop(process)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, required=True, help="checkout whose engine answers")
    args = parser.parse_args()
    commit = subprocess.run(
        ["git", "-C", str(args.repo), "rev-parse", "HEAD"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    reference = {
        "commit": commit,
        "answers": {dtype: answers_of_checkout(args.repo, dtype) for dtype in DTYPES},
    }
    REFERENCE_FILE.write_text(json.dumps(reference) + "\n")
    print(f"wrote {REFERENCE_FILE} from {args.repo} at {commit}")


if __name__ == "__main__":
    main()
