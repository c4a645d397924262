"""The run state machine: queued → running → succeeded | failed, claimed once, retried only
on transient errors; the managed playground key."""

import datetime as dt
import threading
import uuid

import httpx
import numpy as np
import pytest
from cryptography.fernet import Fernet
from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from accounts.models import ApiKey, AuditLog
from accounts.services.auth import api_key_authenticate
from accounts.services.keys import api_key_revoke
from accounts.services.playground_key import playground_key_get_or_create
from acs_client.codec import decode
from acs_portal.celery import app as celery_app
from api.auth import access_generation_bump
from infra.lifecycle import WorkStatus
from playground import tasks
from playground.models import Run, RunKind
from playground.runs.execution import run_claim, run_execute
from playground.runs.services import (
    group_runs_dispatch,
    run_create,
    run_enqueue,
    run_fail,
    runs_fail_stuck,
)
from playground.vectors.services import contrast_runs_create, steering_vector_from_contrast

from .conftest import recorded, replay

REQUEST = {"model": "smollm2-135m", "prompt": "The capital of France is", "max_tokens": 6}
TIMING = {"server-timing": "gateway;dur=14.5, upstream;dur=11.25", "x-request-id": "req-9"}


def error(status, code, headers=None):
    body = {"error": {"code": code, "message": f"{code} happened", "type": "x"}}
    return httpx.Response(status, json=body, headers=headers or {})


@pytest.fixture
def queued_run(approved_user, no_enqueue):
    return run_create(user=approved_user, request=REQUEST)


def test_playground_key_is_created_once_with_an_encrypted_secret(approved_user):
    key, secret = playground_key_get_or_create(user=approved_user)
    again, same_secret = playground_key_get_or_create(user=approved_user)
    assert again.pk == key.pk and same_secret == secret
    assert key.is_playground and key.name == "Playground"
    assert secret not in key.encrypted_secret
    fernet = Fernet(settings.PLAYGROUND_KEY_ENCRYPTION_KEY.encode())
    assert fernet.decrypt(key.encrypted_secret.encode()).decode() == secret
    assert api_key_authenticate(f"Bearer {secret}").pk == key.pk
    assert AuditLog.objects.filter(action="key.create", target_id=str(key.pk)).count() == 1


