"""Writes of the playground: the managed playground key, runs and their execution, and the
steering-vector library.

A run is executed by a Celery worker (`tasks.run_execute_task`) that calls /v1 through
`acs_client` with the user's playground key, exactly as an outside client would.
"""

import datetime as dt
import logging
import time
import uuid

import numpy as np
from cryptography.fernet import Fernet
from django.conf import settings
from django.db import DataError, IntegrityError, connection, transaction
from django.db.models import F, Q
from django.utils import timezone

from accounts.models import ApiKey, User
from accounts.services.keys import api_key_create
from acs_client.client import AcsApiError, AcsClient
from acs_client.codec import decode, encode_vector
from acs_portal.celery import task_send
from api.errors import result_unstorable

from . import figures, scoring, streams
from .models import (
    JobKind,
    JobSubmission,
    JobSubmissionStatus,
    Run,
    RunKind,
    RunStatus,
    SteeringScore,
    SteeringVector,
    VectorMethod,
)
from .run_tokens import run_tokens

logger = logging.getLogger(__name__)

# The tasks that execute a run and send a job submission (`tasks.py`), enqueued by name.
RUN_EXECUTE_TASK = "playground.tasks.run_execute_task"
JOB_SUBMISSION_SEND_TASK = "playground.tasks.job_submission_send_task"
STEERING_SCORE_TASK = "playground.tasks.steering_score_execute_task"

PLAYGROUND_KEY_NAME = "Playground"


# ---------------------------------------------------------------------------------------
# The managed playground key


def _fernet() -> Fernet:
    return Fernet(settings.PLAYGROUND_KEY_ENCRYPTION_KEY.encode())


def playground_key_secret(key: ApiKey) -> str:
    """Decrypt a playground key's stored secret."""
    return _fernet().decrypt(key.encrypted_secret.encode()).decode()


def playground_key_get_or_create(*, user: User) -> tuple[ApiKey, str]:
    """The user's playground key and its secret, creating the key on first use.

    The secret is stored encrypted (Fernet, `PLAYGROUND_KEY_ENCRYPTION_KEY`); it is decrypted
    here, so call this only where the secret is needed (the worker) or to create the key.
    """
    with transaction.atomic():
        # Lock the user row so two first runs at once create one key, not two.
        User.objects.select_for_update().filter(pk=user.pk).first()
        key = ApiKey.objects.filter(user=user, is_playground=True).first()
        if key is not None:
            return key, playground_key_secret(key)
        key, secret = api_key_create(
            user=user, name=PLAYGROUND_KEY_NAME, acting_user=user, is_playground=True
        )
        # api_key_create makes the secret, so it can only be encrypted afterwards; same
        # transaction, so no reader ever sees the key without it.
        key.encrypted_secret = _fernet().encrypt(secret.encode()).decode()
        key.save(update_fields=["encrypted_secret"])
        return key, secret


# ---------------------------------------------------------------------------------------
# Runs


def run_create(
    *,
    user: User,
    request: dict,
    kind: str = RunKind.COMPLETION,
    group: uuid.UUID | None = None,
    scale: float | None = None,
    vector: SteeringVector | None = None,
    meta: dict | None = None,
    submit_token: uuid.UUID | None = None,
) -> Run:
    """Store a queued run and enqueue its execution once the transaction commits.

    With a `submit_token` (of the form that asked for it), a second call with the same
    token returns the run the first one created (see `submitted_once`)."""
    return submitted_once(
        user=user,
        submit_token=submit_token,
        create=lambda: _run_create(
            user=user,
            request=request,
            kind=kind,
            group=group,
            scale=scale,
            vector=vector,
            meta=meta,
            submit_token=submit_token,
        ),
        existing=lambda run: run,
    )


def _run_create(*, user, request, kind, group, scale, vector, meta, submit_token) -> Run:
    with transaction.atomic():
        playground_key_get_or_create(user=user)
        run = Run.objects.create(
            user=user,
            kind=kind,
            group=group,
            scale=scale,
            vector=vector,
            request=request,
            meta=meta or {},
            submit_token=submit_token,
        )
        transaction.on_commit(lambda: task_send(RUN_EXECUTE_TASK, str(run.id)))
    return run


