"""Budget holds, settlement and usage records of a job's work, as synchronous calls for the
workers (the gateway's are `metering.gateway`).

A job pays for each batch of work like the same requests sent to /v1: `job_reserve` holds its
worst case against every budget window, `job_meter` settles the hold to the usage the
upstream reported and writes the batch's usage record, in one transaction, and
`job_release` settles a batch that did no work to nothing. `job_metered` tells a later
attempt whether a batch was already paid for.
"""

import datetime as dt

from django.utils import timezone

from accounts.models import ApiKey

from .budgets import budget_activations_refund_steps, budget_reserve, budget_settle_steps
from .gateway import unbilled_release_steps
from .models import BudgetReservation, UsageRecord
from .sql import run_steps
from .usage import usage_records_steps


def job_reserve(
    *, key: ApiKey, prompt_tokens: int, max_tokens: int, completions: int
) -> BudgetReservation:
    """Hold the worst case of `completions` captures (each counting one activation request)
    over `prompt_tokens` prompt tokens and `max_tokens` each, or raise `BudgetExceeded`."""
    return budget_reserve(
        key=key,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        completions=completions,
        activation=completions,
    )


def job_meter(
    *,
    hold: BudgetReservation,
    key: ApiKey,
    request_id: str,
    endpoint: str,
    model: str,
    completions: int,
    prompt_tokens: int,
    completion_tokens: int,
    latency_ms: float,
    activation_layers: list[int],
    fence=None,
) -> bool:
    """Settle `hold` to the usage of the `completions` captures that happened, give back the
    activation requests of those it held that did not, and write the batch's usage record,
    in one transaction; True. `fence` (`infra.lifecycle.Attempt.fence_steps`, which may
    record the batch on the job's row) runs first in that transaction: when its steps return
    False the job is no longer this worker's, the hold is released, nothing is billed, and
    False is returned."""
    record = UsageRecord(
        created_at=timezone.now(),
        key_id=key.pk,
        user_id=key.user_id,
        request_id=request_id,
        endpoint=endpoint,
        status_code=200,
        latency_ms=latency_ms,
        model=model,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        activation_layers=activation_layers,
    )
    return run_steps(
        lambda: _settle_steps(hold, completions=completions, record=record, fence=fence)
    )


def job_release(*, hold: BudgetReservation) -> None:
    """Settle `hold` of a batch that did no work to nothing, giving back its activation
    requests."""
    run_steps(lambda: _settle_steps(hold, completions=0, record=None))


def _settle_steps(
    hold: BudgetReservation, *, completions: int, record: UsageRecord | None, fence=None
):
    if fence is not None and not (yield from fence()):
        yield from unbilled_release_steps(hold)
        return False
    settled = yield from budget_settle_steps(
        reservation_id=hold.pk,
        prompt_tokens=record.prompt_tokens if record else 0,
        completion_tokens=record.completion_tokens if record else 0,
    )
    if settled and hold.activation_requests > completions:
        yield from budget_activations_refund_steps(
            reservation=hold, count=hold.activation_requests - completions
        )
    if record is not None:
        yield from usage_records_steps(records=[record])
    return True


def job_metered(*, key_id: int, request_id: str, since: dt.datetime) -> bool:
    """Whether the batch of `request_id` (the key's, metered after `since`) was paid for: its
    usage record and its settlement are written in one transaction."""
    return UsageRecord.objects.filter(
        key_id=key_id, created_at__gte=since, request_id=request_id
    ).exists()
