"""What a comparison sends to /v1: teacher-forced requests that score each run's tokens under
both runs' settings (see `differences` for what the answers mean)."""

from acs_client.client import AcsClient
from playground import scoring
from playground.compare.selectors import scoring_unavailable_reason
from playground.models import Run
from playground.steering.services import (
    ScoreUnavailable,
    run_token_ids,
)


def scored_on_each_others_tokens(client: AcsClient, run_a: Run, run_b: Run) -> dict:
    """Both runs' token sequences (their ids asked of /v1 where the run did not keep them),
    then two teacher-forced requests scoring both sequences, under A's settings and under
    B's. Returns the sequences, the raw answers and the requests sent (their ids), as a
    comparison stores them in `results`; raises `ScoreUnavailable` when the runs cannot be
    compared."""
    reason = scoring_unavailable_reason(run_a, run_b)
    if reason:
        raise ScoreUnavailable(reason)
    requests = []

    def send(purpose: str, body: dict) -> dict:
        completion = client.completions(body)
        requests.append({"purpose": purpose, "request_id": completion.request_id})
        return completion.body

    sequences = {}
    for side, run in (("a", run_a), ("b", run_b)):
        prompt_ids, completion_ids, _ = run_token_ids(run, send)
        sequences[side] = {"ids": prompt_ids + completion_ids, "prompt_length": len(prompt_ids)}
    answers = {}
    for side, run in (("a", run_a), ("b", run_b)):
        body = scoring.teacher_forced_request(
            run.body, sequences["a"]["ids"], full_vocabulary=False, steered=True
        )
        body["prompt"] = [sequences["a"]["ids"], sequences["b"]["ids"]]
        answers[side] = send(f"both runs' tokens under run {side.upper()}'s settings", body)
    return {**sequences, "answers": answers, "requests": requests}