def submitted_once(*, user: User, submit_token: uuid.UUID | None, create, existing):
    """`create()`, unless the form submission `submit_token` already created its runs: then
    `existing(first run of that submission)`. `create` stores the token on the first run it
    creates, in its own transaction; the unique (user, submit_token) constraint makes a
    concurrent duplicate fail there and roll back whole, so one submission creates once."""

    def previous() -> Run | None:
        if submit_token is None:
            return None
        return Run.objects.filter(user=user, submit_token=submit_token).first()

    if (run := previous()) is not None:
        return existing(run)
    try:
        return create()
    except IntegrityError:
        if (run := previous()) is None:
            raise
        return existing(run)


def run_claim(*, run_id) -> Run | None:
    """Move a queued run to running and return it; None if another worker has it or it has
    finished. The conditional update makes the claim atomic across workers."""
    with transaction.atomic():
        if connection.vendor == "postgresql":
            # The claim is on the path to the first token; a claim lost in a crash only
            # leaves the run queued again, so it need not wait for the WAL flush.
            with connection.cursor() as cursor:
                cursor.execute("SET LOCAL synchronous_commit TO OFF")
        claimed = Run.objects.filter(pk=run_id, status=RunStatus.QUEUED).update(
            status=RunStatus.RUNNING, started_at=timezone.now(), attempts=F("attempts") + 1
        )
    if not claimed:
        return None
    return Run.objects.select_related("user").get(pk=run_id)


class RunRetry(Exception):
    """A transient failure before any output: the run is queued again for a retry."""

    def __init__(self, countdown: float):
        super().__init__(f"retry in {countdown}s")
        self.countdown = countdown


def run_execute(*, run_id, final_attempt: bool) -> Run | None:
    """Claim the run, send its request, publish its output and store the result.

    Raises `RunRetry` for a transient error (unreachable API, 429/502/503 with a Retry-After
    of at most `PLAYGROUND_RUN_MAX_RETRY_DELAY`) when nothing was published yet and this is
    not the final attempt; any other error fails the run with the API's code and message.
    Returns None if the run could not be claimed.
    """
    run = run_claim(run_id=run_id)
    if run is None:
        return None
    streams.publish(
        run.id, {"type": "status", "status": RunStatus.RUNNING, "label": RunStatus.RUNNING.label}
    )
    client = AcsClient(base_url=settings.GATEWAY_URL, api_key=worker_secret(run.user))
    progress = {"tokens": 0}
    try:
        if run.request.get("stream"):
            result = _execute_streaming(run, client, progress)
        else:
            completion = client.completions(run.request)
            result = {
                "response": completion.body,
                "request_id": completion.request_id,
                "timing": completion.server_timing,
            }
    except AcsApiError as error:
        countdown = error.retry_after if error.retry_after is not None else 1
        retryable = error.should_retry and countdown <= settings.PLAYGROUND_RUN_MAX_RETRY_DELAY
        if retryable and not progress["tokens"] and not final_attempt:
            _run_requeue(run)
            raise RunRetry(countdown) from error
        message = error.message
        if retryable and final_attempt:
            message = f"Gave up after {run.attempts} attempts. {message}"
        return _run_failed(run, code=error.code, message=message, request_id=error.request_id)
    except Exception:
        logger.exception("playground run %s failed", run.id)
        return _run_failed(
            run,
            code="playground_error",
            message="The playground worker could not process the answer; see the worker log.",
        )
    try:
        run = _run_succeed(run=run, **result)
    except DataError as refused:
        logger.warning("playground run %s: result not stored: %s", run.id, refused)
        error = result_unstorable(refused, request_id=result["request_id"])
        return run_fail(
            run=run, code=error.code, message=error.message, request_id=result["request_id"]
        )
    if run.kind == RunKind.CONTRAST:
        steering_vector_from_contrast(group=run.group)
    if run.kind in STEERING_KINDS:
        steering_score_queue(group=run.group)
    return run


