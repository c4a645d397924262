"""The money path's rows: budget windows' roll-ups (`UsagePeriod`), reservations and leases
that hold tokens in them, usage records and their daily roll-up.

They were `accounts`' models and keep its table names (`Meta.db_table`). Budgets are in
tokens and reset in UTC. "Remaining in this window" is one cheap read of a `UsagePeriod` row,
which `metering.budgets.budget_reserve` / `budget_settle` update under a row lock.
"""

from django.db import models
from django.db.models import Q
from django.utils import timezone

from accounts.models import ApiKey, User


class UsagePeriod(models.Model):
    """Budget roll-up: tokens used and reserved in one UTC period, for one key (`key` set) or
    for a user's whole account (`key` null). Updated only under a row lock. The periods and
    the windows that read these rows are `metering.windows`'."""

    user = models.ForeignKey(User, on_delete=models.CASCADE, related_name="usage_periods")
    key = models.ForeignKey(
        ApiKey, null=True, blank=True, on_delete=models.CASCADE, related_name="usage_periods"
    )
    # The `name` of a `metering.windows.Period` (no choices: a new period needs no migration).
    period = models.CharField(max_length=8)
    start = models.DateField()
    used_tokens = models.BigIntegerField(default=0)
    reserved_tokens = models.BigIntegerField(default=0)
    used_input = models.BigIntegerField(default=0)
    reserved_input = models.BigIntegerField(default=0)
    used_output = models.BigIntegerField(default=0)
    reserved_output = models.BigIntegerField(default=0)
    activation_requests = models.IntegerField(default=0)
    harvest_jobs = models.IntegerField(default=0)
    requests = models.IntegerField(default=0)

    class Meta:
        db_table = "accounts_usageperiod"
        constraints = [
            models.UniqueConstraint(
                fields=["key", "period", "start"],
                condition=Q(key__isnull=False),
                name="usage_period_key_unique",
            ),
            models.UniqueConstraint(
                fields=["user", "period", "start"],
                condition=Q(key__isnull=True),
                name="usage_period_account_unique",
            ),
        ]

    def __str__(self):
        owner = f"key {self.key_id}" if self.key_id else f"account {self.user_id}"
        return f"{owner} {self.period} {self.start}"


class ReservationStatus(models.TextChoices):
    RESERVED = "reserved", "Reserved"
    SETTLED = "settled", "Settled"
    RELEASED = "released", "Released"


class BudgetReservation(models.Model):
    """Tokens held for one request between `budget_reserve` and `budget_settle`. Its gateway
    process refreshes `alive_at` while the request runs (`metering.gateway`); a reservation not
    refreshed for long (its holder crashed) is released by a periodic sweep, and a settle
    that comes after all still charges what the request used."""

    key = models.ForeignKey(ApiKey, on_delete=models.CASCADE, related_name="reservations")
    user = models.ForeignKey(User, on_delete=models.CASCADE, related_name="+")
    created_at = models.DateTimeField(default=timezone.now)
    # When its process last said the request is still running (the sweep's clock).
    alive_at = models.DateTimeField(default=timezone.now)
    month_start = models.DateField()
    day_start = models.DateField()
    prompt_tokens = models.BigIntegerField()
    output_tokens = models.BigIntegerField()
    max_tokens_requested = models.IntegerField()
    max_tokens_applied = models.IntegerField()
    # How many activation requests the hold counted against the monthly quota.
    activation_requests = models.PositiveIntegerField(default=0)
    status = models.CharField(
        max_length=10, choices=ReservationStatus.choices, default=ReservationStatus.RESERVED
    )
    settled_prompt_tokens = models.BigIntegerField(null=True, blank=True)
    settled_completion_tokens = models.BigIntegerField(null=True, blank=True)
    settled_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "accounts_budgetreservation"
        indexes = [models.Index(fields=["status", "alive_at"])]

    @property
    def clamped(self):
        return self.max_tokens_applied < self.max_tokens_requested


