"""The `acs_client` code that runs a steering evaluation again: the same requests (one
sequence each, teacher-forced), the same per-prompt numbers and the same means, intervals,
noise floors and flips, computed with numpy."""

from playground.exports import NOTEBOOK_HEADER

from . import metrics
from .models import SteerAt, SteeringEvaluation

NOTEBOOK = '''from acs_client.codec import decode

MODEL = {model!r}
# The library vector {vector_name!r} (layer {layer}), as the API's tensor codec sends it.
VECTOR = decode({vector_wire!r})
LAYER = {layer}
SCALES = {scales!r}
STEER_LAST_PROMPT_POSITION = {last!r}  # False: every position
REPEATS = {repeats}  # unsteered requests per prompt and completion
RESAMPLES, SEED = {resamples}, {seed}
# Per row: the prompt's, the target's and the foil's token ids.
ROWS = {rows!r}


def score(prompt, completion, scale=None):
    """log p(completion | prompt) in nats (the sum over its tokens, teacher-forced) and the
    top token id after the prompt; steered at `scale` (None: unsteered)."""
    body = {{"model": MODEL, "prompt": prompt + completion, "max_tokens": 1, "temperature": 0,
            "prompt_logprobs": 1}}
    if scale is not None:
        positions = [len(prompt) - 1] if STEER_LAST_PROMPT_POSITION else None
        body["apply_steering_vectors"] = [
            steering_vector(VECTOR, layers=[LAYER], scale=scale, positions=positions)
        ]
    entries = client.completions(body).body["choices"][0]["prompt_logprobs"]
    logprob = sum(entries[len(prompt) + j][str(token)]["logprob"]
                  for j, token in enumerate(completion))
    top = min(entries[len(prompt)].items(), key=lambda item: item[1]["rank"])[0]
    return logprob, int(top)


def interval(values):
    """The bootstrap 95% interval of the mean of `values`."""
    picks = np.random.default_rng(SEED).integers(0, len(values), (RESAMPLES, len(values)))
    return np.percentile(np.asarray(values)[picks].mean(axis=1), [2.5, 97.5])


unsteered, per_prompt = [], []
for prompt, target, foil in ROWS:
    repeats = []
    for _ in range(REPEATS):
        (target_logprob, top), (foil_logprob, _) = score(prompt, target), score(prompt, foil)
        repeats.append((target_logprob - foil_logprob, target_logprob, top))
    unsteered.append(repeats)
    diff, logprob = np.mean([r[0] for r in repeats]), np.mean([r[1] for r in repeats])
    tops = {{r[2] for r in repeats}}
    for scale in SCALES:
        (target_logprob, top), (foil_logprob, _) = (
            score(prompt, target, scale), score(prompt, foil, scale))
        per_prompt.append({{"scale": scale,
                           "delta_logit_diff": target_logprob - foil_logprob - diff,
                           "delta_target_logprob": target_logprob - logprob,
                           "flipped": top not in tops}})
# The largest range over one prompt's identical unsteered requests.
noise_floor = {{
    "logit_diff": max(np.ptp([r[0] for r in repeats]) for repeats in unsteered),
    "target_logprob": max(np.ptp([r[1] for r in repeats]) for repeats in unsteered),
}}
summary = {{}}
for scale in SCALES:
    points = [p for p in per_prompt if p["scale"] == scale]
    summary[scale] = {{"flipped_share": np.mean([p["flipped"] for p in points])}}
    for metric in ("logit_diff", "target_logprob"):
        values = [p["delta_" + metric] for p in points]
        summary[scale][metric] = (np.mean(values), *interval(values))
    print(scale, summary[scale])
print("noise floor", noise_floor)
'''


def evaluation_notebook(evaluation: SteeringEvaluation, vector_wire: dict, *, base_url: str):
    """The code for `evaluation`, whose steered runs sent `vector_wire` (the codec's dict)."""
    return NOTEBOOK_HEADER.format(base_url=base_url) + NOTEBOOK.format(
        model=evaluation.model,
        vector_name=evaluation.vector_name,
        vector_wire=vector_wire,
        layer=evaluation.vector_layer,
        scales=evaluation.scales,
        last=evaluation.steer_at == SteerAt.LAST,
        repeats=evaluation.repeats,
        resamples=metrics.BOOTSTRAP_RESAMPLES,
        seed=metrics.BOOTSTRAP_SEED,
        rows=[[row["prompt_ids"], row["target_ids"], row["foil_ids"]] for row in evaluation.rows],
    )
