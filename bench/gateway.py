"""Gateway overhead benchmark: a zero-latency stub upstream called directly vs through the
/v1 gateway (uvicorn + Django ASGI, real PostgreSQL and Redis), in one run.

    DATABASE_URL=postgres://... REDIS_URL=redis://.../N .venv/bin/python bench/gateway.py

Creates DATABASE_URL's database if missing (scripts/ensure-test-db), migrates it, replaces
its own users, keys and model row (names starting with "bench-"), starts the stub and the
gateway as subprocesses on free loopback ports, and prints: added latency p50/p99 for
sequential requests (after one warm-up request per key, whose latency is shown apart: the
gateway's per-key cache entry and budget lease then exist, as under steady traffic),
requests/s and p99 at 64 concurrent clients, and added time to first token for streams.
"""

import asyncio
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "acs_portal.settings")

from tests.servers import (  # noqa: E402 (needs ROOT on the path)
    free_port,
    loopback_production_env,
    stop,
    wait_ready,
)

CLIENTS = 64
SEQUENTIAL = int(os.environ.get("BENCH_SEQUENTIAL", 400))
CONCURRENT_SECONDS = float(os.environ.get("BENCH_CONCURRENT_SECONDS", 8))
STREAMS = int(os.environ.get("BENCH_STREAMS", 150))
BODY = {"model": "bench-stub", "prompt": "the capital of france is", "max_tokens": 8}
STREAM_BODY = {**BODY, "stream": True}

STUB_MAIN = """
import sys, uvicorn
sys.path.insert(0, {root!r})
from tests.gateway.stub import StubUpstream
uvicorn.run(StubUpstream(), host="127.0.0.1", port={port}, log_level="warning",
            lifespan="off", access_log=False)
"""


def setup_rows(stub_url: str) -> list[str]:
    """Migrate, then (re)create the bench model and 64 users with one key each."""
    import django

    django.setup()
    from django.core.management import call_command

    from accounts.models import User, UserStatus
    from accounts.services import api_key_create
    from api.models import LanguageModel

    call_command("migrate", verbosity=0)
    User.objects.filter(email__startswith="bench-").delete()
    LanguageModel.objects.filter(name="bench-stub").delete()
    LanguageModel.objects.create(
        name="bench-stub",
        upstream_urls=[stub_url],
        max_model_len=8192,
        n_layers=4,
        hidden_size=8,
        vocab_size=1000,
    )
    secrets = []
    for index in range(CLIENTS):
        user = User.objects.create_user(
            f"bench-{index}@example.org",
            "bench-password-0123",
            status=UserStatus.APPROVED,
            monthly_token_budget=10**12,
        )
        _, secret = api_key_create(
            user=user,
            name="bench",
            acting_user=None,
            monthly_token_budget=10**11,
            daily_token_budget=10**11,
        )
        secrets.append(secret)
    return secrets


def percentile(values, fraction):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def sequential(url, secrets, count, body):
    """Per-request latencies (ms), one request at a time over a kept-alive connection:
    `(first, steady)`. The first request of each key (warm-up: the gateway authenticates
    the key in the database and takes its budget lease) is reported apart from `count`
    steady-state requests over the same keys."""
    first, steady = [], []
    with httpx.Client(base_url=url, timeout=30) as http:
        for index in range(len(secrets) + count):
            headers = {"Authorization": f"Bearer {secrets[index % len(secrets)]}"}
            started = time.perf_counter()
            response = http.post("/v1/completions", json=body, headers=headers)
            elapsed = (time.perf_counter() - started) * 1000
            assert response.status_code == 200, response.text
            (first if index < len(secrets) else steady).append(elapsed)
    return first, steady


def time_to_first_token(url, secrets, count):
    ttfts = []
    with httpx.Client(base_url=url, timeout=30) as http:
        for index in range(count + 10):
            headers = {"Authorization": f"Bearer {secrets[index % len(secrets)]}"}
            started = time.perf_counter()
            with http.stream("POST", "/v1/completions", json=STREAM_BODY, headers=headers) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                for line in lines:
                    if line.startswith("data:"):
                        elapsed = (time.perf_counter() - started) * 1000
                        break
                for _ in lines:
                    pass
            if index >= 10:
                ttfts.append(elapsed)
    return ttfts


