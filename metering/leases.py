"""Budget leases and batched metering on the gateway's server loop.

Reserving each request's worst case in PostgreSQL, then settling it and writing its usage
record, took two transactions and about 2 ms of the gateway's CPU per request, against a
latency target of 2 ms for the whole gateway. So on its server loop a process instead:

- takes a *lease* for a key (`metering.budgets.budget_lease_steps`): a slice of what the
  key's and its account's windows have left, reserved in those windows like a request's worst
  case, and holds each request's worst case out of the lease in memory;
- writes what finished requests spent, and every usage record, in batches ("group commit"):
  at most every FLUSH_DELAY_S one transaction moves the tokens spent from each lease's hold
  to used and inserts the records; a stream's `[DONE]` waits for its batch;
- gives a lease's unused tokens back LEASE_IDLE_S after its last request, or once it is
  drained after being retired: when the key, its account or the spend cap changes (the auth
  cache then returns a new key object), at the end of the UTC day, LEASE_TAKE_S after it was
  granted, or when it cannot cover a request and no top-up is granted.

Nothing can overspend: a lease's tokens are reserved in every window before a request takes
any, and a request takes its whole worst case. Leases are granted only far from the limits
(see `metering.budgets.LEASE_SHARE`); near a limit every request is reserved exactly, with
clamping, after the process gave back its lease's unused tokens. What leasing changes is
visible: a window's `reserved` includes leased tokens until they are given back, and `used`
trails by up to FLUSH_DELAY_S. A process that dies loses the usage it had not written yet (at
most FLUSH_DELAY_S of requests); the sweep of stale reservations frees its leases.
"""

import asyncio
import contextlib
import logging
import time
import weakref
from dataclasses import dataclass

from django.utils import timezone

from infra import background

from . import windows
from .budgets import budget_lease_return_steps, budget_lease_spend_steps, budget_lease_steps
from .models import BudgetLease, UsageRecord
from .sql import on_postgresql, run_steps_async
from .usage import usage_record_written_steps, usage_records_steps

logger = logging.getLogger(__name__)

FLUSH_DELAY_S = 0.05
LEASE_IDLE_S = 2.0
LEASE_TAKE_S = 60.0
# A batch that fails to write is retried after RETRY_S, up to WRITE_ATTEMPTS times in all.
RETRY_S = 1.0
WRITE_ATTEMPTS = 3


@dataclass(eq=False)
class Lease:
    row: BudgetLease
    key: object  # the ApiKey snapshot it was granted under (see `usable_for`)
    held: int = 0  # tokens held in the windows, less any being given back
    in_flight: int = 0  # worst cases of the requests running on it
    unwritten: int = 0  # tokens spent by finished requests, not yet moved to used
    granted_at: float = 0.0
    last_used: float = 0.0
    retired: bool = False

    @property
    def free(self) -> int:
        return self.held - self.in_flight - self.unwritten

    def usable_for(self, key, now) -> bool:
        # The auth cache hands out one key object until the key, its user, the spend cap or
        # any other access setting changes: a new object means the lease's terms are stale.
        return (
            not self.retired
            and self.key is key
            and self.row.day_start == windows.utc_day(now)
            and time.monotonic() - self.granted_at < LEASE_TAKE_S
        )


@dataclass(eq=False)
class LeaseHold:
    """A request's worst case held out of a lease; `gateway.reserve` returns it in place
    of a BudgetReservation (it is never clamped)."""

    lease: Lease
    tokens: int
    max_tokens_applied: int


def active() -> bool:
    """Whether this call runs on the gateway's server loop against PostgreSQL, where
    metering goes through budget leases and batched writes."""
    return background.on_server_loop.get() and on_postgresql()


def leasable(key, *, activation: bool) -> bool:
    """Whether a request of `key` may be held out of a lease: activation requests (counted
    against a per-request quota) and keys with input or output budgets are reserved exactly."""
    return active() and not activation and not windows.has_split_limit(key)


