"""A run's execution by a Celery worker (`tasks.run_execute_task`): claimed, sent to /v1
through `acs_client` with the user's playground key, exactly as an outside client would,
its output published as it streams and its result stored."""

import logging
import time
from datetime import timedelta

from django.conf import settings
from django.db import DataError, connection, transaction
from django.utils import timezone

from accounts.services.playground_key import worker_secret
from acs_client.client import AcsApiError, AcsClient
from api.errors import result_unstorable
from infra.database import written_through_reconnects
from infra.lifecycle import WORK_ERRORS, Attempt, WorkStatus, work_claim
from playground.lens.run_lens import run_lens
from playground.models import Run, RunKind
from playground.runs import streams
from playground.runs.services import RUN_EXECUTE_TASK, group_runs_dispatch, run_fail
from playground.steering.services import STEERING_KINDS, steering_score_queue
from playground.tokens import run_tokens
from playground.vectors.services import steering_vector_from_contrast

logger = logging.getLogger(__name__)


def run_claim(*, run_id) -> Run | None:
    """Move a queued run to running and return it; None if another worker has it or it has
    finished. The conditional update makes the claim atomic across workers. The run's
    `attempts` is then the claim's attempt, which fences what its worker writes
    (`Attempt.of`) and counts its retries."""
    with transaction.atomic():
        if connection.vendor == "postgresql":
            # The claim is on the path to the first token; a claim lost in a crash only
            # leaves the run queued again, so it need not wait for the WAL flush.
            with connection.cursor() as cursor:
                cursor.execute("SET LOCAL synchronous_commit TO OFF")
        claimed = work_claim(Run, pk=run_id, now=timezone.now())
    if not claimed:
        return None
    return Run.objects.select_related("user").get(pk=run_id)


def run_execute(*, run_id) -> Run | None:
    """Claim the run, send its request, publish its output and store the result.

    A transient error (unreachable API, 429/502/503 with a Retry-After of at most
    `PLAYGROUND_RUN_MAX_RETRY_DELAY`) before anything was published puts the run back to
    queued and sends its task again after that delay (`Attempt.requeue`), for at most
    `PLAYGROUND_RUN_MAX_RETRIES` retries; any other error, or the last attempt's, fails the
    run with the API's code and message. Returns None if the run could not be claimed.
    Every write of the run is fenced by the claim's attempt (`infra.lifecycle`): once the
    sweep failed the run (its worker ran past the API's request limit), a late answer is
    neither stored nor published as its end.
    """
    run = run_claim(run_id=run_id)
    if run is None:
        return None
    attempt = Attempt.of(run)
    streams.publish(
        run.id, {"type": "status", "status": WorkStatus.RUNNING, "label": WorkStatus.RUNNING.label}
    )
    client = AcsClient(base_url=settings.GATEWAY_URL, api_key=worker_secret(run.user))
    progress = {"tokens": 0}
    try:
        if run.body.stream:
            result = _execute_streaming(run, client, progress)
        else:
            completion = client.completions(run.request)
            result = {
                "response": completion.body,
                "request_id": completion.request_id,
                "timing": completion.server_timing,
            }
    except AcsApiError as error:
        countdown = error.retry_in(at_most=settings.PLAYGROUND_RUN_MAX_RETRY_DELAY)
        retryable = countdown is not None
        final_attempt = attempt.number > settings.PLAYGROUND_RUN_MAX_RETRIES
        if retryable and not progress["tokens"] and not final_attempt:
            _run_requeue(run, attempt, delay_s=countdown)
            run.refresh_from_db()
            return run
        message = error.message
        if retryable and final_attempt:
            message = f"Gave up after {run.attempts} attempts. {message}"
        return _run_failed(
            run, attempt, code=error.code, message=message, request_id=error.request_id
        )
    except Exception:
        logger.exception("playground run %s failed", run.id)
        return _run_failed(
            run,
            attempt,
            code="playground_error",
            message=WORK_ERRORS["playground_error"],
        )
    try:
        stored = _run_succeed(run=run, attempt=attempt, **result)
    except DataError as refused:
        logger.warning("playground run %s: result not stored: %s", run.id, refused)
        error = result_unstorable(refused, request_id=result["request_id"])
        return run_fail(
            run=run,
            code=error.code,
            message=error.message,
            request_id=result["request_id"],
            attempt=attempt,
        )
    run.refresh_from_db()
    if not stored:
        return run
    if run.group is not None:
        group_runs_dispatch(group=run.group)
    if run.kind == RunKind.CONTRAST:
        steering_vector_from_contrast(group=run.group)
    if run.kind in STEERING_KINDS:
        steering_score_queue(group=run.group)
    return run


def _run_requeue(run: Run, attempt: Attempt, *, delay_s: float) -> None:
    """Put the run back to queued and send it again in `delay_s` seconds, while `attempt`
    holds it. The runs sweep, not a lease, finds a retry no worker took
    (`runs_fail_stuck`)."""
    streams.reset(run.id)
    written_through_reconnects(
        lambda: attempt.requeue(
            task=RUN_EXECUTE_TASK,
            delay_s=delay_s,
            lease=timedelta(seconds=settings.PLAYGROUND_RUN_STUCK_SECONDS),
            now=timezone.now(),
        )
    )


def _execute_streaming(run: Run, client: AcsClient, progress: dict) -> dict:
    body = dict(run.request)
    held = Attempt.of(run).rows()  # the run, while this worker's claim holds it
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
                    ttft_ms = (time.perf_counter() - sent) * 1000
                    written_through_reconnects(
                        lambda arrived=arrived, ttft_ms=ttft_ms: held.update(
                            first_token_at=arrived, api_ttft_ms=ttft_ms
                        )
                    )
                progress["tokens"] += 1
        return {
            "response": merge_stream_frames(frames),
            "request_id": stream.request_id,
            "timing": stream.server_timing,
        }


def merge_stream_frames(frames: list[dict]) -> dict:
    """Rebuild the non-streaming body from streamed frames: text, logprobs and token ids
    concatenated per choice, prompt_logprobs, prompt token ids and finish_reason kept, usage
    from the final frame."""
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
            if piece.get("token_ids") is not None:
                choice.setdefault("token_ids", []).extend(piece["token_ids"])
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


def _run_succeed(
    *, run: Run, attempt: Attempt, response: dict, request_id: str, timing: dict
) -> bool:
    """Store the run's response while `attempt` holds it (DataError when the database cannot
    hold it) and end its stream; False, storing and publishing nothing, when it no longer
    does."""
    # Tokenized after the answer, off the path to the first token; the lens before the run
    # is stored, so that its page shows it at once.
    tokens = run_tokens(run.body, response)
    lens = run_lens(run.body, response)
    now = timezone.now()
    stored = written_through_reconnects(
        lambda: attempt.write(
            status=WorkStatus.SUCCEEDED,
            response=response,
            tokens=tokens,
            lens=lens,
            usage=response.get("usage"),
            request_id=request_id,
            gateway_ms=timing.get("gateway"),
            upstream_ms=timing.get("upstream"),
            finished_at=now,
        )
    )
    if stored:
        streams.publish(run.id, {"type": "end", "status": WorkStatus.SUCCEEDED})
    return stored


def _run_failed(run: Run, attempt: Attempt, **error) -> Run:
    run = run_fail(run=run, attempt=attempt, **error)
    if run.kind in STEERING_KINDS:
        # The other runs may all be done: compare the ones that succeeded.
        steering_score_queue(group=run.group)
    return run