async def concurrent(url, secrets, seconds):
    """requests/s and latencies with CLIENTS clients looping for `seconds`."""
    latencies, errors = [], 0
    limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as http:
        stop_at = time.perf_counter() + seconds

        async def client(index):
            nonlocal errors
            headers = {"Authorization": f"Bearer {secrets[index]}"}
            while time.perf_counter() < stop_at:
                started = time.perf_counter()
                try:
                    response = await http.post("/v1/completions", json=BODY, headers=headers)
                except httpx.TransportError:
                    # A kept-alive connection the server closed as it was reused: an error,
                    # not a reason to lose the run.
                    errors += 1
                    continue
                latencies.append((time.perf_counter() - started) * 1000)
                errors += response.status_code != 200

        started = time.perf_counter()
        await asyncio.gather(*(client(i) for i in range(CLIENTS)))
        elapsed = time.perf_counter() - started
    return len(latencies) / elapsed, latencies, errors


def main():
    logging.getLogger("httpx").setLevel(logging.WARNING)
    stub_port, gateway_port = free_port(), free_port()
    stub_url = f"http://127.0.0.1:{stub_port}"
    gateway_url = f"http://127.0.0.1:{gateway_port}"
    processes = []
    try:
        processes.append(
            subprocess.Popen(
                [sys.executable, "-c", STUB_MAIN.format(root=str(ROOT), port=stub_port)]
            )
        )
        wait_ready(f"{stub_url}/health", processes[-1], "the stub upstream")
        if os.environ.get("DATABASE_URL", "").startswith("postgres"):
            subprocess.run([str(ROOT / "scripts" / "ensure-test-db")], check=True)
        # The production settings, here and in the gateway: they share the API-key secret.
        os.environ.update(loopback_production_env())
        secrets = setup_rows(stub_url)
        env = {**os.environ, "LOG_LEVEL": "WARNING"}
        processes.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "uvicorn",
                    "acs_portal.asgi:application",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(gateway_port),
                    "--log-level",
                    "warning",
                    "--no-access-log",
                    "--lifespan",
                    "off",
                ],
                cwd=ROOT,
                env=env,
            )
        )
        wait_ready(f"{gateway_url}/v1/openapi.json", processes[-1], "the gateway")
        run(stub_url, gateway_url, secrets, processes[-1].pid)
    finally:
        for process in processes:
            stop(process)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(stub_url, gateway_url, secrets, gateway_pid):
    direct_first, direct_seq = sequential(stub_url, secrets, SEQUENTIAL, BODY)
    cpu_before = cpu_seconds(gateway_pid)
    gateway_first, gateway_seq = sequential(gateway_url, secrets, SEQUENTIAL, BODY)
    gateway_cpu_ms = (cpu_seconds(gateway_pid) - cpu_before) * 1000 / (SEQUENTIAL + CLIENTS)
    direct_ttft = time_to_first_token(stub_url, secrets, STREAMS)
    gateway_ttft = time_to_first_token(gateway_url, secrets, STREAMS)
    direct_rps, direct_lat, direct_errors = asyncio.run(
        concurrent(stub_url, secrets, CONCURRENT_SECONDS)
    )
    gateway_rps, gateway_lat, gateway_errors = asyncio.run(
        concurrent(gateway_url, secrets, CONCURRENT_SECONDS)
    )

    def row(name, direct, gateway, unit, added=True):
        extra = f"{gateway - direct:+9.2f}" if added else " " * 9
        ratio = gateway / direct if direct else float("nan")
        print(f"{name:<38} {direct:>9.2f} {gateway:>9.2f} {extra} {ratio:>7.2f}x  {unit}")

    print(
        f"\nGateway benchmark ({SEQUENTIAL} sequential, {STREAMS} streams, {CLIENTS} clients "
        f"for {CONCURRENT_SECONDS:.0f} s; cpus={os.cpu_count()})"
    )
    print(f"{'measure':<38} {'direct':>9} {'gateway':>9} {'added':>9} {'ratio':>8}")
    row(
        "sequential latency p50",
        statistics.median(direct_seq),
        statistics.median(gateway_seq),
        "ms",
    )
    row("sequential latency p99", percentile(direct_seq, 0.99), percentile(gateway_seq, 0.99), "ms")
    row(
        "first request of a key p50",
        statistics.median(direct_first),
        statistics.median(gateway_first),
        "ms",
    )
    row(
        "stream time to first token p50",
        statistics.median(direct_ttft),
        statistics.median(gateway_ttft),
        "ms",
    )
    row("64 clients requests/s", direct_rps, gateway_rps, "req/s", added=False)
    row(
        "64 clients latency p50",
        statistics.median(direct_lat),
        statistics.median(gateway_lat),
        "ms",
    )
    row("64 clients latency p99", percentile(direct_lat, 0.99), percentile(gateway_lat, 0.99), "ms")
    print(f"gateway process CPU per sequential request: {gateway_cpu_ms:.2f} ms")
    print(f"errors under load: direct {direct_errors}, gateway {gateway_errors}")


if __name__ == "__main__":
    main()