def worker_secret(user: User) -> str:
    # The key normally exists (run_create makes it); reading it without the lock keeps the
    # worker's path to the first token short.
    key = ApiKey.objects.filter(user=user, is_playground=True).first()
    if key is None:
        return playground_key_get_or_create(user=user)[1]
    return playground_key_secret(key)


def _run_requeue(run: Run) -> None:
    streams.reset(run.id)
    Run.objects.filter(pk=run.pk, status=RunStatus.RUNNING).update(status=RunStatus.QUEUED)


def _execute_streaming(run: Run, client: AcsClient, progress: dict) -> dict:
    body = dict(run.request)
    frames = []
    sent = time.perf_counter()
    with client.stream_completions(body) as stream:
        for frame in stream:
            frames.append(frame)
            for choice in frame.get("choices") or []:
                text = choice.get("text") or ""
                if not text:
                    continue
                arrived = timezone.now()
                streams.publish(
                    run.id, {"type": "token", "choice": choice.get("index", 0), "text": text}
                )
                if not progress["tokens"]:
                    Run.objects.filter(pk=run.pk).update(
                        first_token_at=arrived, api_ttft_ms=(time.perf_counter() - sent) * 1000
                    )
                progress["tokens"] += 1
        return {
            "response": merge_stream_frames(frames),
            "request_id": stream.request_id,
            "timing": stream.server_timing,
        }


def merge_stream_frames(frames: list[dict]) -> dict:
    """Rebuild the non-streaming body from streamed frames: text and logprobs concatenated
    per choice, prompt_logprobs and finish_reason kept, usage from the final frame."""
    choices: dict[int, dict] = {}
    merged = {"object": "text_completion", "choices": [], "usage": None}
    for frame in frames:
        for field in ("id", "created", "model"):
            if field in frame:
                merged[field] = frame[field]
        if frame.get("usage"):
            merged["usage"] = frame["usage"]
        for piece in frame.get("choices") or []:
            index = piece.get("index", 0)
            choice = choices.setdefault(
                index, {"index": index, "text": "", "logprobs": None, "finish_reason": None}
            )
            choice["text"] += piece.get("text") or ""
            if piece.get("finish_reason"):
                choice["finish_reason"] = piece["finish_reason"]
            if piece.get("prompt_logprobs") is not None:
                choice["prompt_logprobs"] = piece["prompt_logprobs"]
            if piece.get("prompt_token_ids") is not None:
                choice["prompt_token_ids"] = piece["prompt_token_ids"]
            logprobs = piece.get("logprobs")
            if logprobs:
                if choice["logprobs"] is None:
                    choice["logprobs"] = {
                        "tokens": [],
                        "token_logprobs": [],
                        "top_logprobs": [],
                        "text_offset": [],
                    }
                for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                    choice["logprobs"][field].extend(logprobs.get(field) or [])
    merged["choices"] = [choices[index] for index in sorted(choices)]
    return merged


def _run_succeed(*, run: Run, response: dict, request_id: str, timing: dict) -> Run:
    """Store the run's response (DataError when the database cannot hold it) and end its
    stream."""
    # Tokenized after the answer, off the path to the first token.
    tokens = run_tokens(run.request, response)
    now = timezone.now()
    with transaction.atomic():
        Run.objects.filter(pk=run.pk).update(
            status=RunStatus.SUCCEEDED,
            response=response,
            tokens=tokens,
            usage=response.get("usage"),
            request_id=request_id,
            gateway_ms=timing.get("gateway"),
            upstream_ms=timing.get("upstream"),
            finished_at=now,
        )
    streams.publish(run.id, {"type": "end", "status": RunStatus.SUCCEEDED})
    run.refresh_from_db()
    return run


def _run_failed(run: Run, **error) -> Run:
    run = run_fail(run=run, **error)
    if run.kind in STEERING_KINDS:
        # The other runs may all be done: compare the ones that succeeded.
        steering_score_queue(group=run.group)
    return run


