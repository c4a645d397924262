"""Runs one of the browser tests that measure the whole system and prints its figures: the
benchmarks that need a real browser are those tests, so CI checks what they measure."""

import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def run_browser_test(test_file: str, line_prefix: str) -> int:
    """Run `test_file` with pytest and print its output lines that start with `line_prefix`
    (all of its output's end when none does); returns pytest's exit code."""
    result = subprocess.run(
        [
            str(REPO_ROOT / ".venv" / "bin" / "pytest"),
            test_file,
            "-q",
            "-s",
            "-p",
            "no:cacheprovider",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith(line_prefix)]
    print("\n".join(lines) or result.stdout[-3000:] + result.stderr[-3000:])
    return result.returncode
