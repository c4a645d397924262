"""Budget reservation, settlement and the usage ledger, as async calls for the gateway.

Each helper is one thread hop holding one DB connection, so a request makes few round-trips:
reserve before the upstream, then settle and record in one go after it.
"""

from django.db import transaction

from accounts.services import (
    BudgetExceeded,
    budget_reserve,
    budget_settle,
    usage_record_create,
)

from .db import run_db
from .errors import ApiError


def _reserve(**kwargs):
    try:
        return budget_reserve(**kwargs)
    except BudgetExceeded as error:
        return error


async def reserve(*, key, prompt_tokens, max_tokens, completions, activation):
    """Hold the worst case against every budget window, or raise 429 with the contract's
    code (budget_exceeded, activation_quota_exceeded, spend_cap)."""
    outcome = await run_db(
        _reserve,
        key=key,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        completions=completions,
        activation=activation,
    )
    if isinstance(outcome, BudgetExceeded):
        raise ApiError(429, outcome.code, outcome.message)
    return outcome


def _settle_and_record(settlement, record):
    # One transaction: one commit (one WAL flush) for both writes.
    with transaction.atomic():
        if settlement is not None:
            budget_settle(**settlement)
        if record is not None:
            usage_record_create(**record)


async def settle_and_record(*, settlement: dict | None, record: dict | None) -> None:
    """Settle a reservation (`budget_settle` kwargs) and write the usage record
    (`usage_record_create` kwargs); either may be None."""
    await run_db(_settle_and_record, settlement, record)
