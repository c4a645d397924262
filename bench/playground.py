"""Playground latency: submit → first token in the browser against the API's own time to
first token of the same request, through the whole system (engine, uvicorn, Celery worker,
Debian's Chromium).

    DATABASE_URL=postgres://... REDIS_URL=redis://.../N .venv/bin/python bench/playground.py

It runs tests/browser/test_latency.py (which starts and stops everything on free loopback
ports, on the pytest-django test database) and prints its measurement line.
"""

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    result = subprocess.run(
        [
            str(REPO_ROOT / ".venv" / "bin" / "pytest"),
            "tests/browser/test_latency.py",
            "-q",
            "-s",
            "-p",
            "no:cacheprovider",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("playground:")]
    print("\n".join(lines) or result.stdout[-3000:] + result.stderr[-3000:])
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
