"""Activation patching computed independently of the portal and the engine: transformers' own
float32 forward pass on the engine's weight directory (as `reference_model.py` loads it), with
forward hooks on decoder block L that read its output (the clean run) and replace it at
position p by the clean run's output there (the patched runs).

Run with the engine's virtualenv; reads JSON `{clean_ids, corrupted_ids, targets, layers,
positions}` on stdin (`targets`: token-id lists, each scored after the prompt) and writes
`{compute_dtype, clean, corrupted, cells: {"L,p": scores}}`: each target's score, the sum
of its tokens' logprobs (natural log) after the prompt and the target tokens before it
(teacher-forced), for the clean prompt, the corrupted one, and the corrupted one patched at
each layer L and position p. `compute_dtype` is the dtype the engine computes in on this
machine (its tolerance depends on it).
"""

import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.loader import build_cache, compute_dtype, default_cache_dir


def _hidden(output) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


def target_scores(model, ids: list[int], targets: list[list[int]]) -> list[float]:
    """Each target's summed token logprobs after `ids`, teacher-forced."""
    scores = []
    with torch.inference_mode():
        for target in targets:
            logits = model(torch.tensor([ids + target])).logits[0].float()
            logprobs = torch.log_softmax(logits[len(ids) - 1 : -1], dim=-1)
            scores.append(float(sum(logprobs[j, token] for j, token in enumerate(target))))
    return scores


def block_outputs(model, ids: list[int], layers: list[int]) -> dict[int, torch.Tensor]:
    """The output of each decoder block in `layers`, [tokens, hidden]."""
    rows = {}

    def reader(layer):
        return lambda module, args, output: rows.__setitem__(layer, _hidden(output)[0].clone())

    handles = [model.model.layers[layer].register_forward_hook(reader(layer)) for layer in layers]
    try:
        target_scores(model, ids, [[]])
    finally:
        for handle in handles:
            handle.remove()
    return rows


def patched_scores(model, ids, targets, layer, position, clean_row) -> list[float]:
    def replace(module, args, output):
        hidden = _hidden(output).clone()
        hidden[0, position] = clean_row
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    handle = model.model.layers[layer].register_forward_hook(replace)
    try:
        return target_scores(model, ids, targets)
    finally:
        handle.remove()


def main() -> None:
    spec = json.load(sys.stdin)
    cache_dir = default_cache_dir()
    if not (cache_dir / "config.json").exists():
        build_cache(cache_dir)
    model = AutoModelForCausalLM.from_pretrained(cache_dir, dtype=torch.float32).eval()
    targets = spec["targets"]
    clean_ids, corrupted_ids = spec["clean_ids"], spec["corrupted_ids"]
    clean_rows = block_outputs(model, clean_ids, spec["layers"])
    cells = {
        f"{layer},{position}": patched_scores(
            model, corrupted_ids, targets, layer, position, clean_rows[layer][position]
        )
        for layer in spec["layers"]
        for position in spec["positions"]
    }
    json.dump(
        {
            "compute_dtype": str(compute_dtype()).removeprefix("torch."),
            "clean": target_scores(model, clean_ids, targets),
            "corrupted": target_scores(model, corrupted_ids, targets),
            "cells": cells,
        },
        sys.stdout,
    )


if __name__ == "__main__":
    main()
