"""A Patchscope computed independently of the portal and the engine: transformers' own float32
forward pass on the engine's weight directory (as `patching_reference.py` loads it), with a
forward hook on decoder block L that replaces its output at the inspection position by the
source state, then greedy decoding (every step recomputes the whole sequence, so the hook
sees the inspection position each time; the end-of-text token does not stop it).

Run with the engine's virtualenv; reads JSON `{inspection_ids, position, max_tokens, rows:
[{target_layer, state}]}` on stdin (`state`: the source state, `hidden` floats) and writes
`{compute_dtype, rows: [{ids, top: [{token string: logprob}, ...]}]}`: per row the greedy
token ids and, at each step, the top 5 logprobs (natural log) by token string, each token
decoded on its own as the API names tokens. `compute_dtype` is the dtype the engine computes
in on this machine (its tolerance depends on it).
"""

import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.loader import build_cache, compute_dtype, default_cache_dir

TOP = 5


def generate(model, tokenizer, ids, *, layer, position, state, max_tokens) -> dict:
    def replace(module, args, output):
        hidden = (output[0] if isinstance(output, tuple) else output).clone()
        hidden[0, position] = state
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    handle = model.model.layers[layer].register_forward_hook(replace)
    sequence, tops = list(ids), []
    try:
        with torch.inference_mode():
            for _ in range(max_tokens):
                logits = model(torch.tensor([sequence]), use_cache=False).logits[0, -1].float()
                logprobs = torch.log_softmax(logits, dim=-1)
                values, indices = logprobs.topk(TOP)
                tops.append(
                    {
                        tokenizer.decode([int(i)], skip_special_tokens=False): float(v)
                        for v, i in zip(values, indices, strict=True)
                    }
                )
                sequence.append(int(indices[0]))
    finally:
        handle.remove()
    return {"ids": sequence[len(ids) :], "top": tops}


def main() -> None:
    spec = json.load(sys.stdin)
    cache_dir = default_cache_dir()
    if not (cache_dir / "config.json").exists():
        build_cache(cache_dir)
    model = AutoModelForCausalLM.from_pretrained(cache_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(cache_dir)
    rows = [
        generate(
            model,
            tokenizer,
            spec["inspection_ids"],
            layer=row["target_layer"],
            position=spec["position"],
            state=torch.tensor(row["state"], dtype=torch.float32),
            max_tokens=spec["max_tokens"],
        )
        for row in spec["rows"]
    ]
    json.dump(
        {"compute_dtype": str(compute_dtype()).removeprefix("torch."), "rows": rows}, sys.stdout
    )


if __name__ == "__main__":
    main()
