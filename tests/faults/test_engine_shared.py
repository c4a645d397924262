"""One key's maximal allowed request (300 prompts × n=16 × max_tokens 1: 4,800 sequences,
within the 32,000 output-work cap) runs on the engine while another account's key sends small
requests: the engine serves the accounts in turn, so they are answered beside it, neither
refused nor held behind it (issue 20: for the 66 s such a request ran, every other user's
request got 503 wrapper_saturated)."""

import statistics
import threading
import time

import httpx

from metering.models import UsageRecord

from .conftest import ENGINE_MODEL, make_account, wait_for

BIG_PROMPTS, BIG_N = 300, 16
SAMPLES = 7
SMALL_TOKENS = 4


def _client(system, account, timeout: float = 60) -> httpx.Client:
    return httpx.Client(
        base_url=system.web_url,
        headers={"Authorization": f"Bearer {account.secret}"},
        timeout=timeout,
    )


def test_one_keys_maximal_request_leaves_the_engine_to_other_accounts(
    system, engine_ready, fault_table
):
    big_account, other_account, baseline_account = make_account(), make_account(), make_account()
    small_body = {
        "model": ENGINE_MODEL,
        "prompt": "The capital of France is",
        "max_tokens": SMALL_TOKENS,
        "temperature": 0,
    }
    alone = _median_wait(system, baseline_account, small_body, samples=3)
    big_body = {
        "model": ENGINE_MODEL,
        "prompt": [f"Item {i} of the list is" for i in range(BIG_PROMPTS)],
        "n": BIG_N,
        "max_tokens": 1,
    }
    big = {}

    def send_big():
        started = time.monotonic()
        with _client(system, big_account, timeout=900) as http:
            big["response"] = http.post("/v1/completions", json=big_body)
        big["seconds"] = time.monotonic() - started

    thread = threading.Thread(target=send_big)
    thread.start()
    with httpx.Client(base_url=system.engine_url, timeout=10) as engine:
        wait_for(
            lambda: engine.get("/health").json().get("waiting_sequences", 0) > 1000,
            timeout=120,
            what="the big request to queue in the engine",
        )

    waits, answers = [], []
    with _client(system, other_account) as http:
        for _ in range(SAMPLES):
            started = time.monotonic()
            response = http.post("/v1/completions", json=small_body)
            waits.append(time.monotonic() - started)
            answers.append(response)
            assert thread.is_alive(), f"the big request ended after {len(waits)} samples"
    thread.join(timeout=900)

    seen = [r.status_code if r.is_success else r.json()["error"]["code"] for r in answers]
    assert seen == [200] * SAMPLES, seen
    assert big["response"].status_code == 200, big["response"].text[:500]
    big_usage = big["response"].json()["usage"]
    assert len(big["response"].json()["choices"]) == BIG_PROMPTS * BIG_N
    assert big_usage["completion_tokens"] == BIG_PROMPTS * BIG_N
    p50 = statistics.median(waits)

    # Metered exactly once, as the bodies say.
    produced_small = sum(r.json()["usage"]["total_tokens"] for r in answers)
    metered_big = wait_for(
        lambda: big_account.used_tokens() or None, timeout=15, what="the big request's spend"
    )
    wait_for(
        lambda: other_account.used_tokens() == produced_small,
        timeout=15,
        what="the small requests' spend",
    )
    assert metered_big == big_usage["total_tokens"]
    assert UsageRecord.objects.filter(key=big_account.key).count() == 1
    assert UsageRecord.objects.filter(key=other_account.key).count() == SAMPLES

    fault_table.add(
        fault=f"one key's maximal request on the engine ({BIG_PROMPTS} prompts × n={BIG_N} ×"
        f" max_tokens 1 = {BIG_PROMPTS * BIG_N:,} sequences)",
        client_saw=f"another account's {SAMPLES} small requests ({SMALL_TOKENS} tokens), sent"
        f" one after another while it ran: all 200, wait p50 {p50:.2f} s (max"
        f" {max(waits):.2f} s); the big request 200 after {big['seconds']:.0f} s",
        metered=f"{metered_big:,} for the big request (1 record); {produced_small} for the"
        f" small ones ({SAMPLES} records)",
        produced=f"{big_usage['total_tokens']:,} and {produced_small} in the bodies",
        recovery="none needed: nothing was refused",
    )
    print(f"another account's waits beside the maximal request: {waits} (alone: {alone:.2f} s)")
    # Held behind the big request, a small one would wait its whole run (tens of seconds).
    # Served in turn, it waits a few engine steps more than alone: 2 s on a quiet machine, and
    # proportionally more on a starved one (2.8 s beside three other suites on two cores).
    assert p50 <= max(2.0, 4 * alone), (waits, alone)


def _median_wait(system, account, body: dict, *, samples: int) -> float:
    """The median time `account` waits for `body` with nothing else running."""
    waits = []
    with _client(system, account) as http:
        for _ in range(samples):
            started = time.monotonic()
            assert http.post("/v1/completions", json=body).status_code == 200
            waits.append(time.monotonic() - started)
    return statistics.median(waits)