def run_fail(*, run: Run, code: str, message: str, request_id: str = "") -> Run:
    """Mark the run failed with a message a person can read, and end its stream."""
    Run.objects.filter(pk=run.pk).update(
        status=RunStatus.FAILED,
        error_code=code,
        error_message=message,
        request_id=request_id,
        finished_at=timezone.now(),
    )
    streams.publish(
        run.id,
        {"type": "end", "status": RunStatus.FAILED, "error": {"code": code, "message": message}},
    )
    run.refresh_from_db()
    return run


def runs_fail_stuck(*, now=None) -> int:
    """Fail runs that can no longer finish: running past the API's 14-minute request limit
    (their worker died; a redelivered task cannot claim a running run) or still queued after
    as long (no worker took them). Returns how many were failed. Run by beat every minute."""
    cutoff = (now or timezone.now()) - dt.timedelta(seconds=settings.PLAYGROUND_RUN_STUCK_SECONDS)
    stuck = Run.objects.filter(
        Q(status=RunStatus.RUNNING, started_at__lt=cutoff)
        | Q(status=RunStatus.QUEUED, queued_at__lt=cutoff)
    )
    failed = 0
    for run in stuck:
        was_running = run.status == RunStatus.RUNNING
        # Conditional, so a run that finished meanwhile is left alone.
        if Run.objects.filter(pk=run.pk, status=run.status).update(status=RunStatus.FAILED):
            run_fail(
                run=run,
                code="worker_lost" if was_running else "not_started",
                message=(
                    "The worker running this request stopped before it finished; re-run it."
                    if was_running
                    else "No worker picked this run up in time; re-run it."
                ),
            )
            failed += 1
    return failed


# ---------------------------------------------------------------------------------------
# Steering vectors


class VectorError(ValueError):
    """An uploaded or built vector that cannot be used; the message names the problem."""


def vector_from_upload(array: np.ndarray, *, hidden_size: int) -> np.ndarray:
    """Check an uploaded array is `[hidden]` or `[1, hidden]` floats and return it as
    float32 `[hidden]`."""
    if not (np.issubdtype(array.dtype, np.floating) or np.issubdtype(array.dtype, np.integer)):
        raise VectorError(f"The array has dtype {array.dtype}; upload float values.")
    if array.ndim == 2 and array.shape[0] == 1:
        array = array[0]
    if array.ndim != 1 or array.shape[0] != hidden_size:
        raise VectorError(
            f"The array has shape {list(array.shape)}; this model needs [{hidden_size}] "
            f"or [1, {hidden_size}]."
        )
    if not np.all(np.isfinite(array)):
        raise VectorError("The array contains NaN or infinite values.")
    return array.astype(np.float32)


def steering_vector_create(
    *,
    user: User,
    name: str,
    model: str,
    layer: int,
    method: str,
    vector: np.ndarray,
    details: dict | None = None,
    layer_typical_norm: float | None = None,
    source_group: uuid.UUID | None = None,
) -> SteeringVector:
    """Save a `[hidden]` vector in the user's library (stored in the API's codec)."""
    return SteeringVector.objects.create(
        user=user,
        name=name,
        model=model,
        layer=layer,
        method=method,
        details=details or {},
        hidden_size=int(vector.shape[0]),
        norm=float(np.linalg.norm(vector)),
        layer_typical_norm=layer_typical_norm,
        data=encode_vector(vector),
        source_group=source_group,
    )


# The fixed reference prompts whose residual norms define a layer's typical norm: ordinary
# sentences of different kinds, so the median describes ordinary tokens at that layer.
REFERENCE_PROMPTS = (
    "The museum opens at nine in the morning and closes at five.",
    "She poured the coffee, sat down by the window and read the letter again.",
    "Rainfall in the valley was lower than usual this spring.",
    "To install the package, run the command below and restart the server.",
)


