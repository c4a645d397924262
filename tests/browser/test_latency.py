"""Submit → first token in the browser, against the API's own time to first token."""

import statistics
import time

import httpx
import pytest
from playwright.sync_api import expect

from accounts.models import ApiKey
from accounts.services.playground_key import playground_key_secret
from playground.models import Run

from .conftest import BROWSER_USER
from .test_playground import run_panel_after

pytestmark = pytest.mark.django_db

SAMPLES = 9
# The goal (issue 5) is what bench/playground.py reports against, on a quiet machine. The
# assertion leaves room for CI's loaded 2-core machine, where one run of this test measured
# a 155 ms median (samples 86-224 ms) with nothing changed; a regression that adds a
# round trip or a poll interval still fails it.
GOAL_MS = 150
BOUND_MS = 250
REQUEST = {
    "model": "smollm2-135m",
    "prompt": "Write one word:",
    "max_tokens": 4,
    "temperature": 0,
    "stream": True,
}


def client_ttft_ms(base_url: str, secret: str) -> float:
    """Milliseconds from sending the request to the first generated text, as a client of
    /v1 sees it."""
    started = time.perf_counter()
    with httpx.stream(
        "POST",
        f"{base_url}/v1/completions",
        json=REQUEST,
        headers={"Authorization": f"Bearer {secret}"},
        timeout=60,
    ) as response:
        lines = response.iter_lines()
        for line in lines:
            compact = line.replace(" ", "")
            if compact.startswith("data:") and '"text":"' in compact and '"text":""' not in compact:
                elapsed = (time.perf_counter() - started) * 1000
                for _ in lines:  # let the run finish before the next sample
                    pass
                return elapsed
    raise AssertionError("the stream carried no text")


def playground_sample(page) -> tuple[float, float]:
    """(submit → first token in the browser, the API's TTFT of that run's request as the
    worker, a client of /v1 like any other, saw it)."""
    panel = run_panel_after(page, lambda: page.click("#completion-form button[type=submit]"))
    run_id = panel.get_attribute("data-run-id")
    expect(panel).to_have_attribute("data-run-status", "succeeded", timeout=60_000)
    timing = page.evaluate("id => window.playgroundTimings[id]", run_id)
    return timing["firstToken"] - timing["submitted"], Run.objects.get(pk=run_id).api_ttft_ms


def test_playground_adds_little_to_the_apis_time_to_first_token(page, system):
    page.goto("/playground/")
    page.fill("#id_prompt", REQUEST["prompt"])
    page.fill("#id_max_tokens", str(REQUEST["max_tokens"]))
    page.fill("#id_temperature", "0")
    page.locator("#id_stream").set_checked(True)
    # Read, not get_or_create: a row lock taken in this test's transaction would hold up
    # the gateway until the test ends. Visiting the page has created the key.
    secret = playground_key_secret(ApiKey.objects.get(user__email=BROWSER_USER, is_playground=True))
    for _ in range(2):  # warm both paths (connections, worker threads)
        client_ttft_ms(system.web_url, secret)
        playground_sample(page)
    client, browser, added = [], [], []
    for _ in range(SAMPLES):
        client.append(client_ttft_ms(system.web_url, secret))
        browser_ms, api_ttft_ms = playground_sample(page)
        browser.append(browser_ms)
        added.append(browser_ms - api_ttft_ms)
    # The added latency is measured per run against the same request's TTFT, so the model's
    # own variance (large on a busy CPU) cancels out.
    print(
        f"\nplayground: submit → first token in the browser minus the API's TTFT of the same "
        f"request: median {statistics.median(added):.0f} ms "
        f"(samples {', '.join(f'{v:.0f}' for v in added)}); browser TTFT median "
        f"{statistics.median(browser):.0f} ms; a direct /v1 client's TTFT median "
        f"{statistics.median(client):.0f} ms (goal: median added <= {GOAL_MS} ms)"
    )
    assert statistics.median(added) <= BOUND_MS