class BudgetLease(models.Model):
    """Tokens one gateway process holds against a key's and account's windows, to serve
    many requests from memory instead of one reservation each (see `metering.leases`).

    `held_tokens` count as reserved in the windows until they are spent (moved to used by a
    flush) or given back; a lease its process stopped refreshing (`alive_at`: the process
    died) is released by the same sweep as stale reservations."""

    key = models.ForeignKey(ApiKey, on_delete=models.CASCADE, related_name="leases")
    user = models.ForeignKey(User, on_delete=models.CASCADE, related_name="+")
    created_at = models.DateTimeField(default=timezone.now)
    alive_at = models.DateTimeField(default=timezone.now)
    month_start = models.DateField()
    day_start = models.DateField()
    held_tokens = models.BigIntegerField(default=0)
    spent_prompt_tokens = models.BigIntegerField(default=0)
    spent_completion_tokens = models.BigIntegerField(default=0)
    requests = models.IntegerField(default=0)
    returned_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "accounts_budgetlease"
        indexes = [models.Index(fields=["returned_at", "alive_at"])]


class UsageRecord(models.Model):
    """One row per /v1 request: metadata only, never prompt or completion text."""

    created_at = models.DateTimeField(default=timezone.now)
    request_id = models.CharField(max_length=64)
    # No index of their own: the (user, -created_at) and (key, -created_at) indexes below
    # serve lookups by either alone, and every batch of the gateway pays for each index.
    user = models.ForeignKey(
        User, on_delete=models.CASCADE, related_name="usage_records", db_index=False
    )
    key = models.ForeignKey(
        ApiKey, on_delete=models.CASCADE, related_name="usage_records", db_index=False
    )
    model = models.CharField(max_length=64, blank=True)
    endpoint = models.CharField(max_length=64)
    status_code = models.PositiveSmallIntegerField()
    error_code = models.CharField(max_length=64, blank=True)
    prompt_tokens = models.IntegerField(default=0)
    completion_tokens = models.IntegerField(default=0)
    latency_ms = models.FloatField()
    upstream_latency_ms = models.FloatField(null=True, blank=True)
    ttft_ms = models.FloatField(null=True, blank=True)
    stream = models.BooleanField(default=False)
    activation_layers = models.JSONField(null=True, blank=True)
    workload = models.CharField(max_length=16, blank=True)

    class Meta:
        db_table = "accounts_usagerecord"
        indexes = [
            models.Index(fields=["user", "-created_at"]),
            models.Index(fields=["key", "-created_at"]),
            models.Index(fields=["model", "-created_at"]),
            models.Index(fields=["-created_at"]),
        ]


class UsageDaily(models.Model):
    """Roll-up of `UsageRecord` per UTC day, key, model, status and error code, so usage pages
    never scan the raw records. Updated by `metering.usage.usage_record_create` with an upsert."""

    day = models.DateField()
    # The (user, day) index below serves lookups by user alone.
    user = models.ForeignKey(User, on_delete=models.CASCADE, related_name="+", db_index=False)
    key = models.ForeignKey(ApiKey, on_delete=models.CASCADE, related_name="+")
    model = models.CharField(max_length=64, blank=True)
    status_code = models.PositiveSmallIntegerField()
    error_code = models.CharField(max_length=64, blank=True)
    requests = models.IntegerField(default=0)
    prompt_tokens = models.BigIntegerField(default=0)
    completion_tokens = models.BigIntegerField(default=0)
    latency_ms_sum = models.FloatField(default=0)

    class Meta:
        db_table = "accounts_usagedaily"
        constraints = [
            models.UniqueConstraint(
                fields=["day", "key", "model", "status_code", "error_code"],
                name="usage_daily_unique",
            )
        ]
        indexes = [
            models.Index(fields=["user", "day"]),
            models.Index(fields=["day"]),
        ]
