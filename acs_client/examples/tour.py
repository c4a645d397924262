"""A tour of the ACS API with acs_client: a completion, a residual-stream capture, a steered
completion, and a harvest submitted, waited for, downloaded and loaded.

    python -m acs_client.examples.tour --base-url https://acs.example.org --api-key acs-...

or set ACS_BASE_URL and ACS_API_KEY. `--out DIR` keeps the harvest's files (default: a new
temporary folder). Each step prints what it got; the exit status is 0 when all went through.
"""

import argparse
import os
import sys
import tempfile

import numpy as np

from acs_client.client import AcsApiError, AcsClient, steering_vector

PROMPT = "The capital of France is"
STEERED_PROMPT = "I think that"
HARVEST_PROMPTS = ["The quick brown fox jumps over the lazy dog.", "Paris is in France."]


def arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default=os.environ.get("ACS_BASE_URL"))
    parser.add_argument("--api-key", default=os.environ.get("ACS_API_KEY"))
    parser.add_argument("--model", help="a model id (default: the API's default model)")
    parser.add_argument("--out", help="where to keep the harvest's files")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parsed = parser.parse_args(argv)
    if not parsed.base_url or not parsed.api_key:
        parser.error("give --base-url and --api-key, or set ACS_BASE_URL and ACS_API_KEY")
    return parsed


def tour(client: AcsClient, *, model_id: str | None, out: str, progress: bool) -> None:
    models = client.models()
    matching = [m for m in models if (m.id == model_id if model_id else m.default)]
    if not matching:
        raise SystemExit(f"No model {model_id!r} here; the API offers {[m.id for m in models]}.")
    model = matching[0]
    n_layers = model.capabilities.n_layers
    print(f"model: {model.id}, {n_layers} layers, hidden size {model.capabilities.hidden_size}")

    completion = client.completions(model=model.id, prompt=PROMPT, max_tokens=8, temperature=0)
    print(f"completion: {PROMPT!r} → {completion.text!r} ({completion.usage.total_tokens} tokens)")

    layer = n_layers // 2
    capture = client.completions(
        model=model.id, prompt=PROMPT, max_tokens=1, temperature=0, output_residual_stream=[layer]
    )
    residual = capture.residual_stream()  # float32 [layers, tokens, hidden]
    norms = np.linalg.norm(residual[0], axis=-1)
    print(f"capture: layer {layer}, shape {list(residual.shape)}, norms {np.round(norms, 1)}")

    # Steer along the prompt's mean direction at that layer (position 0 left out: its norm is
    # an outlier), scaled to the stream's typical norm there, so the two are equally large.
    rows = residual[0, 1:]
    direction = rows.mean(axis=0) / np.linalg.norm(rows.mean(axis=0))
    scale = float(np.round(np.linalg.norm(rows, axis=-1).mean()))
    body = {"model": model.id, "prompt": STEERED_PROMPT, "max_tokens": 12, "temperature": 0}
    baseline = client.completions(body)
    steered = client.completions(
        body, apply_steering_vectors=[steering_vector(direction, layers=[layer], scale=scale)]
    )
    print(f"baseline: {STEERED_PROMPT!r} → {baseline.text!r}")
    print(f"steered:  {STEERED_PROMPT!r} → {steered.text!r} (layer {layer}, scale {scale})")

    job = client.submit_harvest(model=model.id, prompts=HARVEST_PROMPTS, layers=[layer])
    print(f"harvest: job {job.job_id} {job.status}")
    job = client.wait_for_harvest(job.job_id, progress=progress, timeout=600)
    if job.status != "done":
        raise SystemExit(
            f"harvest ended {job.status}: {job.error.message if job.error else job.message}"
        )
    download = client.download_harvest(job, out)
    print(f"harvest: {len(download.shard_paths)} shard(s) in {download.directory}")
    for captured in download.captures():
        block = captured.layer(layer)  # float32 [tokens, hidden]
        tokens = " ".join(repr(token) for token in captured.token_strings)
        print(f"  prompt {captured.index}: layer {layer} {list(block.shape)}, tokens {tokens}")

    for window in client.usage().windows:
        left = "no limit" if window.limit is None else f"{window.remaining} of {window.limit} left"
        print(f"budget {window.label}: {window.used} used, {left}")


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    client = AcsClient(base_url=args.base_url, api_key=args.api_key)
    out = args.out or tempfile.mkdtemp(prefix="acs-harvest-")
    try:
        tour(client, model_id=args.model, out=out, progress=not args.no_progress)
    except AcsApiError as error:
        print(f"API error {error.status} {error.code}: {error.message}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