def contrast_runs_create(
    *,
    user: User,
    model: str,
    name: str,
    layer: int,
    method: str,
    positive: str,
    negative: str,
    submit_token: uuid.UUID | None = None,
) -> uuid.UUID:
    """Queue the two capture runs of a contrast vector and the captures of the reference
    prompts at the same layer (for the layer's typical norm); the vector is saved when they
    have finished (`steering_vector_from_contrast`). Returns the pair's group id (that of the
    first pair, when `submit_token` was submitted before)."""

    def capture(prompt: str) -> dict:
        return {
            "model": model,
            "prompt": prompt,
            "max_tokens": 1,
            "temperature": 0,
            "output_residual_stream": [layer],
        }

    def create() -> uuid.UUID:
        group = uuid.uuid4()
        meta = {"vector_name": name, "layer": layer, "method": method}
        with transaction.atomic():
            for role, prompt in (("positive", positive), ("negative", negative)):
                _run_create(
                    user=user,
                    kind=RunKind.CONTRAST,
                    group=group,
                    scale=None,
                    vector=None,
                    request=capture(prompt),
                    meta={"role": role, **meta},
                    submit_token=submit_token if role == "positive" else None,
                )
            for index, prompt in enumerate(REFERENCE_PROMPTS):
                _run_create(
                    user=user,
                    kind=RunKind.CONTRAST,
                    group=group,
                    scale=None,
                    vector=None,
                    request=capture(prompt),
                    meta={"role": "reference", "reference": index, **meta},
                    submit_token=None,
                )
        return group

    return submitted_once(
        user=user, submit_token=submit_token, create=create, existing=lambda run: run.group
    )


def contrast_difference(positive: np.ndarray, negative: np.ndarray, *, method: str) -> np.ndarray:
    """The steering direction from two `[tokens, hidden]` captures at one layer."""
    if method == VectorMethod.CONTRAST_MEAN:
        return positive.mean(axis=0) - negative.mean(axis=0)
    return positive[-1] - negative[-1]


def steering_vector_from_contrast(*, group) -> SteeringVector | None:
    """Build and save the vector of a contrast pair once both captures have succeeded and
    the reference captures have finished; idempotent (the pair's `group` is unique among
    vectors). Its typical layer norm comes from the reference captures that succeeded
    (None if none did)."""
    runs = list(Run.objects.filter(group=group))
    by_role = {run.meta.get("role"): run for run in runs}
    positive, negative = by_role.get("positive"), by_role.get("negative")
    references = [run for run in runs if run.meta.get("role") == "reference"]
    if not positive or not negative:
        return None
    if positive.status != RunStatus.SUCCEEDED or negative.status != RunStatus.SUCCEEDED:
        return None
    if not all(run.is_finished for run in references):
        return None
    existing = SteeringVector.objects.filter(source_group=group).first()
    if existing:
        return existing
    captures = [
        decode(run.response["activations"]["residual_stream"])[0] for run in (positive, negative)
    ]
    meta = positive.meta
    vector = contrast_difference(*captures, method=meta["method"])
    measured = [run for run in references if run.status == RunStatus.SUCCEEDED]
    typical = None
    details = {
        "positive": positive.request["prompt"],
        "negative": negative.request["prompt"],
        "runs": [str(positive.id), str(negative.id)],
    }
    if measured:
        typical, positions = figures.typical_norm(
            [decode(run.response["activations"]["residual_stream"])[0] for run in measured]
        )
        details["typical_norm"] = {
            "definition": figures.TYPICAL_NORM_DEFINITION,
            "layer": meta["layer"],
            "prompts": [run.request["prompt"] for run in measured],
            "positions": positions,
            "runs": [str(run.id) for run in measured],
        }
    try:
        with transaction.atomic():
            created = steering_vector_create(
                user=positive.user,
                name=meta["vector_name"],
                model=positive.request["model"],
                layer=meta["layer"],
                method=meta["method"],
                vector=vector,
                details=details,
                layer_typical_norm=typical,
                source_group=group,
            )
    except IntegrityError:
        # Another capture's worker saved it first.
        return SteeringVector.objects.get(source_group=group)
    Run.objects.filter(group=group).update(vector=created)
    return created


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
) -> uuid.UUID:
    """Queue a baseline (scale 0) and one steered run per scale, all with the same request
    and seed, adding `vector` at `layers`. Returns the group id of the comparison (that of
    the first comparison, when `submit_token` was submitted before).

    `entered_scales` are the scales as the user gave them in `scale_unit` ("absolute" or
    "typical": multiples of the layer's typical norm), kept to show them as entered. A sweep
    with a `target_token` also scores prompt + target (see `with_target_scored`)."""
    entered = entered_scales if entered_scales is not None else scales

    def create() -> uuid.UUID:
        group = uuid.uuid4()
        activations = steering_activations(vector, layers)
        with transaction.atomic():
            for scale, scale_entered in [(0.0, 0.0), *zip(scales, entered, strict=True)]:
                request = dict(base_request)
                if kind == RunKind.SWEEP and target_token:
                    request = with_target_scored(request, target_token)
                request["apply_steering_vectors"] = [
                    {"activations": activations, "layer_indices": layers, "scale": scale}
                ]
                run_kind = kind
                if kind == RunKind.STEERING_STEERED and scale == 0.0:
                    run_kind = RunKind.STEERING_BASELINE
                _run_create(
                    user=user,
                    kind=run_kind,
                    group=group,
                    scale=scale,
                    vector=vector,
                    request=request,
                    meta={
                        "target_token": target_token,
                        "layers": layers,
                        "scale_unit": scale_unit,
                        "scale_entered": scale_entered,
                    },
                    submit_token=submit_token if scale == 0.0 else None,
                )
        return group

    return submitted_once(
        user=user, submit_token=submit_token, create=create, existing=lambda run: run.group
    )


