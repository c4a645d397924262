"""Steering evaluations: their cost, creating their runs (once per form submission) and
cancelling them.

An evaluation is one group of runs through the workers, sent with the user's playground key
like every run (so budgets, quotas and admission apply) and dispatched a few at a time
(`services.runs.group_runs_dispatch`). Each run sends one sequence, a dataset prompt followed
by its target or its foil (token ids, teacher-forced, `prompt_logprobs: 1`; see `metrics`):

- per prompt and scale, both completions steered with the library vector at that scale at
  the vector's layer (scale 0 included: an exact no-op, the control);
- per prompt, `REPEATS` times, both completions unsteered, spread among the steered runs so
  that they share their batches: the unsteered value and the noise floor.

One sequence per request on purpose: the gateway sends a steered request of several
sequences upstream one sequence at a time (`api/fanout.py`), an unsteered one whole, so a
request of two sequences would reach the model in another batch shape steered than
unsteered, a difference no repeat would measure.
"""

import datetime as dt
import uuid

from django.db import transaction
from django.utils import timezone

from accounts.models import User
from accounts.services.playground_key import playground_key_get_or_create
from acs_client.client import steering_vector
from acs_client.codec import decode
from acs_client.protocol import XARGS_STEERING
from playground.patching.services import queue_order
from playground.runs.services import group_runs_cancel, group_runs_dispatch, submitted_once
from playground.tokens import with_token_ids

from ..models import Run, RunKind, SteeringVector, sent_scale
from .models import SteerAt, SteeringEvaluation

# Unsteered requests per prompt (each completion): the baseline and its noise floor.
REPEATS = 3
COMPLETIONS = ("target", "foil")


def evaluation_cost(*, rows: list[dict], scales: list[float], repeats: int = REPEATS) -> dict:
    """What an evaluation of `rows` (each with `prompt_ids`, `target_ids` and `foil_ids`) at
    `scales` sends: its requests, their prompt tokens, the generated tokens (one per
    request: the API generates at least one), their sum, and the activation requests (the
    steered ones, scale 0 included)."""
    conditions = len(scales) + repeats
    sequences = sum(
        2 * len(row["prompt_ids"]) + len(row["target_ids"]) + len(row["foil_ids"]) for row in rows
    )
    requests = len(COMPLETIONS) * len(rows) * conditions
    prompt_tokens = conditions * sequences
    return {
        "requests": requests,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": requests,
        "total_tokens": prompt_tokens + requests,
        "activation_requests": len(COMPLETIONS) * len(rows) * len(scales),
    }


def scoring_request(*, model: str, prompt_ids: list[int], completion_ids: list[int]) -> dict:
    """The prompt followed by one completion, scored teacher-forced (see `metrics`)."""
    return {
        "model": model,
        "prompt": [*prompt_ids, *completion_ids],
        "max_tokens": 1,
        "temperature": 0,
        "prompt_logprobs": 1,
    }


def steering_entry(*, vector_values, layer: int, scale: float, prompt_length: int, steer_at):
    """The `apply_steering_vectors` entry of a steered request: the vector at its layer, at
    every position or at the prompt's last one."""
    positions = [prompt_length - 1] if steer_at == SteerAt.LAST else None
    return steering_vector(vector_values, layers=[layer], scale=scale, positions=positions)


def steering_evaluation_create(
    *,
    user: User,
    model: str,
    vector: SteeringVector,
    scales: list[float],
    steer_at: str,
    rows: list[dict],
    cost: dict,
    submit_token: uuid.UUID | None = None,
) -> uuid.UUID:
    """Store the evaluation and queue its runs (see the module's docstring), dispatched a
    few at a time once the transaction commits. `rows`: per dataset row its `prompt`,
    `target` and `foil` texts and each one's `*_ids` and `*_strings`. Returns the
    evaluation's id (that of the first, when `submit_token` was submitted before)."""

    def create() -> uuid.UUID:
        with transaction.atomic():
            playground_key_get_or_create(user=user)
            evaluation = SteeringEvaluation.objects.create(
                user=user, model=model, vector=vector, vector_name=vector.name,
                vector_layer=vector.layer, scales=scales, steer_at=steer_at, repeats=REPEATS,
                rows=rows, cost=cost,
            )  # fmt: skip
            runs = _runs(evaluation, vector, submit_token)
            Run.objects.bulk_create(runs)
            transaction.on_commit(lambda: group_runs_dispatch(group=evaluation.id))
        return evaluation.id

    return submitted_once(
        user=user, submit_token=submit_token, create=create, existing=lambda run: run.group
    )


def _runs(evaluation: SteeringEvaluation, vector: SteeringVector, submit_token) -> list[Run]:
    """The evaluation's runs in the order they are sent: prompt by prompt, each prompt's
    repeats spread among its scales (`patching.queue_order`), target then foil."""
    values = decode(vector.data)
    start = timezone.now()
    runs = []
    for index, row in enumerate(evaluation.rows):
        prompt_length = len(row["prompt_ids"])
        for what, item in queue_order(evaluation.scales, evaluation.repeats):
            for completion in COMPLETIONS:
                request = scoring_request(
                    model=evaluation.model,
                    prompt_ids=row["prompt_ids"],
                    completion_ids=row[f"{completion}_ids"],
                )
                meta = {
                    "row": index,
                    "completion": completion,
                    "prompt_text": row["prompt"] + row[completion],
                }
                if what == "repeat":
                    meta.update(role="repeat", repeat=item)
                else:
                    meta["role"] = "steered"
                    request[XARGS_STEERING] = [
                        steering_entry(
                            vector_values=values, layer=vector.layer, scale=item,
                            prompt_length=prompt_length, steer_at=evaluation.steer_at,
                        )
                    ]  # fmt: skip
                runs.append(
                    Run(
                        user=evaluation.user,
                        kind=RunKind.STEERING_EVAL,
                        group=evaluation.id,
                        scale=sent_scale(request),
                        vector=vector if what == "cell" else None,
                        request=with_token_ids(request),
                        meta=meta,
                        # Sent in this order (`group_runs_dispatch` orders by created_at).
                        created_at=start + dt.timedelta(microseconds=len(runs)),
                        submit_token=None if runs else submit_token,
                    )
                )
    return runs


def steering_evaluation_cancel(*, user: User, evaluation_id) -> int:
    """Cancel an evaluation: its runs not yet taken by a worker fail as cancelled (never
    sent, so never billed); runs already being sent finish. Returns how many were
    cancelled (0 for another user's evaluation)."""
    now = timezone.now()
    with transaction.atomic():
        evaluation = (
            SteeringEvaluation.objects.select_for_update()
            .filter(pk=evaluation_id, user=user)
            .first()
        )
        if evaluation is None:
            return 0
        if evaluation.cancelled_at is None:
            evaluation.cancelled_at = now
            evaluation.save(update_fields=["cancelled_at"])
        return group_runs_cancel(group=evaluation.id, now=now)
