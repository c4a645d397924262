"""Activation patching computed independently of the portal and the engine: transformers' own
float32 forward pass on the engine's weight directory (as `reference_model.py` loads it), with
forward hooks on decoder block L that read its output (the clean run) and replace it at
position p by the clean run's output there (the patched runs).

Run with the engine's virtualenv; reads JSON `{clean_ids, corrupted_ids, target_id, layers,
positions}` on stdin and writes `{compute_dtype, clean, corrupted, cells: {"L,p": logprob}}`:
the target's logprob (natural log) after the prompt, for the clean prompt, the corrupted one,
and the corrupted one patched at each layer L and position p. `compute_dtype` is the dtype the
engine computes in on this machine (its tolerance depends on it).
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


def target_logprob(model, ids: list[int], target_id: int) -> float:
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0, -1].float()
    return float(torch.log_softmax(logits, dim=-1)[target_id])


def block_outputs(model, ids: list[int], layers: list[int]) -> dict[int, torch.Tensor]:
    """The output of each decoder block in `layers`, [tokens, hidden]."""
    rows = {}

    def reader(layer):
        return lambda module, args, output: rows.__setitem__(layer, _hidden(output)[0].clone())

    handles = [model.model.layers[layer].register_forward_hook(reader(layer)) for layer in layers]
    try:
        target_logprob(model, ids, 0)
    finally:
        for handle in handles:
            handle.remove()
    return rows


def patched_logprob(model, ids, target_id, layer, position, clean_row) -> float:
    def replace(module, args, output):
        hidden = _hidden(output).clone()
        hidden[0, position] = clean_row
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    handle = model.model.layers[layer].register_forward_hook(replace)
    try:
        return target_logprob(model, ids, target_id)
    finally:
        handle.remove()


def main() -> None:
    spec = json.load(sys.stdin)
    cache_dir = default_cache_dir()
    if not (cache_dir / "config.json").exists():
        build_cache(cache_dir)
    model = AutoModelForCausalLM.from_pretrained(cache_dir, dtype=torch.float32).eval()
    target = spec["target_id"]
    clean_ids, corrupted_ids = spec["clean_ids"], spec["corrupted_ids"]
    clean_rows = block_outputs(model, clean_ids, spec["layers"])
    cells = {
        f"{layer},{position}": patched_logprob(
            model, corrupted_ids, target, layer, position, clean_rows[layer][position]
        )
        for layer in spec["layers"]
        for position in spec["positions"]
    }
    json.dump(
        {
            "compute_dtype": str(compute_dtype()).removeprefix("torch."),
            "clean": target_logprob(model, clean_ids, target),
            "corrupted": target_logprob(model, corrupted_ids, target),
            "cells": cells,
        },
        sys.stdout,
    )


if __name__ == "__main__":
    main()
