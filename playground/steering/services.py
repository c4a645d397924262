"""Writes of steering comparisons and sweeps: their runs queued (a baseline and one steered
run per scale), and the comparison on the same tokens (teacher-forced requests; see
`scoring`) queued when their runs have finished, executed by a Celery worker."""

import datetime as dt
import logging
import uuid

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from accounts.models import User
from accounts.services.playground_key import worker_secret
from acs_client.client import AcsApiError, AcsClient
from acs_client.protocol import XARGS_STEERING
from infra.lifecycle import WorkStatus, work_claim, work_error, work_sweep
from infra.tasks import TaskQueueUnreachable, task_send_on_commit
from playground import scoring
from playground.models import Run, RunKind, SteeringScore, SteeringVector
from playground.runs.services import run_enqueue, submitted_once
from playground.vectors.services import steering_entry

logger = logging.getLogger(__name__)

# The task that executes a score (`tasks.py`), enqueued by name.
STEERING_SCORE_TASK = "playground.tasks.steering_score_execute_task"

STEERING_KINDS = (RunKind.STEERING_BASELINE, RunKind.STEERING_STEERED, RunKind.SWEEP)
# The full next-token distribution (for the KL divergence) is asked for only while prompt +
# completion is at most this many tokens: every position is a vocabulary-sized JSON object
# (about 4 MB for SmolLM2's 49,152 tokens), which the worker parses whole. The API allows 256.
KL_MAX_TOKENS = 64


class ScoreUnavailable(Exception):
    """The runs cannot be compared on the same tokens; the message says why."""


def scoring_outcome(compute, *, what: str) -> dict:
    """The fields that record a teacher-forced scoring once `compute()` (which sends its
    requests and returns the results) has run: the results and SUCCEEDED, or FAILED with the
    API's error, `not_comparable`, or `playground_error` (logged as `what`)."""
    fields = {"status": WorkStatus.FAILED, "finished_at": timezone.now()}
    try:
        fields.update(results=compute())
        fields["status"] = WorkStatus.SUCCEEDED
    except AcsApiError as error:
        fields.update(error_code=error.code, error_message=error.message)
    except ScoreUnavailable as reason:
        fields.update(work_error("not_comparable", str(reason)))
    except Exception:
        logger.exception("%s failed", what)
        fields.update(
            work_error(
                "playground_error", "The playground worker could not compare the runs; see its log."
            )
        )
    return fields


def steering_score_queue(*, group) -> SteeringScore | None:
    """Queue the same-token comparison of a steering comparison or sweep once all its runs
    have finished, if the baseline and at least one steered run succeeded. Idempotent: the
    group's score is unique, so the last two runs finishing at once queue it once."""
    runs = list(Run.objects.filter(group=group).only("status", "scale", "user_id"))
    if not runs or not all(run.is_finished for run in runs):
        return None
    succeeded = [run for run in runs if run.status == WorkStatus.SUCCEEDED]
    if not any(run.scale == 0 for run in succeeded) or all(run.scale == 0 for run in succeeded):
        return None
    try:
        with transaction.atomic():
            score = SteeringScore.objects.create(group=group, user_id=runs[0].user_id)
            task_send_on_commit(
                STEERING_SCORE_TASK,
                str(score.pk),
                unsent=lambda error: scoring_fail_unsent(scoring=score, error=error),
            )
    except IntegrityError:
        return SteeringScore.objects.get(group=group)
    return score


def steering_score_execute(*, score_id) -> SteeringScore | None:
    """Claim a queued score, send its teacher-forced requests to /v1 with the user's
    playground key and store the per-token logprobs and KL divergences (see
    `_steering_compare`); an error fails it with a message a person can read. Returns None
    if it could not be claimed."""
    attempt = work_claim(SteeringScore, pk=score_id, now=timezone.now())
    if attempt is None:
        return None
    score = SteeringScore.objects.select_related("user").get(pk=score_id)
    runs = Run.objects.filter(group=score.group, status=WorkStatus.SUCCEEDED).order_by("scale")
    baseline = next(run for run in runs if run.scale == 0)
    steered = [run for run in runs if run.scale != 0]
    client = AcsClient(base_url=settings.GATEWAY_URL, api_key=worker_secret(score.user))
    fields = scoring_outcome(
        lambda: _steering_compare(client, baseline, steered), what=f"steering score {score.pk}"
    )
    attempt.write(**fields)  # nothing once the sweep failed it
    score.refresh_from_db()
    return score


# Alternatives asked for when finding which of several same-looking tokens a run sampled.
RESOLVE_TOP_K = 20


