"""Generate a year of synthetic usage for benchmarks and demos.

`python manage.py acs_seed_usage --records 1000000 [--users 8] [--days 365]` creates seed users
(`seed-user-NNN@usage.example.org`, two keys each), streams the records into PostgreSQL with
COPY in batches, then rebuilds the seed keys' `UsageDaily` roll-ups from the records with one
INSERT ... SELECT ... GROUP BY, so the roll-ups match the records exactly.
"""

import secrets
import time

import numpy as np
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.db import connection, transaction
from django.utils import timezone

from accounts.models import ApiKey, User, UserStatus
from accounts.services.keys import api_key_create
from metering.models import UsageDaily, UsageRecord

MODELS = ["smollm2-135m", "smollm2-360m", "llama-3.1-8b"]
# (status_code, error_code, probability)
OUTCOMES = [
    (200, "", 0.90),
    (400, "invalid_request", 0.03),
    (429, "budget_exceeded", 0.02),
    (429, "rate_limited", 0.02),
    (502, "upstream_unreachable", 0.01),
    (503, "circuit_open", 0.01),
    (504, "upstream_deadline", 0.01),
]
KEYS_PER_USER = 2
NULL = "\\N"  # COPY text format
COPY_COLUMNS = [
    "created_at",
    "request_id",
    "user_id",
    "key_id",
    "model",
    "endpoint",
    "status_code",
    "error_code",
    "prompt_tokens",
    "completion_tokens",
    "latency_ms",
    "upstream_latency_ms",
    "ttft_ms",
    "stream",
    "activation_layers",
    "workload",
]


class Command(BaseCommand):
    help = "Generate synthetic usage records (PostgreSQL COPY) and rebuild their daily roll-ups."

    def add_arguments(self, parser):
        parser.add_argument("--records", type=int, default=1_000_000)
        parser.add_argument("--users", type=int, default=8)
        parser.add_argument("--days", type=int, default=365)
        parser.add_argument("--batch", type=int, default=100_000)
        parser.add_argument("--seed", type=int, default=0, help="random seed")

    def handle(self, *args, records, users, days, batch, seed, **options):
        if connection.vendor != "postgresql":
            raise CommandError("acs_seed_usage needs PostgreSQL (it uses COPY); set DATABASE_URL.")
        if records < 0 or users < 1 or days < 1 or batch < 1:
            raise CommandError("--records must be ≥ 0; --users, --days and --batch ≥ 1.")
        started = time.perf_counter()
        keys = self._seed_keys(users)
        rng = np.random.default_rng(seed)
        now = timezone.now()
        run = secrets.token_hex(4)
        with transaction.atomic():
            written = 0
            while written < records:
                size = min(batch, records - written)
                self._copy_batch(rng, keys, now=now, days=days, size=size, first=written, run=run)
                written += size
                self.stdout.write(f"copied {written}/{records} records")
            daily_rows = self._rebuild_daily([key.pk for key in keys])
        with connection.cursor() as cursor:
            cursor.execute(f"ANALYZE {UsageRecord._meta.db_table}")
            cursor.execute(f"ANALYZE {UsageDaily._meta.db_table}")
        self.stdout.write(
            self.style.SUCCESS(
                f"{records} records for {len(keys)} keys of {users} users over {days} days, "
                f"{daily_rows} daily roll-up rows, in {time.perf_counter() - started:.1f} s"
            )
        )

    def _seed_keys(self, users: int) -> list[ApiKey]:
        keys = []
        for i in range(users):
            user, _ = User.objects.get_or_create(
                email=f"seed-user-{i:03d}@usage.example.org",
                defaults={
                    "name": f"Seed user {i}",
                    "status": UserStatus.APPROVED,
                    "monthly_token_budget": settings.ACS_DEFAULT_ACCOUNT_MONTHLY_TOKENS,
                },
            )
            own = list(ApiKey.objects.filter(user=user, is_playground=False).order_by("pk"))
            while len(own) < KEYS_PER_USER:
                key, _ = api_key_create(
                    user=user, name=f"seed key {len(own) + 1}", acting_user=None
                )
                own.append(key)
            keys.extend(own[:KEYS_PER_USER])
        return keys

    def _copy_batch(self, rng, keys, *, now, days, size, first, run):
        """COPY `size` random records, spread uniformly over the `days` before `now`; users
        get Zipf-like shares so the top-users table has a clear order."""
        weights = np.array([1 / (1 + i // KEYS_PER_USER) for i in range(len(keys))])
        key_index = rng.choice(len(keys), size=size, p=weights / weights.sum())
        span_us = days * 86_400_000_000
        offsets = rng.integers(0, span_us, size=size)
        stamps = np.datetime64(now.replace(tzinfo=None), "us") - offsets.astype("timedelta64[us]")
        created = np.datetime_as_string(stamps, unit="us")
        outcome = rng.choice(len(OUTCOMES), size=size, p=[o[2] for o in OUTCOMES])
        ok = outcome == 0
        model = rng.integers(0, len(MODELS), size=size)
        prompt = rng.lognormal(5, 1, size=size).astype(np.int64) + 1
        completion = np.where(ok, rng.lognormal(4.5, 1, size=size).astype(np.int64) + 1, 0)
        latency = rng.lognormal(6, 0.6, size=size)
        stream = rng.random(size) < 0.3
        activation = rng.random(size) < 0.05
        batch_workload = rng.random(size) < 0.1
        user_ids = [key.user_id for key in keys]
        key_ids = [key.pk for key in keys]
        lines = []
        for i in range(size):
            k = key_index[i]
            status, error, _ = OUTCOMES[outcome[i]]
            lat = latency[i]
            ttft = f"{lat * 0.2:.3f}" if stream[i] and ok[i] else NULL
            layers = "[0, 6, 12]" if activation[i] else NULL
            lines.append(
                f"{created[i]}+00\tseed-{run}-{first + i}\t{user_ids[k]}\t{key_ids[k]}\t"
                f"{MODELS[model[i]]}\t/v1/completions\t{status}\t{error}\t{prompt[i]}\t"
                f"{completion[i]}\t{lat:.3f}\t{lat * 0.9:.3f}\t{ttft}\t"
                f"{'t' if stream[i] else 'f'}\t{layers}\t"
                f"{'batch' if batch_workload[i] else ''}\n"
            )
        table = UsageRecord._meta.db_table
        with connection.cursor() as cursor:
            raw = cursor.cursor  # the psycopg cursor under Django's wrapper
            with raw.copy(f"COPY {table} ({', '.join(COPY_COLUMNS)}) FROM STDIN") as copy:
                copy.write("".join(lines))

    def _rebuild_daily(self, key_ids: list[int]) -> int:
        """Replace the keys' roll-up rows by sums over their records, per UTC day."""
        daily, records = UsageDaily._meta.db_table, UsageRecord._meta.db_table
        with connection.cursor() as cursor:
            cursor.execute(f"DELETE FROM {daily} WHERE key_id = ANY(%s)", [key_ids])
            cursor.execute(
                f"""
                INSERT INTO {daily} (day, user_id, key_id, model, status_code, error_code,
                                     requests, prompt_tokens, completion_tokens, latency_ms_sum)
                SELECT (created_at AT TIME ZONE 'UTC')::date, user_id, key_id, model,
                       status_code, error_code, count(*), sum(prompt_tokens),
                       sum(completion_tokens), sum(latency_ms)
                FROM {records}
                WHERE key_id = ANY(%s)
                GROUP BY 1, 2, 3, 4, 5, 6
                """,
                [key_ids],
            )
            return cursor.rowcount
