"""Time every usage page and the staff overview on a year of data.

    python bench/usage.py [--records 1000000] [--runs 7] [--reseed]

Uses its own PostgreSQL database (DATABASE_URL, default `acs_bench_usage`), creating and
migrating it if needed, and seeds it once with `manage.py acs_seed_usage` (reused on later
runs unless --reseed). Each page is fetched with Django's test Client: one warm-up, then the
median of --runs timed requests, for a 90-day and a 365-day range. Target: < 300 ms each.
Exits 1 if any page misses the target.
"""

import argparse
import datetime as dt
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/acs_bench_usage")
os.environ.setdefault("REDIS_URL", "redis://127.0.0.1:6379/13")
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "acs_portal.settings")

from testsupport.servers import loopback_production_env  # noqa: E402 (needs ROOT on the path)

for name, value in loopback_production_env().items():
    os.environ.setdefault(name, value)

TARGET_MS = 300


def ensure_database(url: str) -> None:
    import dj_database_url
    import psycopg

    config = dj_database_url.parse(url)
    name = config["NAME"]
    with psycopg.connect(
        host=config["HOST"] or None,
        port=config["PORT"] or None,
        user=config["USER"] or None,
        password=config["PASSWORD"] or None,
        dbname="postgres",
        autocommit=True,
    ) as conn:
        if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone():
            return
        conn.execute(f'CREATE DATABASE "{name}"')
        print(f"created database {name}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--reseed", action="store_true")
    args = parser.parse_args()

    ensure_database(os.environ["DATABASE_URL"])
    import django

    django.setup()
    from django.core.management import call_command
    from django.db import connection
    from django.test import Client
    from django.utils import timezone

    from accounts.models import User, UserStatus
    from metering.models import UsageDaily, UsageRecord
    from metering.selectors import RequestLogFilter, request_log_page
    from portal.usage_forms import cursor_encode
    from testsupport.second_factor import sign_in

    call_command("migrate", verbosity=0)
    # Pages link the hashed static names of the manifest (production settings).
    call_command("collectstatic", "--noinput", verbosity=0)
    if args.reseed:
        with connection.cursor() as cursor:
            cursor.execute(f"TRUNCATE {UsageRecord._meta.db_table}, {UsageDaily._meta.db_table}")
    existing = UsageRecord.objects.count()
    if existing < args.records:
        started = time.perf_counter()
        call_command("acs_seed_usage", records=args.records - existing)
        print(f"seeding took {time.perf_counter() - started:.1f} s")
    print(
        f"{UsageRecord.objects.count()} usage records, "
        f"{UsageDaily.objects.count()} daily roll-up rows"
    )

    user = User.objects.get(email="seed-user-000@usage.example.org")
    staff, _ = User.objects.get_or_create(
        email="bench-staff@usage.example.org",
        defaults={"is_staff": True, "status": UserStatus.APPROVED},
    )
    today = timezone.now().astimezone(dt.UTC).date()
    year = f"range=custom&from={today - dt.timedelta(days=364)}&to={today}"
    as_user, as_staff = Client(), Client()
    as_user.force_login(user)
    sign_in(as_staff, staff)  # the staff pages need the second factor passed too
    newest = UsageRecord.objects.filter(user=user).order_by("-created_at", "-id").first()
    _, last_of_first_page = request_log_page(RequestLogFilter(user_id=user.pk))
    page_two = cursor_encode(*last_of_first_page)

    pages = [
        (as_user, "/usage/?range=90", {}),
        (as_user, f"/usage/?{year}", {}),
        (as_user, "/usage/?range=90", {"HX-Request": "true"}),
        (as_user, f"/usage/?{year}&model=smollm2-135m", {"HX-Request": "true"}),
        (as_user, "/usage/export.csv?range=90", {}),
        (as_user, f"/usage/export.csv?{year}", {}),
        (as_user, "/usage/requests/", {}),
        (as_user, f"/usage/requests/?before={page_two}", {}),
        (as_user, "/usage/requests/?status=5xx", {}),
        (as_user, f"/usage/requests/?from={today - dt.timedelta(days=364)}&model=smollm2-360m", {}),
        (as_user, f"/usage/requests/{newest.pk}/", {}),
        (as_staff, "/usage/staff/?range=90", {}),
        (as_staff, f"/usage/staff/?{year}", {}),
        (as_staff, f"/usage/staff/users/{user.pk}/?range=90", {}),
        (as_staff, f"/usage/staff/users/{user.pk}/?{year}", {}),
    ]
    print(f"\n| page | median ms | max ms | < {TARGET_MS} ms |")
    print("|---|---:|---:|---|")
    missed = 0
    for client, url, headers in pages:
        assert client.get(url, headers=headers).status_code == 200, url
        times = []
        for _ in range(args.runs):
            started = time.perf_counter()
            client.get(url, headers=headers)
            times.append((time.perf_counter() - started) * 1000)
        median = statistics.median(times)
        missed += median >= TARGET_MS
        label = url.replace(year, "365 days") + (" (htmx)" if headers else "")
        ok = "yes" if median < TARGET_MS else "NO"
        print(f"| `{label}` | {median:.0f} | {max(times):.0f} | {ok} |")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
