"""Budget reservation, settlement and the usage ledger, as async calls for the gateway.

Each call is one transaction of `accounts.services` step generators, run by
`db.run_steps_async`: reserve before the upstream, then settle and record in one go after it.
"""

from django.utils import timezone

from accounts.services import (
    BudgetExceeded,
    budget_reserve_steps,
    budget_settle_steps,
    usage_record_steps,
)

from .db import run_steps_async
from .errors import ApiError


async def reserve(*, key, prompt_tokens, max_tokens, completions, activation):
    """Hold the worst case against every budget window, or raise 429 with the contract's
    code (budget_exceeded, activation_quota_exceeded, spend_cap)."""
    now = timezone.now()
    try:
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
    except BudgetExceeded as error:
        raise ApiError(429, error.code, error.message) from None


def _settle_and_record_steps(settlement: dict | None, record: dict | None):
    if settlement is not None:
        yield from budget_settle_steps(**settlement)
    if record is not None:
        fields = dict(record)
        key = fields.pop("key")
        yield from usage_record_steps(
            key_id=key.pk, user_id=key.user_id, now=timezone.now(), **fields
        )


async def settle_and_record(*, settlement: dict | None, record: dict | None) -> None:
    """Settle a reservation (`budget_settle` kwargs) and write the usage record
    (`usage_record_create` kwargs), in one transaction; either may be None."""
    await run_steps_async(lambda: _settle_and_record_steps(settlement, record))
