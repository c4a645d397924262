"""The upstream seam as other callers (harvest, jobs) use it, and activation upstreams."""

import asyncio

import pytest
from asgiref.sync import async_to_sync

from api import upstream
from api.errors import ApiError
from api.jobs.capture import capture_prompt
from api.models import LanguageModel
from api.selectors import registry_clear
from api.upstream import send_completion, upstream_tokenize

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_harvest_capture_goes_to_the_upstream_under_the_served_model_name(stub, model):
    row = LanguageModel.objects.get(name=model)
    row.served_model_name = "served"
    capture = async_to_sync(capture_prompt)(row, tokens=[1, 2], layers=[2], index=0, tenant="7")
    assert capture.bits.shape == (1, 2, 8)
    assert stub.requests[-1]["model"] == "served"
    assert stub.requests[-1]["vllm_xargs"] == {"output_residual_stream": [2]}
    assert stub.tenants[-1] == "7"


def test_send_completion_raises_the_contract_error(stub, model):
    stub.mode.update({"status": 500, "error": {"code": "x", "message": "out of memory"}})
    with pytest.raises(ApiError) as raised:
        async_to_sync(send_completion)(
            LanguageModel.objects.get(name=model).upstream_urls,
            {"model": model, "prompt": "hello"},
            tenant="7",
        )
    assert (raised.value.status, raised.value.code) == (502, "vllm_oom")


def test_completions_name_the_keys_account_as_the_upstreams_tenant(client, stub, api_key):
    """The engine shares its capacity per account: every key of a user is one tenant."""
    body = {"model": "stub-model", "prompt": "hello", "max_tokens": 1}
    assert client.post("/v1/completions", json=body).status_code == 200
    assert client.post("/v1/completions", json={**body, "stream": True}).status_code == 200
    assert stub.tenants == [str(api_key.user_id)] * 2


def test_activation_requests_go_to_the_activation_upstreams(client, stub):
    LanguageModel.objects.update(activation_upstream_urls=["http://127.0.0.1:9"])
    registry_clear()
    body = {"model": "stub-model", "prompt": "hello", "max_tokens": 1}
    assert client.post("/v1/completions", json=body).status_code == 200
    captured = client.post("/v1/completions", json={**body, "output_residual_stream": [0]})
    assert captured.status_code == 502
    assert captured.json()["error"]["code"] == "upstream_unreachable"
    assert len(stub.requests) == 1


def test_upstream_tokenize_returns_the_activation_upstreams_token_ids(stub, model):
    LanguageModel.objects.update(activation_upstream_urls=[stub.url])
    row = LanguageModel.objects.get(name=model)
    tokens = async_to_sync(upstream_tokenize)(
        row, prompt="the capital of france", add_special_tokens=True
    )
    assert tokens == [0, 1, 2, 3]
    assert stub.paths[-1] == "/tokenize"


def test_upstream_tokenize_maps_an_unreachable_upstream(stub, model):
    LanguageModel.objects.update(activation_upstream_urls=["http://127.0.0.1:9"])
    row = LanguageModel.objects.get(name=model)
    with pytest.raises(ApiError) as raised:
        async_to_sync(upstream_tokenize)(row, prompt="hello", add_special_tokens=True)
    assert (raised.value.status, raised.value.code) == (502, "upstream_unreachable")


FRAMES = [b'{"n":1}', b'{"n":2}']


async def _upstream_that_dies_after_two_frames(reader, writer):
    """Answers a streaming completion with two SSE frames, then closes the connection without
    the chunked body's end: an upstream process dying mid-stream."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    await reader.readexactly(length)
    body = b"".join(b"data: " + frame + b"\n\n" for frame in FRAMES)
    writer.write(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        + f"{len(body):x}\r\n".encode()
        + body
        + b"\r\n"
    )
    await writer.drain()
    writer.close()


async def test_frames_that_arrive_with_the_upstreams_death_are_all_relayed(redis_client):
    """aiohttp raises a broken connection before giving back what its buffer holds; the seam
    still yields every frame the upstream sent, then vllm_engine_dead."""
    server = await asyncio.start_server(_upstream_that_dies_after_two_frames, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    received = []
    async with server, upstream.open_stream([url], {"prompt": "hello"}, tenant="7") as frames:
        # Both the frames and the connection's end are in before the first read.
        await asyncio.sleep(0.3)
        with pytest.raises(ApiError) as raised:
            async for frame in frames:
                received.append(frame)
    assert received == FRAMES
    assert raised.value.code == "vllm_engine_dead"