class _Leases:
    def __init__(self):
        self.current: dict[int, Lease] = {}
        self.leases: set[Lease] = set()
        self.granting: dict[int, asyncio.Future] = {}
        # The key snapshot for which a lease was refused: leasing is tried again with the next.
        self.refused: dict[int, object] = {}
        self.spends: dict[Lease, list[int]] = {}
        self.records: list[UsageRecord] = []
        self.waiters: list[asyncio.Future] = []
        self.urgent = asyncio.Event()
        self.writer: asyncio.Future | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.failed_batches = 0
        # A batch whose write failed, to be tried again on its own: `(spends, records,
        # waiters)`. The failed attempt may have committed (the connection broke after its
        # COMMIT was sent), so the retry first looks for its records.
        self.unsure: tuple[dict, list, list] | None = None

    async def hold(self, *, key, worst_case: int, max_tokens: int) -> LeaseHold | None:
        """Hold `worst_case` tokens out of the key's lease, replacing the lease when it is
        stale or short; None when no lease can be granted (reserve exactly instead: this
        process's unused leased tokens of the key are back in the windows by then)."""
        while True:
            held = self.take(key=key, worst_case=worst_case, max_tokens=max_tokens)
            if held is not None:
                return held
            now = timezone.now()
            lease = self.current.get(key.pk)
            granting = self.granting.get(key.pk)
            if granting is not None:
                await asyncio.shield(granting)
            elif self.refused.get(key.pk) is key or not await self._grant(
                key=key, retiring=lease, worst_case=worst_case, now=now
            ):
                return None

    def take(self, *, key, worst_case: int, max_tokens: int) -> LeaseHold | None:
        """`hold` when the key's current lease covers `worst_case` as it is; else None."""
        lease = self.current.get(key.pk)
        if lease is None or lease.free < worst_case or not lease.usable_for(key, timezone.now()):
            return None
        lease.in_flight += worst_case
        lease.last_used = time.monotonic()
        return LeaseHold(lease, worst_case, max_tokens)

    async def _grant(self, *, key, retiring: Lease | None, worst_case: int, now) -> bool:
        done = self.granting[key.pk] = asyncio.get_running_loop().create_future()
        row = BudgetLease(
            key_id=key.pk,
            user_id=key.user_id,
            month_start=windows.MONTH.start(windows.utc_day(now)),
            day_start=windows.utc_day(now),
        )
        give_back = 0
        if retiring is not None:
            self._retire(retiring)
            if retiring.row.day_start == row.day_start:
                # Out of use before the transaction gives it back.
                give_back = max(retiring.free, 0)
                retiring.held -= give_back
        try:
            granted = await run_steps_async(
                lambda: budget_lease_steps(
                    key=key,
                    lease=row,
                    retiring=retiring.row if retiring else None,
                    give_back=give_back,
                    worst_case=worst_case,
                    now=now,
                )
            )
        except BaseException:
            if retiring is not None:
                retiring.held += give_back  # rolled back: still held
            raise
        finally:
            del self.granting[key.pk]
            done.set_result(None)
        if not granted:
            self.refused[key.pk] = key
            return False
        self.refused.pop(key.pk, None)
        lease = Lease(row=row, key=key, held=granted, granted_at=time.monotonic())
        self.leases.add(lease)
        self.current[key.pk] = lease
        return True

    def meter(self, *, hold: LeaseHold | None, record: UsageRecord, urgent: bool) -> asyncio.Future:
        """Count a finished request's usage (its unsaved `record`) against its lease hold,
        if any, and queue the record; the future is done once both are written, or once the
        writer gave up on them and logged it (it never fails: metering again would count
        the usage twice). `urgent` writes without waiting for more requests to join the
        batch."""
        if hold is not None:
            lease = hold.lease
            lease.in_flight -= hold.tokens
            lease.unwritten += record.prompt_tokens + record.completion_tokens
            lease.last_used = time.monotonic()
            totals = self.spends.setdefault(lease, [0, 0, 0])
            totals[0] += record.prompt_tokens
            totals[1] += record.completion_tokens
            totals[2] += 1
        self.records.append(record)
        written = asyncio.get_running_loop().create_future()
        self.waiters.append(written)
        if urgent:
            self.urgent.set()
        self._write_soon()
        return written

    def _retire(self, lease: Lease) -> None:
        lease.retired = True
        if self.current.get(lease.row.key_id) is lease:
            del self.current[lease.row.key_id]
        self._write_soon()

    def _write_soon(self) -> None:
        if self.writer is None:
            self.writer = background.spawn(self._write())

    async def _write(self) -> None:
        try:
            while True:
                if self.unsure is not None:
                    await self._write_batch()
                elif self.records:
                    if FLUSH_DELAY_S > 0 and not self.urgent.is_set():
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(self.urgent.wait(), FLUSH_DELAY_S)
                    self.urgent.clear()
                    await self._write_batch()
                elif returnable := self._returnable():
                    await self._give_back(returnable)
                else:
                    return
        finally:
            self.writer = None
            if self.leases and self.timer is None:
                self.timer = asyncio.get_running_loop().call_later(
                    max(LEASE_IDLE_S, 0.01), self._timer_fired
                )

    def _timer_fired(self) -> None:
        self.timer = None
        self._write_soon()

    async def _write_batch(self) -> None:
        retry = self.unsure is not None
        if retry:
            (spends, records, waiters), self.unsure = self.unsure, None
        else:
            spends, records, waiters = self.spends, self.records, self.waiters
            self.spends, self.records, self.waiters = {}, [], []
        try:
            await run_steps_async(lambda: _batch_steps(spends, records, retry=retry))
        except Exception as error:
            self.failed_batches += 1
            if self.failed_batches < WRITE_ATTEMPTS:
                logger.warning(
                    "could not write %d usage records, retrying: %r", len(records), error
                )
                # Their requests wait for the retry: were they told of the failure, they
                # would meter again what the retry writes.
                self.unsure = (spends, records, waiters)
                await asyncio.sleep(RETRY_S)
                return
            self.failed_batches = 0
            await self._write_one_by_one(spends, records)
        else:
            self.failed_batches = 0
            self._written(spends)
        for waiter in waiters:
            waiter.set_result(None)

    async def _write_one_by_one(self, spends, records) -> None:
        """After WRITE_ATTEMPTS failed batches: write the spends, then each record, on its
        own, and drop (logging it) whatever still fails, such as a record of a deleted key.
        Unless the last failed attempt did commit: then all of it is written."""
        with contextlib.suppress(Exception):
            if await run_steps_async(lambda: usage_record_written_steps(record=records[0])):
                self._written(spends)
                return
        for part_spends, part_records in [(spends, []), *(({}, [record]) for record in records)]:
            try:
                await run_steps_async(lambda s=part_spends, r=part_records: _batch_steps(s, r))
            except Exception:
                logger.exception("dropped usage %s", [record.request_id for record in part_records])
                for lease, (prompt, completion, _) in part_spends.items():
                    # Still held in the windows: given back with the rest of the lease.
                    lease.unwritten -= prompt + completion
            else:
                self._written(part_spends)

    @staticmethod
    def _written(spends) -> None:
        for lease, (prompt, completion, _) in spends.items():
            lease.held -= prompt + completion
            lease.unwritten -= prompt + completion

    def _returnable(self) -> list[Lease]:
        now = time.monotonic()
        return [
            lease
            for lease in self.leases
            if lease.in_flight == 0
            and lease not in self.spends
            and (self.unsure is None or lease not in self.unsure[0])
            and lease.row.key_id not in self.granting
            and (lease.retired or now - lease.last_used >= LEASE_IDLE_S)
        ]

    async def _give_back(self, leases: list[Lease]) -> None:
        for lease in leases:
            self._retire(lease)
            self.leases.discard(lease)
            lease.held = 0
            try:
                await run_steps_async(
                    lambda lease=lease: budget_lease_return_steps(lease=lease.row)
                )
            except Exception:
                logger.exception("could not return lease %s; the sweep will", lease.row.pk)

    async def drain(self) -> None:
        """Write everything queued and give every lease back (at server shutdown)."""
        for lease in list(self.leases):
            self._retire(lease)
        self.urgent.set()
        while self.writer is not None:
            await asyncio.shield(self.writer)


def _batch_steps(spends: dict, records: list, *, retry: bool = False):
    if retry and (yield from usage_record_written_steps(record=records[0])):
        return
    yield from budget_lease_spend_steps(
        spends=[
            {"lease": lease.row, "prompt_tokens": p, "completion_tokens": c, "requests": n}
            for lease, (p, c, n) in spends.items()
        ]
    )
    yield from usage_records_steps(records=records)


_by_loop: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Leases]" = (
    weakref.WeakKeyDictionary()
)


def current() -> _Leases:
    """The running loop's leases."""
    loop = asyncio.get_running_loop()
    leases = _by_loop.get(loop)
    if leases is None:
        leases = _by_loop[loop] = _Leases()
    return leases


async def drain() -> None:
    """`_Leases.drain` for the running loop's leases, if it has any."""
    leases = _by_loop.get(asyncio.get_running_loop())
    if leases is not None:
        await leases.drain()
