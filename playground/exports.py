"""Downloads of the numbers the playground's pages show, and the `acs_client` code that gets
the same numbers in a notebook: a JSON document (the numbers with their definitions, units,
tokens and the runs and request ids they came from) and a CSV of its records, one row each.

The figures drawn with plotly download in the browser from the data the page embeds
(static/js/exports.js); the patching grid and the steering comparison or sweep from here,
each with the notebook code that sends its requests again.
"""

import io
import json

from django.http import HttpResponse

from infra.lifecycle import WorkStatus
from infra.spreadsheet import SafeWriter
from playground import scoring
from playground.runs.downloads import vector_provenance
from playground.steering import figures as steering_figures
from playground.steering import selectors as steering_selectors


def records_csv(records: list[dict]) -> str:
    """`records` as CSV: a column per key (in the order they first appear), empty where a
    record has none or None; lists and objects as JSON; text cells a spreadsheet would read
    as a formula with a leading `'` (`infra.spreadsheet`)."""
    columns = list(dict.fromkeys(key for record in records for key in record))
    buffer = io.StringIO()
    writer = SafeWriter(buffer)
    writer.writerow(columns)
    for record in records:
        writer.writerow([_csv_value(record.get(column)) for column in columns])
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


def steering_export(runs, score) -> dict:
    """The numbers of a steering comparison or sweep (`runs`, its same-token `score` or
    None): per arm, by scale, the scale as entered (and its unit) and as sent, its layers,
    run, request id and text, the target's logprob (a sweep with a target) and the
    same-token means, with their definitions: the JSON download, whose `arms` the CSV
    holds."""
    compared = {}
    if score is not None and score.status == WorkStatus.SUCCEEDED:
        compared = {entry["run"]: entry for entry in score.results["runs"]}
    target = runs[0].meta.get("target_token", "")
    arms = []
    for run in sorted(runs, key=lambda run: run.scale_entered or 0.0):
        succeeded = run.status == WorkStatus.SUCCEEDED
        logprob, missing = (None, "")
        if succeeded and target:
            logprob, missing = steering_figures.target_logprob(run.response, target)
        entry = compared.get(str(run.pk))
        summary = steering_figures.same_token_summary(entry) if entry else {}
        arms.append(
            {
                "role": "baseline" if run.scale == 0 else "steered",
                "scale_entered": run.scale_entered or 0.0,
                "scale_unit": run.meta.get("scale_unit", "absolute"),
                "scale_sent": run.scale,
                "layers": run.meta.get("layers"),
                "run": str(run.pk),
                "request_id": run.request_id,
                "status": run.status,
                "text": run.response["choices"][0]["text"] if succeeded else None,
                "target_logprob": logprob,
                "target_missing": missing or None,
                "mean_delta_baseline_tokens": summary.get("delta_baseline_tokens"),
                "mean_delta_own_tokens": summary.get("delta_steered_tokens"),
                "mean_kl": summary.get("kl"),
            }
        )
    vector = runs[0].vector
    return {
        "group": str(runs[0].group),
        "model": runs[0].request_model,
        "prompt": steering_selectors.steering_arm(runs[0])["prompt"],
        "target": target,
        "vector": vector_provenance(vector) if vector else None,
        "definitions": {
            "target_logprob": "log p(target | prompt) in nats, teacher-forced after the "
            "prompt (the sum of the target's token logprobs)",
            "mean_delta": scoring.MEAN_DELTA_DEFINITION
            + "; Δ logprob = log p steered − log p baseline on the same tokens",
            "mean_kl": "the mean over the baseline's generated tokens of KL(baseline ‖ "
            "steered) over the whole vocabulary, in nats per token",
        },
        "scoring_requests": (score.results or {}).get("requests") if score else None,
        "arms": arms,
    }


