"""What the gateway adds to each stream chunk it relays: parsing the upstream's frame (which
it always does, to meter it), making it public (`api.dialect.public_fields`: the contract's
fields, text offsets into the text) and, where that changed it, writing it out again. Against
the parse alone, measured in the same run (a noisy machine: medians of repeated rounds).

    .venv/bin/python bench/dialect.py [--rounds 15] [--chunks 20000]

Chunks as the upstreams send them: vLLM's (with its extra fields, which `public_fields`
removes, so the chunk is written again) and the engine's (already public: parsed only), with
and without logprobs (5 alternatives).
"""

import argparse
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "acs_portal.settings")
os.environ.setdefault("DEBUG", "1")

import django  # noqa: E402 (needs the settings module)

django.setup()

from api import dialect  # noqa: E402
from api.schemas import CompletionRequest  # noqa: E402

TOP = {" Paris": -0.4, " the": -1.9, " a": -2.6, " Lyon": -3.1, " France": -3.3}


def chunk(*, vllm: bool, logprobs: bool) -> bytes:
    choice = {"index": 0, "text": " Paris", "finish_reason": None, "stop_reason": None}
    if logprobs:
        choice["logprobs"] = {
            "text_offset": [24],
            "token_logprobs": [-0.4],
            "tokens": [" Paris"],
            "top_logprobs": [TOP],
        }
    if vllm:
        choice.update(prompt_logprobs=None, prompt_token_ids=None, token_ids=None)
    frame = {
        "id": "cmpl-0123456789abcdef",
        "object": "text_completion",
        "created": 1765100000,
        "model": "smollm2-135m",
        "choices": [choice],
        "usage": None,
    }
    if vllm:
        frame.update(system_fingerprint=None, kv_transfer_params=None)
    return json.dumps(frame, separators=(",", ":")).encode()


def relay(raw: bytes, valid) -> bytes:
    """What the gateway's stream loop does with one chunk (api/completions.py)."""
    frame = json.loads(raw)
    if dialect.public_fields(frame, valid, chunk=True):
        raw = json.dumps(frame, separators=(",", ":")).encode()
    return raw


def per_chunk_us(work, raw: bytes, chunks: int) -> float:
    started = time.perf_counter()
    for _ in range(chunks):
        work(raw)
    return (time.perf_counter() - started) / chunks * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--chunks", type=int, default=20_000)
    args = parser.parse_args()
    print(f"{'upstream chunk':<28}{'parse µs':>10}{'relay µs':>10}{'added µs':>10}{'ratio':>8}")
    for vllm in (False, True):
        for logprobs in (False, True):
            request = CompletionRequest(
                model="smollm2-135m", prompt="x", stream=True, logprobs=5 if logprobs else None
            )
            valid = SimpleNamespace(request=request, special_tokens=frozenset({"<|im_end|>"}))
            raw = chunk(vllm=vllm, logprobs=logprobs)
            parses, relays = [], []
            for _ in range(args.rounds):
                parses.append(per_chunk_us(json.loads, raw, args.chunks))
                relays.append(per_chunk_us(functools.partial(relay, valid=valid), raw, args.chunks))
            parse, relayed = statistics.median(parses), statistics.median(relays)
            name = f"{'vLLM' if vllm else 'engine'}{', logprobs 5' if logprobs else ''}"
            print(
                f"{name:<28}{parse:>10.2f}{relayed:>10.2f}{relayed - parse:>10.2f}"
                f"{relayed / parse:>8.2f}"
            )


if __name__ == "__main__":
    main()