def steering_activations(vector: SteeringVector, layers: list[int]) -> dict:
    """The vector as the codec object of an `apply_steering_vectors` entry: one row of it
    per layer in `layers` (shape [len(layers), hidden])."""
    return encode_vector(np.tile(decode(vector.data)[None, :], (len(layers), 1)))


def with_target_scored(request: dict, target: str) -> dict:
    """The request with a second prompt, prompt + `target`, and `prompt_logprobs: 0`: the
    second choice's last prompt logprobs are the target's own, from the full distribution,
    however unlikely the target is (a top-k list would often leave it out)."""
    prompt = request["prompt"]
    return {**request, "prompt": [prompt, prompt + target], "prompt_logprobs": 0}


# ---------------------------------------------------------------------------------------
# Steering compared on the same tokens (teacher-forced requests; see `scoring`)

STEERING_KINDS = (RunKind.STEERING_BASELINE, RunKind.STEERING_STEERED, RunKind.SWEEP)
# The full next-token distribution (for the KL divergence) is asked for only while prompt +
# completion is at most this many tokens: every position is a vocabulary-sized JSON object
# (about 4 MB for SmolLM2's 49,152 tokens), which the worker parses whole. The API allows 256.
KL_MAX_TOKENS = 64


class ScoreUnavailable(Exception):
    """The runs cannot be compared on the same tokens; the message says why."""


def steering_score_queue(*, group) -> SteeringScore | None:
    """Queue the same-token comparison of a steering comparison or sweep once all its runs
    have finished, if the baseline and at least one steered run succeeded. Idempotent: the
    group's score is unique, so the last two runs finishing at once queue it once."""
    runs = list(Run.objects.filter(group=group).only("status", "scale", "user_id"))
    if not runs or not all(run.is_finished for run in runs):
        return None
    succeeded = [run for run in runs if run.status == RunStatus.SUCCEEDED]
    if not any(run.scale == 0 for run in succeeded) or all(run.scale == 0 for run in succeeded):
        return None
    try:
        with transaction.atomic():
            score = SteeringScore.objects.create(group=group, user_id=runs[0].user_id)
            transaction.on_commit(lambda: task_send(STEERING_SCORE_TASK, str(score.pk)))
    except IntegrityError:
        return SteeringScore.objects.get(group=group)
    return score


