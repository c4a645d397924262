"""A steering comparison's or sweep's numbers as a document (JSON, or CSV of its arms), and
the notebook code that sends its requests again."""

from infra.lifecycle import WorkStatus
from playground import scoring
from playground.exports import NOTEBOOK_HEADER
from playground.runs.downloads import vector_provenance
from playground.steering import figures as steering_figures
from playground.steering import selectors as steering_selectors


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
                "layers": run.body.steering.layer_indices if run.body.steering else None,
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
        "model": runs[0].body.model,
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
    request = first.body
    vector = first.vector
    unit = " in × the layer's typical norm" if first.meta.get("scale_unit") == "typical" else ""
    return NOTEBOOK_HEADER.format(base_url=base_url) + STEERING_NOTEBOOK.format(
        model=request.model,
        prompt=steering_selectors.steering_arm(first)["prompt"],
        sampling=request.model_dump(
            include={"max_tokens", "temperature", "seed", "logprobs"}, exclude_unset=True
        ),
        layers=request.steering.layer_indices if request.steering else None,
        positions=request.steering.position_indices if request.steering else None,
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
