"""Downloads of the numbers the playground's pages show, and the `acs_client` code that gets
the same numbers in a notebook: a JSON document (the numbers with their definitions, units,
tokens and the runs and request ids they came from) and a CSV of its records, one row each.

The figures drawn with plotly download in the browser from the data the page embeds
(static/js/exports.js); the patching grid and the steering comparison or sweep from here.
"""

import csv
import io
import json

from django.http import HttpResponse


def records_csv(records: list[dict]) -> str:
    """`records` as CSV: a column per key (in the order they first appear), empty where a
    record has none or None; lists and objects as JSON."""
    columns = list(dict.fromkeys(key for record in records for key in record))
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for record in records:
        writer.writerow({key: _csv_value(value) for key, value in record.items()})
    return buffer.getvalue()


def _csv_value(value):
    if value is None:
        return ""
    if isinstance(value, list | dict):
        return json.dumps(value, ensure_ascii=False)
    return value


def download(document: dict, *, records: list[dict], file_format: str, name: str) -> HttpResponse:
    """`document` as a JSON file, or its `records` as a CSV file, named `name`."""
    if file_format == "json":
        body = json.dumps(document, ensure_ascii=False, indent=1)
        content_type = "application/json"
    else:
        body = records_csv(records)
        content_type = "text/csv; charset=utf-8"
    response = HttpResponse(body, content_type=content_type)
    response["Content-Disposition"] = f'attachment; filename="{name}.{file_format}"'
    return response


NOTEBOOK_HEADER = """import os

import numpy as np
from acs_client.client import AcsClient, steering_vector

client = AcsClient(base_url={base_url!r}, api_key=os.environ["ACS_API_KEY"])
"""

PATCHING_NOTEBOOK = '''MODEL = {model!r}
CLEAN = {clean_ids}  # {clean_prompt!r}
CORRUPTED = {corrupted_ids}  # {corrupted_prompt!r}
TARGETS = {targets}  # {target_texts}
LAYERS = {layers}
POSITIONS = {positions}
REPEATS = {repeats}


def capture(prompt):
    """The residual stream [layers, tokens, hidden] of the prompt followed by the target."""
    answer = client.completions(
        model=MODEL, prompt=prompt + TARGETS[0], max_tokens=1, temperature=0,
        prompt_logprobs=0, output_residual_stream=LAYERS,
    )
    return answer.residual_stream()


def scores(prompt, steering=None):
    """log p(target | prompt) of each target in nats: the sum of its tokens' logprobs."""
    body = {{"model": MODEL, "prompt": [prompt + target for target in TARGETS],
            "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0}}
    if steering:
        body["apply_steering_vectors"] = steering
    choices = sorted(client.completions(body).body["choices"], key=lambda c: c["index"])
    return [
        sum(choice["prompt_logprobs"][len(prompt) + j][str(token)]["logprob"]
            for j, token in enumerate(target))
        for choice, target in zip(choices, TARGETS)
    ]


def metric(scores):
    """{metric_label}."""
    return {metric_expression}


clean_rows, corrupted_rows = capture(CLEAN), capture(CORRUPTED)
clean = metric(scores(CLEAN))
repeats = [metric(scores(CORRUPTED)) for _ in range(REPEATS)]
corrupted, noise_floor = np.mean(repeats), max(repeats) - min(repeats)
effect = np.full((len(LAYERS), len(POSITIONS)), np.nan)
for i, layer in enumerate(LAYERS):
    for j, position in enumerate(POSITIONS):
        # Block `layer`'s output at `position` becomes the clean one.
        patch = clean_rows[i, position] - corrupted_rows[i, position]
        steering = [steering_vector(patch[None], layers=[layer], positions=[position])]
        effect[i, j] = (metric(scores(CORRUPTED, steering)) - corrupted) / (clean - corrupted)
print(f"clean {{clean:.3f}}, corrupted {{corrupted:.3f}}, noise floor {{noise_floor:.3f}} nats")
print(effect.round(2))
'''

METRIC_EXPRESSIONS = {"logprob": "scores[0]", "logit_diff": "scores[0] - scores[1]"}


def patching_notebook(grid, *, base_url: str) -> str:
    """The acs_client code that runs `grid` (a `PatchingGrid`) again and computes its
    normalised effects of the metric shown, its baselines and its noise floor."""
    spec = grid.spec
    texts = [spec["target"], spec.get("corrupted_target") or ""][: len(grid.targets)]
    return NOTEBOOK_HEADER.format(base_url=base_url) + PATCHING_NOTEBOOK.format(
        model=grid.clean.request_model,
        clean_ids=spec["clean_ids"],
        clean_prompt=spec.get("clean_prompt", ""),
        corrupted_ids=spec["corrupted_ids"],
        corrupted_prompt=spec.get("corrupted_prompt", ""),
        targets=grid.targets,
        target_texts=", ".join(repr(text) for text in texts),
        layers=spec["layers"],
        positions=spec["positions"],
        repeats=max(len(grid.repeats), 2),
        metric_label=grid.metric_label,
        metric_expression=METRIC_EXPRESSIONS[grid.metric],
    )