def run_token_ids(run: Run, send) -> tuple[list[int], list[int], list[str]]:
    """The prompt's token ids, and the completion's ids and strings, of a run's first choice.

    A completion token whose string names no single token (a piece of a character, named ""
    or by the character it completes) has no id in `run.tokens`: it is found by one
    teacher-forced request under the run's own model, on the prompt and the tokens before it
    plus a placeholder, whose last prompt_logprobs entry lists the likeliest tokens there:
    the one sampled has that string and, of those, the logprob closest to the one the run
    reported (`send(purpose, body)` sends a request)."""
    tokens = run.tokens or {}
    prompt = (tokens.get("prompts") or [None])[0]
    completion = (tokens.get("completions") or [None])[0]
    if not prompt or not completion:
        raise ScoreUnavailable(
            f"The tokens of the run at scale {run.scale_label or 0} are unknown, so they "
            "cannot be scored under the other model."
        )
    ids, strings = list(completion["ids"]), completion["strings"]
    for index, token_id in enumerate(ids):
        if token_id is not None:
            continue
        # Only a run with logprobs has ids unknown (its tokens come from them, see run_tokens).
        reported = run.response["choices"][0]["logprobs"]["token_logprobs"]
        body = scoring.teacher_forced_request(
            run.body, prompt["ids"] + ids[:index] + [0], full_vocabulary=False,
            steered=run.scale != 0,
        )  # fmt: skip
        body["prompt_logprobs"] = RESOLVE_TOP_K
        answer = send(f"which token the run at scale {run.scale_label} sampled at {index}", body)
        entry = answer["choices"][0]["prompt_logprobs"][-1]
        candidates = [
            (abs(item["logprob"] - reported[index]), int(candidate))
            for candidate, item in entry.items()
            if item["decoded_token"] == strings[index]
        ]
        if not candidates:
            raise ScoreUnavailable(
                f"Which token the run at scale {run.scale_label or 0} sampled at generated "
                f"position {index} ({strings[index]!r}) could not be told apart from others "
                "that look the same."
            )
        ids[index] = min(candidates)[1]
    return prompt["ids"], ids, strings


def _steering_compare(client: AcsClient, baseline: Run, steered: list[Run]) -> dict:
    """Score the baseline's tokens under every steered model and each steered run's tokens
    under the baseline (and under its own model, so both sides of each Δ come from the same
    teacher-forced computation), with full distributions for the KL divergence on the
    baseline's tokens where prompt + completion is at most KL_MAX_TOKENS."""
    sent = []

    def send(purpose: str, body: dict) -> dict:
        completion = client.completions(body)
        sent.append({"purpose": purpose, "request_id": completion.request_id})
        return completion.body

    prompt_ids, base_ids, base_strings = run_token_ids(baseline, send)
    first = len(prompt_ids)
    full = first + len(base_ids) <= KL_MAX_TOKENS
    answer = send(
        "baseline model, baseline's tokens",
        scoring.teacher_forced_request(
            baseline.body, prompt_ids + base_ids, full_vocabulary=full, steered=False
        ),
    )
    logprobs = answer["choices"][0]["prompt_logprobs"]
    base_under_base = scoring.scored_logprobs(logprobs, base_ids, first)
    base_distributions = (
        scoring.full_distributions(logprobs, first, len(base_ids)) if full else None
    )
    del answer, logprobs
    own = {run.pk: run_token_ids(run, send) for run in steered}
    body = scoring.teacher_forced_request(
        baseline.body, prompt_ids, full_vocabulary=False, steered=False
    )
    body["prompt"] = [own[run.pk][0] + own[run.pk][1] for run in steered]
    under_baseline = send("baseline model, each steered run's tokens", body)["choices"]
    results = []
    for index, run in enumerate(steered):
        run_prompt, ids, strings = own[run.pk]
        answer = send(
            f"steered model (scale {run.scale_label}), baseline's tokens",
            scoring.teacher_forced_request(
                run.body, prompt_ids + base_ids, full_vocabulary=full, steered=True
            ),
        )
        logprobs = answer["choices"][0]["prompt_logprobs"]
        kl = None
        if full:
            steered_distributions = scoring.full_distributions(logprobs, first, len(base_ids))
            kl = scoring.kl_divergence(base_distributions, steered_distributions).tolist()
        base_under_steered = scoring.scored_logprobs(logprobs, base_ids, first)
        del answer, logprobs
        own_answer = send(
            f"steered model (scale {run.scale_label}), its own tokens",
            scoring.teacher_forced_request(
                run.body, run_prompt + ids, full_vocabulary=False, steered=True
            ),
        )
        own_first = len(run_prompt)
        results.append(
            {
                "run": str(run.pk),
                "scale": run.scale,
                "scale_entered": run.scale_entered,
                "label": run.scale_label,
                "baseline_tokens": {
                    "under_baseline": base_under_base.tolist(),
                    "under_steered": base_under_steered.tolist(),
                    "kl": kl,
                },
                "steered_tokens": {
                    "strings": strings,
                    "ids": ids,
                    "under_baseline": scoring.scored_logprobs(
                        under_baseline[index]["prompt_logprobs"], ids, own_first
                    ).tolist(),
                    "under_steered": scoring.scored_logprobs(
                        own_answer["choices"][0]["prompt_logprobs"], ids, own_first
                    ).tolist(),
                },
            }
        )
    return {
        "baseline": {"run": str(baseline.pk), "strings": base_strings, "ids": base_ids},
        "prompt_tokens": first,
        "full_vocabulary": full,
        "kl_max_tokens": KL_MAX_TOKENS,
        "runs": results,
        "requests": sent,
    }


