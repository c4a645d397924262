"""The engine shares its capacity between tenants (X-Acs-Tenant, the gateway's account): a
tenant's request of thousands of sequences, or its long generations, neither refuse nor hold
back another tenant's small request, and a tenant's waiting limit is its own.

The scheduler tests count model steps, not seconds, so they hold on a loaded machine; the fault
suite (tests/faults/test_engine_shared.py) measures the wait in seconds through the gateway."""

import asyncio
import threading
import time

import pytest
import torch
from conftest import MODEL

from acs_client.protocol import in_vllm_xargs
from engine.preparation import prepare_completion
from engine.protocol import CompletionRequest, parse_model
from engine.scheduler import EngineRequest, Overloaded, Scheduler

HUGE = {"prompt": [f"Item {i} of the list is" for i in range(80)], "n": 16, "max_tokens": 2}
SMALL = {"prompt": "The capital of France is", "max_tokens": 2}


@pytest.fixture
def scheduler(reference):
    """A scheduler with the engine's default limits (64 running, 256 waiting per tenant),
    never started: the test runs its steps."""
    return Scheduler(reference, max_active=64, max_waiting=256, threads=torch.get_num_threads())


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()  # never run: the requests' events are not read
    yield loop
    loop.close()


def submit(scheduler, loop, tenant: str, **body) -> EngineRequest:
    parsed = parse_model(CompletionRequest, in_vllm_xargs({"model": MODEL, **body}))
    request = EngineRequest(prepare_completion(parsed, scheduler.loaded), loop, tenant=tenant)
    scheduler.submit(request)
    return request


def steps_until_done(scheduler, request: EngineRequest, limit: int) -> int:
    with torch.inference_mode():
        for step in range(1, limit + 1):
            scheduler.step()
            if request.unfinished == 0:
                return step
    raise AssertionError(f"not done after {limit} steps: {scheduler.stats()}")


def test_a_huge_request_of_one_tenant_neither_refuses_nor_holds_back_another(scheduler, loop):
    huge = submit(scheduler, loop, "a", **HUGE)
    with torch.inference_mode():
        scheduler.step()
    assert scheduler.stats()["waiting_sequences"] > 256
    # a's queue is full for a's next request...
    with pytest.raises(Overloaded):
        submit(scheduler, loop, "a", **SMALL)
    # ...while b's request is taken in and done in the next step: prefilled (first token)
    # beside a's next prompts, then decoded with them (second token).
    small = submit(scheduler, loop, "b", **SMALL)
    assert steps_until_done(scheduler, small, limit=1) == 1
    assert huge.unfinished > 1000


def test_long_generations_of_one_tenant_leave_slots_for_another(scheduler, loop):
    """4 prompts × n=16 would fill all 64 slots for 300 steps; tenant a gets 48 of them and
    the rest are kept for a tenant with nothing running."""
    long = {"prompt": ["One", "Two", "Three", "Four"], "n": 16, "max_tokens": 300}
    submit(scheduler, loop, "a", ignore_eos=True, **long)
    with torch.inference_mode():
        scheduler.step()
    assert scheduler.stats()["active_sequences"] == 48
    assert scheduler.stats()["waiting_sequences"] == 16  # a's fourth prompt
    small = submit(scheduler, loop, "b", **SMALL)
    assert steps_until_done(scheduler, small, limit=1) == 1
    assert scheduler.stats()["active_sequences"] == 48


def test_waiting_tenants_are_admitted_in_turn(scheduler, loop):
    for tenant in "abc":
        submit(scheduler, loop, tenant, **HUGE)
    first_batch = scheduler._take_admissible()
    assert sorted(group.request.tenant for group in first_batch) == ["a", "b", "c"]


def test_the_tenant_header_separates_waiting_limits(engine):
    """Over HTTP: while tenant a's huge request waits, a's next request is refused (503,
    retry later) and b's is served."""
    client = engine.client
    answer = {}
    thread = threading.Thread(
        target=lambda: answer.update(
            response=client.post(
                "/v1/completions",
                json={"model": MODEL, **HUGE},
                headers={"X-Acs-Tenant": "a"},
                timeout=900,
            )
        )
    )
    thread.start()
    deadline = time.monotonic() + 60
    while engine.stats()["waiting_sequences"] <= 256:
        assert time.monotonic() < deadline, "the huge request did not queue"
        time.sleep(0.02)
    small = {"model": MODEL, **SMALL}
    refused = client.post("/v1/completions", json=small, headers={"X-Acs-Tenant": "a"})
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_overloaded"
    assert refused.headers["retry-after"] == "1"
    served = client.post("/v1/completions", json=small, headers={"X-Acs-Tenant": "b"})
    assert served.status_code == 200, served.text
    assert engine.stats()["waiting_sequences"] > 0, "b was served while a's request waited"
    thread.join()
    assert answer["response"].status_code == 200
    assert len(answer["response"].json()["choices"]) == 80 * 16
