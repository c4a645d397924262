"""A playground run whose worker's request outlasted the stuck-run sweep (issue 43 item 4): the
sweep failed the run (worker_lost) while the worker still waited on /v1, and the answer that
arrives at last is neither stored over the failure nor published as a second end: the run's
writes are fenced by its claim's attempt (`infra.lifecycle.Attempt`)."""

import datetime as dt

import httpx
from django.conf import settings
from django.utils import timezone

from infra.lifecycle import WorkStatus
from playground.runs.execution import run_execute
from playground.runs.services import run_create, runs_fail_stuck

from .conftest import recorded, replay

REQUEST = {"model": "smollm2-135m", "prompt": "The capital of France is", "max_tokens": 6}


def test_a_run_failed_by_the_sweep_keeps_its_failure_when_its_answer_arrives_late(
    approved_user, no_enqueue, gateway, redis_client
):
    run = run_create(user=approved_user, request=REQUEST)
    swept = []

    def answer_after_the_sweep(request: httpx.Request) -> httpx.Response:
        # The worker waits on /v1 past PLAYGROUND_RUN_STUCK_SECONDS: the sweep fails the run.
        later = timezone.now() + dt.timedelta(seconds=settings.PLAYGROUND_RUN_STUCK_SECONDS + 1)
        swept.append(runs_fail_stuck(now=later))
        return httpx.Response(200, json=recorded("completion_logprobs.json"))

    gateway.handler = answer_after_the_sweep
    returned = run_execute(run_id=run.id)

    assert swept == [1]
    run.refresh_from_db()
    assert (run.status, run.error_code) == (WorkStatus.FAILED, "worker_lost")
    assert run.response is None and run.usage is None
    assert (returned.status, returned.error_code) == (WorkStatus.FAILED, "worker_lost")
    # One end, the sweep's: the late answer published none.
    ends = [event for event in replay(run.id) if event["type"] == "end"]
    assert [end["status"] for end in ends] == [WorkStatus.FAILED]
