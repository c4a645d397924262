"""Playground latency: submit → first token in the browser against the API's own time to
first token of the same request, through the whole system (engine, uvicorn, Celery worker,
Debian's Chromium).

    DATABASE_URL=postgres://... REDIS_URL=redis://.../N .venv/bin/python bench/playground.py

It runs tests/browser/test_latency.py (which starts and stops everything on free loopback
ports, on the pytest-django test database) and prints its measurement line.
"""

import sys

from browser_test import run_browser_test

if __name__ == "__main__":
    sys.exit(run_browser_test("tests/browser/test_latency.py", "playground:"))
