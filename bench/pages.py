"""Every page's first load in a fresh browser (no cache), against the goal of < 1 s: the
whole system with the production settings (engine, uvicorn, Celery worker, Debian's
Chromium), on loopback.

    DATABASE_URL=postgres://... REDIS_URL=redis://.../N .venv/bin/python bench/pages.py

It runs tests/browser/test_pages.py (which starts and stops everything on free loopback
ports, on the pytest-django test database) and prints its table: per page, the HTML's
response time, the load event and the bytes transferred.
"""

import sys

from browser_test import run_browser_test

if __name__ == "__main__":
    sys.exit(run_browser_test("tests/browser/test_pages.py", "pages:"))