def scorings_fail_stuck(model, *, message: str, now=None) -> int:
    """Fail the scorings of `model` (SteeringScore, RunComparison) still queued or running
    after `PLAYGROUND_RUN_STUCK_SECONDS` (their worker died, or none took them) with
    worker_lost and `message`, so their pages stop waiting. Returns how many; see
    `work_sweep`."""
    now = now or timezone.now()
    too_old = Q(created_at__lt=now - dt.timedelta(seconds=settings.PLAYGROUND_RUN_STUCK_SECONDS))
    return work_sweep(
        model,
        running_lost=too_old,
        queued_lost=too_old,
        # Queued ones too: their pages say the scoring did not finish.
        failed_as="worker_lost",
        message=lambda _scoring, _code: message,
        now=now,
    )


def scoring_fail_unsent(*, scoring, error: TaskQueueUnreachable) -> None:
    """Fail a queued scoring (SteeringScore, RunComparison) whose task the queue could not
    take (see `task_send_on_commit`), so that its page stops waiting for it."""
    type(scoring).objects.filter(pk=scoring.pk, status=WorkStatus.QUEUED).update(
        status=WorkStatus.FAILED,
        error_code=error.code,
        error_message=str(error),
        finished_at=timezone.now(),
    )


def steering_scores_fail_stuck(*, now=None) -> int:
    """Fail same-token scores whose worker died (see `scorings_fail_stuck`)."""
    return scorings_fail_stuck(
        SteeringScore,
        message="The comparison on the same tokens did not finish; re-run the comparison.",
        now=now,
    )


def steering_runs_create(
    *,
    user: User,
    base_request: dict,
    vector: SteeringVector,
    layers: list[int],
    scales: list[float],
    kind: str,
    target_token: str = "",
    submit_token: uuid.UUID | None = None,
    entered_scales: list[float] | None = None,
    scale_unit: str = "absolute",
    positions: list[int] | None = None,
) -> uuid.UUID:
    """Queue a baseline (scale 0) and one steered run per scale, all with the same request
    and seed, adding `vector` at `layers` and at the prompt's `positions` (None: at every
    position). Returns the group id of the comparison (that of
    the first comparison, when `submit_token` was submitted before).

    `entered_scales` are the scales as the user gave them in `scale_unit` ("absolute" or
    "typical": multiples of the layer's typical norm), kept to show them as entered. A sweep
    with a `target_token` also scores prompt + target (see `with_target_scored`)."""
    entered = entered_scales if entered_scales is not None else scales

    def create() -> uuid.UUID:
        group = uuid.uuid4()
        with transaction.atomic():
            for scale, scale_entered in [(0.0, 0.0), *zip(scales, entered, strict=True)]:
                request = dict(base_request)
                if kind == RunKind.SWEEP and target_token:
                    request = with_target_scored(request, target_token)
                request[XARGS_STEERING] = [
                    steering_entry(vector, layers=layers, scale=scale, positions=positions)
                ]
                run_kind = kind
                if kind == RunKind.STEERING_STEERED and scale == 0.0:
                    run_kind = RunKind.STEERING_BASELINE
                run_enqueue(
                    user=user,
                    kind=run_kind,
                    group=group,
                    vector=vector,
                    request=request,
                    meta={
                        "target_token": target_token,
                        "scale_unit": scale_unit,
                        "scale_entered": scale_entered,
                    },
                    submit_token=submit_token if scale == 0.0 else None,
                )
        return group

    return submitted_once(
        user=user, submit_token=submit_token, create=create, existing=lambda run: run.group
    )


def with_target_scored(request: dict, target: str) -> dict:
    """The request with a second prompt, prompt + `target`, and `prompt_logprobs: 0`: the
    second choice's last prompt logprobs are the target's own, from the full distribution,
    however unlikely the target is (a top-k list would often leave it out)."""
    prompt = request["prompt"]
    return {**request, "prompt": [prompt, prompt + target], "prompt_logprobs": 0}