def steering_score_execute(*, score_id) -> SteeringScore | None:
    """Claim a queued score, send its teacher-forced requests to /v1 with the user's
    playground key and store the per-token logprobs and KL divergences (see
    `_steering_compare`); an error fails it with a message a person can read. Returns None
    if it could not be claimed."""
    claimed = SteeringScore.objects.filter(pk=score_id, status=RunStatus.QUEUED).update(
        status=RunStatus.RUNNING
    )
    if not claimed:
        return None
    score = SteeringScore.objects.select_related("user").get(pk=score_id)
    runs = Run.objects.filter(group=score.group, status=RunStatus.SUCCEEDED).order_by("scale")
    baseline = next(run for run in runs if run.scale == 0)
    steered = [run for run in runs if run.scale != 0]
    client = AcsClient(base_url=settings.GATEWAY_URL, api_key=worker_secret(score.user))
    fields = {"status": RunStatus.FAILED, "finished_at": timezone.now()}
    try:
        fields.update(results=_steering_compare(client, baseline, steered))
        fields["status"] = RunStatus.SUCCEEDED
    except AcsApiError as error:
        fields.update(error_code=error.code, error_message=error.message)
    except ScoreUnavailable as reason:
        fields.update(error_code="not_comparable", error_message=str(reason))
    except Exception:
        logger.exception("steering score %s failed", score.pk)
        fields.update(
            error_code="playground_error",
            error_message="The playground worker could not compare the runs; see its log.",
        )
    SteeringScore.objects.filter(pk=score.pk).update(**fields)
    score.refresh_from_db()
    return score


# Alternatives asked for when finding which of several same-looking tokens a run sampled.
RESOLVE_TOP_K = 20


