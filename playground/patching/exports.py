"""The notebook code that computes a patching grid again with `acs_client`."""

from playground.exports import NOTEBOOK_HEADER

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
        model=grid.clean.body.model,
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
