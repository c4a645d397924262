"""The notebook code that scores two runs on each other's tokens again."""

from playground.exports import NOTEBOOK_HEADER

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
        model=run_a.body.model,
        sequences={side.upper(): results[side]["ids"] for side in ("a", "b")},
        prompt_lengths={side.upper(): results[side]["prompt_length"] for side in ("a", "b")},
        steering={label: run.body.steering_body() for label, run in (("A", run_a), ("B", run_b))},
    )
