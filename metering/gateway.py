"""Budget holds, settlement and usage records, as async calls for the gateway.

`reserve` holds a request's worst case before the upstream: out of a budget lease of the
process where it can (`metering.leases`), else as a reservation in one transaction of
`metering.budgets` step generators (`sql.run_steps_async`). `meter` settles the hold to the
actual usage and writes the usage record: batched with the leases on the server loop, else in
one transaction. `keep_alive` tells the sweep of stale holds that a long request still runs.
"""

import asyncio
import logging

import psycopg
from django.conf import settings
from django.db import OperationalError
from django.utils import timezone

from infra import background

from . import leases
from .budgets import (
    budget_activations_refund_steps,
    budget_holds_alive_steps,
    budget_reserve_steps,
    budget_settle_steps,
)
from .models import UsageRecord
from .sql import DatabaseBusy, run_steps_async
from .usage import usage_record_written_steps, usage_records_steps

logger = logging.getLogger(__name__)

# A running stream (which has no total time limit) marks its hold alive this many times per
# `settings.ACS_STALE_RESERVATION_SECONDS`, the age after which the sweep frees a hold as a
# dead process's: a heartbeat or two the database could not take do not get it freed.
HEARTBEATS_PER_STALE_AGE = 6
# A settlement the database could not take (every connection broken or busy) is tried again
# after these pauses; together they outlast a database restart or failover of a few seconds.
SETTLE_RETRY_S = (0.2, 0.5, 1.0, 2.0, 4.0, 8.0)


def hold_heartbeat_s() -> float:
    """Seconds between two marks of a running stream's hold as alive (5 minutes with the
    default ACS_STALE_RESERVATION_SECONDS of 30)."""
    return settings.ACS_STALE_RESERVATION_SECONDS / HEARTBEATS_PER_STALE_AGE


def reserve_from_lease(*, key, prompt_tokens, max_tokens, completions, activation):
    """What `reserve` returns when the key's budget lease in this process covers the worst
    case as it is (no database, no waiting); else None: call `reserve`."""
    if not leases.leasable(key, activation=activation):
        return None
    worst_case = _worst_case(prompt_tokens, max_tokens, completions)
    return leases.current().take(key=key, worst_case=worst_case, max_tokens=max_tokens)


async def reserve(*, key, prompt_tokens, max_tokens, completions, activation):
    """Hold the worst case against every budget window: a `leases.LeaseHold` or a
    `BudgetReservation` (whose `max_tokens_applied` may be clamped), or raise
    `BudgetExceeded` (or `sql.DatabaseBusy`)."""
    now = timezone.now()
    if leases.leasable(key, activation=activation):
        worst_case = _worst_case(prompt_tokens, max_tokens, completions)
        hold = await leases.current().hold(key=key, worst_case=worst_case, max_tokens=max_tokens)
        if hold is not None:
            return hold
    return await run_steps_async(
        lambda: budget_reserve_steps(
            key=key,
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            completions=completions,
            activation=activation,
            now=now,
        )
    )


def _worst_case(prompt_tokens: int, max_tokens: int, completions: int) -> int:
    """The tokens a request can spend at most, held out of a lease unclamped."""
    return prompt_tokens + completions * max_tokens


def _settle_and_record_steps(
    hold, record: UsageRecord, *, activations_refunded: bool, retry: bool, fence=None
):
    if retry and (yield from usage_record_written_steps(record=record)):
        return
    if fence is not None and not (yield from fence()):
        yield from unbilled_release_steps(hold)
        return
    if hold is not None:
        settled = yield from budget_settle_steps(
            reservation_id=hold.pk,
            prompt_tokens=record.prompt_tokens,
            completion_tokens=record.completion_tokens,
        )
        if settled and activations_refunded and hold.activation_requests:
            yield from budget_activations_refund_steps(
                reservation=hold, count=hold.activation_requests
            )
    yield from usage_records_steps(records=[record])


def meter(
    *, hold, record: UsageRecord, urgent: bool, activations_refunded: bool = False, fence=None
):
    """Settle `hold` (what `reserve` returned, or None) to the usage of the unsaved usage
    `record` and write the record. Returns a future done once both are written; `urgent`
    asks the lease writer not to wait for a fuller batch. `activations_refunded`: the
    activation requests the hold counted are given back (the upstream did no capture).

    `fence` (background work: `infra.lifecycle.Attempt.fence_steps`) makes steps run first in
    the same transaction; when they return False the work is no longer its worker's (a later
    attempt took it over): the hold is released and nothing is billed. A fenced bill is never
    taken from a lease (workers hold none)."""
    if fence is None and (isinstance(hold, leases.LeaseHold) or (hold is None and leases.active())):
        # Activation requests are never held out of a lease: nothing to give back.
        return leases.current().meter(hold=hold, record=record, urgent=urgent)
    if isinstance(hold, leases.LeaseHold):
        raise ValueError("a fenced bill needs a hold of its own, not one of a lease")
    return background.spawn(
        _settle_and_record(hold, record, activations_refunded=activations_refunded, fence=fence)
    )


def unbilled_release_steps(hold):
    """Steps: free `hold` (a `BudgetReservation`, or None) of work that is not billed, giving
    back the activation requests it counted."""
    if hold is not None:
        yield from budget_settle_steps(
            reservation_id=hold.pk, prompt_tokens=0, completion_tokens=0, release=True
        )


async def _settle_and_record(
    hold, record: UsageRecord, *, activations_refunded: bool, fence=None
) -> None:
    """Settle and write `record` in one transaction, retried while the database is out of
    reach. A retry first looks for the record: a broken attempt may have committed."""
    for attempt, pause in enumerate((*SETTLE_RETRY_S, None)):
        try:
            await run_steps_async(
                lambda retry=attempt > 0: _settle_and_record_steps(
                    hold,
                    record,
                    activations_refunded=activations_refunded,
                    retry=retry,
                    fence=fence,
                )
            )
            return
        except (DatabaseBusy, OperationalError, psycopg.OperationalError) as error:
            if pause is None:
                # The hold stays reserved until the sweep frees it as a dead process's.
                logger.error("dropped usage %s: %r", record.request_id, error)
                return
            await asyncio.sleep(pause)


def keep_alive(hold):
    """Mark `hold` (what `reserve` returned) alive now, in work of its own, so that the sweep
    leaves it (or the lease it was taken from) alone; returns that work's future."""
    if isinstance(hold, leases.LeaseHold):
        ids = {"lease_ids": [hold.lease.row.pk]}
    else:
        ids = {"reservation_ids": [hold.pk]}
    return background.spawn(_keep_alive(ids))


async def _keep_alive(ids: dict) -> None:
    try:
        await run_steps_async(lambda: budget_holds_alive_steps(**ids, now=timezone.now()))
    except Exception:
        # Tried again at the next heartbeat; the sweep waits HEARTBEATS_PER_STALE_AGE of them.
        logger.exception("could not mark budget holds %s alive", ids)