def run_token_ids(run: Run, send) -> tuple[list[int], list[int], list[str]]:
    """The prompt's token ids, and the completion's ids and strings, of a run's first choice.

    A completion token whose string several tokens decode to (a piece of a character, shown
    as U+FFFD) has no id in `run.tokens`: it is found by one teacher-forced request under the
    run's own model, on the prompt and the tokens before it plus a placeholder, whose last
    prompt_logprobs entry lists the likeliest tokens there: the one sampled has that string
    and, of those, the logprob closest to the one the run reported (`send(purpose, body)`
    sends a request)."""
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
            run.request, prompt["ids"] + ids[:index] + [0], full_vocabulary=False,
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
            baseline.request, prompt_ids + base_ids, full_vocabulary=full, steered=False
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
        baseline.request, prompt_ids, full_vocabulary=False, steered=False
    )
    body["prompt"] = [own[run.pk][0] + own[run.pk][1] for run in steered]
    under_baseline = send("baseline model, each steered run's tokens", body)["choices"]
    results = []
    for index, run in enumerate(steered):
        run_prompt, ids, strings = own[run.pk]
        answer = send(
            f"steered model (scale {run.scale_label}), baseline's tokens",
            scoring.teacher_forced_request(
                run.request, prompt_ids + base_ids, full_vocabulary=full, steered=True
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
                run.request, run_prompt + ids, full_vocabulary=False, steered=True
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


def steering_scores_fail_stuck(*, now=None) -> int:
    """Fail scores still queued or running after `PLAYGROUND_RUN_STUCK_SECONDS` (their worker
    died, or none took them), so their pages stop waiting. Returns how many."""
    cutoff = (now or timezone.now()) - dt.timedelta(seconds=settings.PLAYGROUND_RUN_STUCK_SECONDS)
    return SteeringScore.objects.filter(
        status__in=(RunStatus.QUEUED, RunStatus.RUNNING), created_at__lt=cutoff
    ).update(
        status=RunStatus.FAILED,
        error_code="worker_lost",
        error_message="The comparison on the same tokens did not finish; re-run the comparison.",
        finished_at=now or timezone.now(),
    )


# ---------------------------------------------------------------------------------------
# Jobs asked for on the Jobs page


def job_submission_create(
    *, user: User, kind: str, request: dict, submit_token: uuid.UUID | None = None
) -> JobSubmission:
    """Store a queued submission of a completion or harvest job and enqueue its sending once
    the transaction commits. The same `submit_token` again returns the first submission (a
    unique constraint decides between concurrent posts)."""

    def existing() -> JobSubmission | None:
        if submit_token is None:
            return None
        return JobSubmission.objects.filter(user=user, submit_token=submit_token).first()

    if (submission := existing()) is not None:
        return submission
    try:
        with transaction.atomic():
            playground_key_get_or_create(user=user)
            submission = JobSubmission.objects.create(
                user=user, kind=kind, request=request, submit_token=submit_token
            )
            transaction.on_commit(lambda: task_send(JOB_SUBMISSION_SEND_TASK, str(submission.id)))
    except IntegrityError:
        if (submission := existing()) is None:
            raise
    return submission


class SubmissionRetry(Exception):
    """The API refused for now (Retry-After): the submission is queued again."""

    def __init__(self, countdown: float):
        super().__init__(f"retry in {countdown}s")
        self.countdown = countdown


def job_submission_send(*, submission_id, final_attempt: bool) -> JobSubmission | None:
    """Claim a queued submission and send it to /v1 with the user's playground key, a
    completion job or a harvest with the submission's id as its Idempotency-Key (so a resend
    never makes a second job). Keeps the API's job id, or its error. Raises
    `SubmissionRetry` for an answer that asks to retry within
    `PLAYGROUND_RUN_MAX_RETRY_DELAY` (or an API that could not be reached), unless this is
    the final attempt. Returns None if the submission could not be claimed."""
    claimed = JobSubmission.objects.filter(
        pk=submission_id, status=JobSubmissionStatus.QUEUED
    ).update(status=JobSubmissionStatus.SENDING, attempts=F("attempts") + 1)
    if not claimed:
        return None
    submission = JobSubmission.objects.select_related("user").get(pk=submission_id)
    client = AcsClient(base_url=settings.GATEWAY_URL, api_key=worker_secret(submission.user))
    try:
        if submission.kind == JobKind.COMPLETION:
            job_id = client.submit_completion_job(
                submission.request, idempotency_key=str(submission.id)
            ).id
        else:
            job_id = client.submit_harvest(
                submission.request, idempotency_key=str(submission.id)
            ).job_id
    except AcsApiError as error:
        countdown = error.retry_after if error.retry_after is not None else 1
        if (
            error.should_retry
            and countdown <= settings.PLAYGROUND_RUN_MAX_RETRY_DELAY
            and not final_attempt
        ):
            JobSubmission.objects.filter(pk=submission.pk).update(status=JobSubmissionStatus.QUEUED)
            raise SubmissionRetry(countdown) from error
        return _job_submission_refuse(submission, code=error.code, message=error.message)
    JobSubmission.objects.filter(pk=submission.pk).update(
        status=JobSubmissionStatus.SUBMITTED, job_id=job_id, sent_at=timezone.now()
    )
    submission.refresh_from_db()
    return submission


def _job_submission_refuse(submission: JobSubmission, *, code: str, message: str):
    JobSubmission.objects.filter(pk=submission.pk).update(
        status=JobSubmissionStatus.REFUSED,
        error_code=code,
        error_message=message,
        sent_at=timezone.now(),
    )
    submission.refresh_from_db()
    return submission


def job_submissions_fail_stuck(*, now=None) -> int:
    """Refuse submissions still queued or sending after `PLAYGROUND_RUN_STUCK_SECONDS` (no
    worker took them, or their worker died mid-send), so the Jobs page stops waiting for
    them. Returns how many. Run by beat with the runs sweep."""
    cutoff = (now or timezone.now()) - dt.timedelta(seconds=settings.PLAYGROUND_RUN_STUCK_SECONDS)
    return JobSubmission.objects.filter(
        status__in=(JobSubmissionStatus.QUEUED, JobSubmissionStatus.SENDING),
        created_at__lt=cutoff,
    ).update(
        status=JobSubmissionStatus.REFUSED,
        error_code="not_sent",
        error_message="No worker sent this job in time; check the jobs below, then submit again.",
        sent_at=now or timezone.now(),
    )
