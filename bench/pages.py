"""Every page's first load in a fresh browser (no cache), against the goal of < 1 s: the
whole system with the production settings (engine, uvicorn, Celery worker, Debian's
Chromium), on loopback.

    DATABASE_URL=postgres://... REDIS_URL=redis://.../N .venv/bin/python bench/pages.py

It runs tests/browser/test_pages.py (which starts and stops everything on free loopback
ports, on the pytest-django test database) and prints its table: per page, the HTML's
response time, the load event and the bytes transferred.
"""

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    result = subprocess.run(
        [
            str(REPO_ROOT / ".venv" / "bin" / "pytest"),
            "tests/browser/test_pages.py",
            "-q",
            "-s",
            "-p",
            "no:cacheprovider",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("pages:")]
    print("\n".join(lines) or result.stdout[-3000:] + result.stderr[-3000:])
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
