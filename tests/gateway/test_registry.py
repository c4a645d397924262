"""The model registry each process caches: requests that find it stale share one read."""

import asyncio
import time

import pytest

from api import selectors


@pytest.fixture
def counted_reads(model, monkeypatch):
    """The registry's reads from the database, each made slow enough that requests pile up
    behind it; the registry starts stale."""
    reads = []
    read = selectors._load_registry

    def slow_read():
        reads.append(time.monotonic())
        time.sleep(0.1)
        read()

    monkeypatch.setattr(selectors, "_load_registry", slow_read)
    selectors.registry_clear()
    return reads


async def test_requests_that_find_the_registry_stale_share_one_read(counted_reads, model):
    models = await asyncio.gather(*(selectors.model_get(model) for _ in range(32)))
    assert len(counted_reads) == 1
    assert {found.name for found in models} == {model}


async def test_a_request_cancelled_while_it_waits_leaves_the_read_to_the_others(
    counted_reads, model
):
    leaving = asyncio.ensure_future(selectors.model_get(model))
    staying = asyncio.ensure_future(selectors.model_get(model))
    await asyncio.sleep(0.02)
    leaving.cancel()
    assert (await staying).name == model
    assert len(counted_reads) == 1


async def test_a_failed_read_fails_its_waiters_and_the_next_request_reads_again(
    counted_reads, model, monkeypatch
):
    read = selectors._load_registry

    def failing_once():
        monkeypatch.setattr(selectors, "_load_registry", read)
        raise ConnectionError("the database went away")

    monkeypatch.setattr(selectors, "_load_registry", failing_once)
    outcomes = await asyncio.gather(
        *(selectors.model_get(model) for _ in range(3)), return_exceptions=True
    )
    assert all(isinstance(outcome, ConnectionError) for outcome in outcomes)
    assert (await selectors.model_get(model)).name == model
    assert len(counted_reads) == 1
