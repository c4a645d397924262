"""Writes of a comparison of two runs: its same-token scoring queued (the task sent once the
transaction commits), claimed and executed by a worker with the user's playground key, and
failed once stuck. What it sends is `client.scored_on_each_others_tokens`."""

import logging

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from accounts.models import User
from accounts.services.playground_key import worker_secret
from acs_client.client import AcsClient
from infra.lifecycle import WorkStatus, work_claim
from infra.tasks import task_send_on_commit
from playground.compare.client import scored_on_each_others_tokens
from playground.compare.selectors import comparison_for_runs
from playground.models import Run, RunComparison
from playground.steering.services import (
    scoring_fail_unsent,
    scoring_outcome,
    scorings_fail_stuck,
)

logger = logging.getLogger(__name__)

COMPARISON_TASK = "playground.tasks.run_comparison_execute_task"


# ---------------------------------------------------------------------------------------
# Scoring on the same tokens (teacher-forced requests through /v1, billed like runs)


def comparison_queue(*, user: User, run_a: Run, run_b: Run) -> RunComparison:
    """Queue the same-token scoring of two of the user's runs; asked again, the existing one
    (queued again if it failed). The (run_a, run_b) pair is unique, so a double click queues
    it once."""
    comparison = comparison_for_runs(run_a=run_a, run_b=run_b)
    if comparison is None:
        try:
            with transaction.atomic():
                comparison = RunComparison.objects.create(user=user, run_a=run_a, run_b=run_b)
                _comparison_send_on_commit(comparison)
        except IntegrityError:
            comparison = comparison_for_runs(run_a=run_a, run_b=run_b)
        return comparison
    with transaction.atomic():
        requeued = RunComparison.objects.filter(pk=comparison.pk, status=WorkStatus.FAILED).update(
            status=WorkStatus.QUEUED, error_code="", error_message="", finished_at=None
        )
        if requeued:
            _comparison_send_on_commit(comparison)
    comparison.refresh_from_db()
    return comparison


def _comparison_send_on_commit(comparison: RunComparison) -> None:
    task_send_on_commit(
        COMPARISON_TASK,
        str(comparison.pk),
        unsent=lambda error: scoring_fail_unsent(scoring=comparison, error=error),
    )


def comparison_execute(*, comparison_id) -> RunComparison | None:
    """Claim a queued comparison, send its two teacher-forced requests (both sequences under
    A's settings, then under B's) with the user's playground key, and keep the ids sent and
    the raw answers; an error fails it with a message a person can read. None if it could
    not be claimed."""
    attempt = work_claim(RunComparison, pk=comparison_id, now=timezone.now())
    if attempt is None:
        return None
    comparison = RunComparison.objects.select_related("user", "run_a", "run_b").get(
        pk=comparison_id
    )
    client = AcsClient(base_url=settings.GATEWAY_URL, api_key=worker_secret(comparison.user))
    fields = scoring_outcome(
        lambda: scored_on_each_others_tokens(client, comparison.run_a, comparison.run_b),
        what=f"run comparison {comparison.pk}",
    )
    attempt.write(**fields)  # nothing once the sweep failed it
    comparison.refresh_from_db()
    return comparison


def comparisons_fail_stuck(*, now=None) -> int:
    """Fail comparisons whose worker died (see `scorings_fail_stuck`)."""
    return scorings_fail_stuck(
        RunComparison, message="The scoring did not finish; score again.", now=now
    )