STEERING_NOTEBOOK = '''MODEL = {model!r}
PROMPT = {prompt!r}
SAMPLING = {sampling!r}
LAYERS = {layers!r}
POSITIONS = {positions!r}  # the prompt's positions steered (None: every position)
TARGET = {target!r}  # its logprob after the prompt is scored at each scale ("": none)
# (scale as entered{unit}, scale sent)
SCALES = {scales!r}
# The library vector {vector_name!r}: download it from the playground's vector library.
vector = np.load({vector_file!r})


def steering(scale):
    return [steering_vector(vector, layers=LAYERS, scale=scale, positions=POSITIONS)]


def generate(scale):
    """The choices of PROMPT steered at `scale` (scale 0: an exact no-op), with PROMPT +
    TARGET scored as a second prompt."""
    body = {{"model": MODEL, "prompt": PROMPT, **SAMPLING, "return_token_ids": True,
            "apply_steering_vectors": steering(scale)}}
    if TARGET:
        body.update(prompt=[PROMPT, PROMPT + TARGET], prompt_logprobs=0)
    return client.completions(body).body["choices"]


def scored(ids, first, scale):
    """log p of ids[first:], each after the ones before it (teacher-forced), in nats, under
    the model steered at `scale` (unsteered at 0)."""
    body = {{"model": MODEL, "prompt": ids, "max_tokens": 1, "temperature": 0,
            "prompt_logprobs": 0}}
    if scale:
        body["apply_steering_vectors"] = steering(scale)
    entries = client.completions(body).body["choices"][0]["prompt_logprobs"]
    return np.array([entries[p][str(ids[p])]["logprob"] for p in range(first, len(ids))])


baseline = generate(0.0)[0]
first = len(baseline["prompt_token_ids"])
baseline_ids = baseline["prompt_token_ids"] + baseline["token_ids"]
under_baseline = scored(baseline_ids, first, 0.0)
results = {{}}
for entered, sent in SCALES:
    choices = generate(sent)
    target = None
    if TARGET:
        both = choices[1]
        target = sum(both["prompt_logprobs"][p][str(token)]["logprob"]
                     for p, token in enumerate(both["prompt_token_ids"]) if p >= first)
    # Mean Δ logprob on the baseline's generated tokens, steered − baseline, nats per token.
    delta = (scored(baseline_ids, first, sent) - under_baseline).mean() if sent else 0.0
    results[entered] = {{"text": choices[0]["text"], "target_logprob": target,
                        "mean_delta_baseline_tokens": delta}}
    print(entered, results[entered])
'''


def steering_notebook(runs, *, base_url: str) -> str:
    """The acs_client code that sends a steering comparison's or sweep's runs again and
    computes, per scale, the text, the target's logprob and the mean Δ logprob on the
    baseline's tokens (`steering_export`'s numbers but the KL divergence)."""
    first = runs[0]
    request = first.request
    vector = first.vector
    unit = " in × the layer's typical norm" if first.meta.get("scale_unit") == "typical" else ""
    return NOTEBOOK_HEADER.format(base_url=base_url) + STEERING_NOTEBOOK.format(
        model=request["model"],
        prompt=steering_selectors.steering_arm(first)["prompt"],
        sampling={
            key: request[key]
            for key in ("max_tokens", "temperature", "seed", "logprobs")
            if key in request
        },
        layers=first.meta.get("layers"),
        positions=(request.get("apply_steering_vectors") or [{}])[0].get("position_indices"),
        target=first.meta.get("target_token", ""),
        unit=unit,
        scales=[
            (run.scale_entered or 0.0, run.scale)
            for run in sorted(runs, key=lambda run: run.scale_entered or 0.0)
            if run.scale
        ],
        vector_name=vector.name if vector else "(deleted)",
        vector_file=f"vector-{vector.pk}.npy" if vector else "vector.npy",
    )


COMPARE_NOTEBOOK = '''MODEL = {model!r}
# Each run's first prompt then its first choice, as token ids, and its prompt's length.
SEQUENCES = {sequences!r}
PROMPT_LENGTHS = {prompt_lengths!r}
# Each run's steering (its request's apply_steering_vectors), None where it had none.
STEERING = {steering!r}


def logprobs(settings):
    """Each sequence's token logprobs (positions 1 on, nats) under run `settings`'s model
    and steering, teacher-forced: both sequences in one request."""
    body = {{"model": MODEL, "prompt": list(SEQUENCES.values()), "max_tokens": 1,
            "temperature": 0, "prompt_logprobs": 0}}
    if STEERING[settings]:
        body["apply_steering_vectors"] = STEERING[settings]
    choices = sorted(client.completions(body).body["choices"], key=lambda c: c["index"])
    return {{
        side: np.array([choice["prompt_logprobs"][p][str(token)]["logprob"]
                        for p, token in enumerate(ids) if p])
        for choice, (side, ids) in zip(choices, SEQUENCES.items())
    }}


under_a, under_b = logprobs("A"), logprobs("B")
# Δ logprob = under B's settings − under A's, at positions 1 on; its mean over the generated
# tokens only.
delta = {{side: under_b[side] - under_a[side] for side in SEQUENCES}}
mean_delta = {{side: delta[side][PROMPT_LENGTHS[side] - 1 :].mean() for side in SEQUENCES}}
print(mean_delta)
'''


def compare_notebook(run_a, run_b, results: dict, *, base_url: str) -> str:
    """The acs_client code that sends a two-run comparison's teacher-forced requests again
    (`results`: the comparison's, with each side's token ids) and computes its Δ logprobs."""
    return NOTEBOOK_HEADER.format(base_url=base_url) + COMPARE_NOTEBOOK.format(
        model=run_a.request_model,
        sequences={side.upper(): results[side]["ids"] for side in ("a", "b")},
        prompt_lengths={side.upper(): results[side]["prompt_length"] for side in ("a", "b")},
        steering={
            label: run.request.get("apply_steering_vectors")
            for label, run in (("A", run_a), ("B", run_b))
        },
    )