@pytest.mark.django_db(transaction=True)
def test_two_first_uses_at_once_make_one_key(approved_user):
    barrier = threading.Barrier(2)
    secrets = []

    def first_use():
        barrier.wait()
        try:
            secrets.append(playground_key_get_or_create(user=approved_user)[1])
        finally:
            connection.close()

    threads = [threading.Thread(target=first_use) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(secrets) == 2 and secrets[0] == secrets[1]
    assert ApiKey.objects.filter(user=approved_user, is_playground=True).count() == 1


def test_run_is_enqueued_only_after_commit(
    approved_user, no_enqueue, django_capture_on_commit_callbacks
):
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        run = run_create(user=approved_user, request=REQUEST)
    # Creating the playground key also schedules the gateway's access-cache refresh.
    enqueues = [callback for callback in callbacks if callback is not access_generation_bump]
    assert no_enqueue == [] and len(enqueues) == 1
    enqueues[0]()
    assert no_enqueue == [str(run.id)]
    # Every run asks for its tokens' ids, which label its positions.
    assert run.status == WorkStatus.QUEUED and run.request == {**REQUEST, "return_token_ids": True}


@pytest.mark.django_db(transaction=True)
def test_two_workers_racing_claim_a_run_once(approved_user, no_enqueue):
    run = run_create(user=approved_user, request=REQUEST)
    barrier = threading.Barrier(8)
    claims = []

    def worker():
        barrier.wait()
        try:
            claims.append(run_claim(run_id=run.id))
        finally:
            connection.close()

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    winners = [claim for claim in claims if claim is not None]
    assert len(claims) == 8 and len(winners) == 1
    assert winners[0].status == WorkStatus.RUNNING
    assert run_claim(run_id=run.id) is None


def test_successful_run_stores_response_timings_and_usage(queued_run, gateway, redis_client):
    gateway.handler = lambda request: httpx.Response(
        200, json=recorded("completion_logprobs.json"), headers=TIMING
    )
    run = run_execute(run_id=queued_run.id)
    assert run.status == WorkStatus.SUCCEEDED
    assert run.response["choices"][0]["text"] == " Paris.\n\nThe answer"
    assert (run.gateway_ms, run.upstream_ms, run.request_id) == (14.5, 11.25, "req-9")
    assert run.usage == {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11}
    assert run.started_at >= run.created_at and run.finished_at >= run.started_at
    sent = gateway.requests[0]
    assert sent.url.path == "/v1/completions"
    assert httpx.Response(200, content=sent.content).json() == queued_run.request
    _, secret = playground_key_get_or_create(user=queued_run.user)
    assert sent.headers["authorization"] == f"Bearer {secret}"
    assert [event["type"] for event in replay(run.id)] == ["status", "end"]


def test_streamed_run_publishes_tokens_and_merges_the_frames(
    approved_user, no_enqueue, gateway, redis_client
):
    run = run_create(user=approved_user, request={**REQUEST, "stream": True})
    gateway.handler = lambda request: httpx.Response(
        200, text=recorded("stream.txt"), headers=TIMING
    )
    run = run_execute(run_id=run.id)
    events = replay(run.id)
    assert [e["text"] for e in events if e["type"] == "token"] == ["\n", "//", " create"]
    assert events[-1] == {"type": "end", "status": "succeeded"}
    choice = run.response["choices"][0]
    assert choice["text"] == "\n// create"
    assert choice["logprobs"]["tokens"] == ["\n", "//", " create"]
    assert len(choice["prompt_logprobs"]) == 11  # prompt_tokens
    assert choice["finish_reason"] == "length"
    assert run.usage["completion_tokens"] == 3
    assert run.first_token_at is not None and run.first_token_at <= run.finished_at


@pytest.mark.parametrize(
    "answer",
    [
        error(503, "circuit_open", {"retry-after": "2"}),
        error(502, "upstream_unreachable", {"retry-after": "1"}),
        error(429, "queue_full", {"retry-after": "1"}),
    ],
)
def test_transient_error_requeues_the_run_for_a_retry(
    queued_run, gateway, redis_client, monkeypatch, answer
):
    sent = []
    monkeypatch.setattr(
        celery_app, "send_task", lambda name, args, countdown=None: sent.append((*args, countdown))
    )
    gateway.handler = lambda request: answer
    run_execute(run_id=queued_run.id)
    queued_run.refresh_from_db()
    assert queued_run.status == WorkStatus.QUEUED and queued_run.attempts == 1
    assert sent == [(str(queued_run.id), int(answer.headers["retry-after"]))]
    assert replay(queued_run.id) == []


@pytest.mark.parametrize(
    ("answer", "code"),
    [
        (error(400, "invalid_request", {"x-should-retry": "false"}), "invalid_request"),
        (error(429, "budget_exceeded"), "budget_exceeded"),
        (error(429, "spend_cap", {"retry-after": "3600"}), "spend_cap"),
        (error(502, "upstream_server_error"), "upstream_server_error"),
        (error(401, "key_disabled"), "key_disabled"),
    ],
)
def test_permanent_error_fails_the_run_with_the_api_code(
    queued_run, gateway, redis_client, answer, code
):
    gateway.handler = lambda request: answer
    run = run_execute(run_id=queued_run.id)
    assert run.status == WorkStatus.FAILED
    assert run.error_code == code and run.error_message == f"{code} happened"
    assert replay(run.id)[-1]["error"]["code"] == code


def test_last_attempt_at_a_transient_error_fails_with_a_readable_message(
    queued_run, gateway, redis_client
):
    Run.objects.filter(pk=queued_run.pk).update(attempts=settings.PLAYGROUND_RUN_MAX_RETRIES)
    gateway.handler = lambda request: error(503, "circuit_open", {"retry-after": "1"})
    run = run_execute(run_id=queued_run.id)
    assert run.status == WorkStatus.FAILED and run.error_code == "circuit_open"
    assert run.error_message == "Gave up after 4 attempts. circuit_open happened"


def test_error_frame_after_tokens_fails_without_retry(
    approved_user, no_enqueue, gateway, redis_client
):
    run = run_create(user=approved_user, request={**REQUEST, "stream": True})
    body = 'data: {"choices":[{"index":0,"text":"Hi"}]}\n\n' + (
        'data: {"error":{"code":"vllm_engine_dead","message":"engine died","type":"x"}}\n\n'
    )
    gateway.handler = lambda request: httpx.Response(200, text=body)
    run = run_execute(run_id=run.id)
    assert (run.status, run.error_code, run.error_message) == (
        WorkStatus.FAILED, "vllm_engine_dead", "engine died"
    )  # fmt: skip
    assert [e["type"] for e in replay(run.id)] == ["status", "token", "end"]


def test_unreadable_answer_fails_the_run_instead_of_leaving_it_running(
    queued_run, gateway, redis_client
):
    gateway.handler = lambda request: httpx.Response(200, text="not json")
    run = run_execute(run_id=queued_run.id)
    assert run.status == WorkStatus.FAILED and run.error_code == "playground_error"


def test_finished_run_is_not_executed_again(queued_run, gateway, redis_client):
    gateway.handler = lambda request: httpx.Response(200, json=recorded("completion_logprobs.json"))
    run_execute(run_id=queued_run.id)
    assert run_execute(run_id=queued_run.id) is None
    assert len(gateway.requests) == 1


def run_task_and_its_retries(run: Run, sent: list) -> None:
    """Run the run's task, then each task it sent again (a worker's part), until none is."""
    sent.append(str(run.id))
    while sent:
        tasks.run_execute_task.apply(args=[sent.pop(0)])


def test_task_retries_transient_errors_then_succeeds(queued_run, gateway, redis_client, no_enqueue):
    answers = iter(
        [
            error(503, "circuit_open", {"retry-after": "0"}),
            error(502, "upstream_unreachable", {"retry-after": "0"}),
            httpx.Response(200, json=recorded("completion_logprobs.json")),
        ]
    )
    gateway.handler = lambda request: next(answers)
    run_task_and_its_retries(queued_run, no_enqueue)
    queued_run.refresh_from_db()
    assert queued_run.status == WorkStatus.SUCCEEDED and queued_run.attempts == 3


def test_task_does_not_retry_a_permanent_error(queued_run, gateway, redis_client):
    gateway.handler = lambda request: error(400, "context_length_exceeded")
    tasks.run_execute_task.apply(args=[str(queued_run.id)])
    queued_run.refresh_from_db()
    assert queued_run.status == WorkStatus.FAILED and queued_run.attempts == 1
    assert len(gateway.requests) == 1


def test_task_gives_up_after_the_configured_retries(queued_run, gateway, redis_client, no_enqueue):
    gateway.handler = lambda request: error(503, "circuit_open", {"retry-after": "0"})
    run_task_and_its_retries(queued_run, no_enqueue)
    queued_run.refresh_from_db()
    assert queued_run.status == WorkStatus.FAILED
    assert len(gateway.requests) == settings.PLAYGROUND_RUN_MAX_RETRIES + 1
    assert queued_run.error_message.startswith("Gave up after 4 attempts.")


def test_contrast_pair_builds_one_vector_from_both_captures(
    approved_user, no_enqueue, gateway, redis_client
):
    group = contrast_runs_create(
        user=approved_user,
        model="smollm2-135m",
        name="happy",
        layer=4,
        method="contrast_last",
        positive="I love this",
        negative="I hate this",
    )
    capture = recorded("capture.json")
    gateway.handler = lambda request: httpx.Response(200, json=capture)
    runs = list(Run.objects.filter(group=group, kind=RunKind.CONTRAST))
    assert {r.request["output_residual_stream"][0] for r in runs} == {4}
    for run in runs[:-1]:
        run_execute(run_id=run.id)
    assert not approved_user.steering_vectors.exists()
    run_execute(run_id=runs[-1].id)
    vector = approved_user.steering_vectors.get()
    assert (vector.name, vector.layer, vector.hidden_size) == ("happy", 4, 576)
    assert vector.norm == 0.0  # both captures are the same recording
    # The median norm of the reference captures' positions after the first (the recording
    # has 5 positions: 4 per reference prompt).
    rows = decode(capture["activations"]["residual_stream"])[0][1:]
    assert vector.layer_typical_norm == pytest.approx(
        float(np.median(np.linalg.norm(rows, axis=1)))
    )
    assert vector.details["typical_norm"]["positions"] == 4 * 4
    assert steering_vector_from_contrast(group=group).pk == vector.pk


def test_runs_stuck_past_the_request_limit_are_failed_with_a_reason(
    approved_user, no_enqueue, redis_client, settings
):
    import datetime as dt

    from django.utils import timezone

    now = timezone.now()
    old = now - dt.timedelta(seconds=settings.PLAYGROUND_RUN_STUCK_SECONDS + 1)
    request = {"model": "smollm2-135m", "prompt": "Hi", "max_tokens": 1}
    dead = Run.objects.create(
        user=approved_user, request=request, status=WorkStatus.RUNNING, started_at=old
    )
    lost = Run.objects.create(user=approved_user, request=request, created_at=old, sent_at=old)
    alive = Run.objects.create(
        user=approved_user, request=request, status=WorkStatus.RUNNING, started_at=now
    )
    assert tasks.runs_sweep_task() == 2
    for run, code in [(dead, "worker_lost"), (lost, "not_started")]:
        run.refresh_from_db()
        assert (run.status, run.error_code) == (WorkStatus.FAILED, code)
        assert run.error_message
    alive.refresh_from_db()
    assert alive.status == WorkStatus.RUNNING
    assert tasks.runs_sweep_task() == 0


@pytest.mark.django_db(transaction=True)
def test_a_run_whose_playground_key_was_revoked_fails_with_the_apis_code_and_message(
    approved_user, no_enqueue, gateway_url, settings, redis_client
):
    """The worker calls the real gateway, which checks the key on every request (its auth
    cache is refreshed by the revocation), so no start-time check of its own is needed."""
    settings.GATEWAY_URL = gateway_url
    run = run_create(user=approved_user, request=REQUEST)
    key, secret = playground_key_get_or_create(user=approved_user)
    models = httpx.get(f"{gateway_url}/v1/models", headers={"Authorization": f"Bearer {secret}"})
    assert models.status_code == 200  # the gateway now holds the key in its auth cache
    api_key_revoke(key=key, acting_user=approved_user)

    run = run_execute(run_id=run.id)

    assert run.status == WorkStatus.FAILED
    assert run.error_code == "key_revoked"
    assert run.error_message == "This API key has been revoked; create a new one."
    assert run.request_id
    end = list(replay(run.id))[-1]
    assert end["error"] == {"code": "key_revoked", "message": run.error_message}


@pytest.mark.django_db(transaction=True)
def test_a_groups_runs_go_to_the_workers_a_few_at_a_time(
    approved_user, no_enqueue, redis_client, settings
):
    """A grid or sweep queues all its runs, but sends PLAYGROUND_GROUP_RUNS_IN_FLIGHT of them
    to the first-in-first-out queue at a time, the next as one ends (succeeded or failed):
    another user's run queued meanwhile waits behind those few, not the whole grid."""
    settings.PLAYGROUND_GROUP_RUNS_IN_FLIGHT = 3
    request = {"model": "smollm2-135m", "prompt": "Hi", "max_tokens": 1}
    group = uuid.uuid4()
    with transaction.atomic():
        runs = [
            run_enqueue(
                user=approved_user,
                request=request,
                kind=RunKind.SWEEP,
                group=group,
                vector=None,
                meta={},
                submit_token=None,
            )
            for _ in range(8)
        ]
    assert no_enqueue == [str(run.pk) for run in runs[:3]]
    other = run_create(user=approved_user, request=request)
    assert no_enqueue[-1] == str(other.pk)
    run_fail(run=runs[0], code="x", message="failed")
    assert no_enqueue[-1] == str(runs[3].pk)
    Run.objects.filter(pk=runs[1].pk).update(status=WorkStatus.SUCCEEDED)
    assert group_runs_dispatch(group=group) == 1
    assert no_enqueue[-1] == str(runs[4].pk)
    assert group_runs_dispatch(group=group) == 0
    # Runs waiting for their turn are not stuck: the sweep fails the four sent and never
    # taken (the group's three and the other run), whose ends send the group's last three.
    later = timezone.now() + dt.timedelta(seconds=settings.PLAYGROUND_RUN_STUCK_SECONDS + 1)
    assert runs_fail_stuck(now=later) == 4
    assert no_enqueue[-3:] == [str(run.pk) for run in runs[5:]]
    waiting = Run.objects.filter(pk__in=[run.pk for run in runs[5:]], status=WorkStatus.QUEUED)
    assert waiting.exclude(sent_at=None).count() == 3
