import httpx
import pytest

from acs_client.client import (
    AcsApiError,
    AcsClient,
    AsyncAcsClient,
    parse_server_timing,
    parse_sse_line,
)

from .conftest import recorded

TIMING = "gateway;dur=12.5, upstream;dur=10"
MODEL_CARD = {
    "id": "m",
    "object": "model",
    "default": True,
    "status": "live",
    "capabilities": {
        "max_model_len": 64,
        "max_logprobs": 100,
        "full_vocab_max_prompt_tokens": 256,
        "activations": False,
        "n_layers": 4,
        "hidden_size": 8,
        "vocab_size": 1000,
        "max_steering_vectors": 0,
    },
}


def client_answering(handler, cls=AcsClient):
    return cls(
        base_url="http://gw", api_key="acs-abcdefgh-x", transport=httpx.MockTransport(handler)
    )


def test_server_timing_is_parsed_into_milliseconds_by_name():
    assert parse_server_timing(TIMING) == {"gateway": 12.5, "upstream": 10.0}
    assert parse_server_timing('db;desc="x";dur=3, broken;dur=abc') == {"db": 3.0}
    assert parse_server_timing(None) == {}


def test_completions_returns_body_timing_and_sends_the_key():
    seen = {}

    def handler(request):
        seen["auth"] = request.headers["authorization"]
        return httpx.Response(
            200,
            json=recorded("completion_logprobs.json"),
            headers={"server-timing": TIMING, "x-request-id": "req-1"},
        )

    result = client_answering(handler).completions({"model": "m", "prompt": "x"})
    assert result.body["choices"][0]["text"] == " Paris.\n\nThe answer"
    assert result.server_timing == {"gateway": 12.5, "upstream": 10.0}
    assert result.request_id == "req-1"
    assert seen["auth"] == "Bearer acs-abcdefgh-x"


@pytest.mark.parametrize(
    ("status", "headers", "should_retry", "retry_after"),
    [
        (503, {"retry-after": "2"}, True, 2.0),
        (502, {"retry-after": "1", "x-should-retry": "false"}, False, 1.0),
        (502, {}, False, None),
        (429, {"retry-after": "3600"}, True, 3600.0),
        (400, {"x-should-retry": "false"}, False, None),
    ],
)
def test_error_answer_carries_code_and_retry_hints(status, headers, should_retry, retry_after):
    def handler(request):
        body = {"error": {"code": "some_code", "message": "went wrong", "type": "t"}}
        return httpx.Response(status, json=body, headers=headers)

    with pytest.raises(AcsApiError) as caught:
        client_answering(handler).completions({})
    error = caught.value
    assert (error.status, error.code, error.message) == (status, "some_code", "went wrong")
    assert error.should_retry is should_retry
    assert error.retry_after == retry_after


def test_non_json_error_body_still_gives_a_readable_error():
    with pytest.raises(AcsApiError) as caught:
        client_answering(lambda r: httpx.Response(500, text="<html>oops")).models()
    assert caught.value.code == "http_error"
    assert "HTTP 500" in caught.value.message


def test_unreachable_server_is_a_retryable_connection_error():
    def handler(request):
        raise httpx.ConnectError("refused")

    with pytest.raises(AcsApiError) as caught:
        client_answering(handler).completions({})
    assert caught.value.status is None
    assert caught.value.code == "connection_error"
    assert caught.value.should_retry is True


def test_stream_yields_parsed_frames_until_done():
    def handler(request):
        return httpx.Response(
            200, text=recorded("stream.txt"), headers={"content-type": "text/event-stream"}
        )

    with client_answering(handler).stream_completions({"stream": True}) as stream:
        frames = list(stream)
    assert stream.done
    assert "".join(c["text"] for f in frames for c in f["choices"]) == "\n// create"
    assert frames[-1]["usage"]["completion_tokens"] == 3


def test_error_frame_inside_a_stream_raises_with_its_code():
    body = 'data: {"choices":[{"index":0,"text":"a"}]}\n\n: keepalive\n\n' + (
        'data: {"error":{"code":"vllm_engine_dead","message":"engine died","type":"server"}}\n\n'
    )
    texts = []
    with (
        pytest.raises(AcsApiError) as caught,
        client_answering(lambda r: httpx.Response(200, text=body)).stream_completions({}) as s,
    ):
        for frame in s:
            texts.append(frame["choices"][0]["text"])
    assert texts == ["a"]
    assert (caught.value.status, caught.value.code) == (200, "vllm_engine_dead")


def test_stream_that_is_refused_raises_before_any_frame():
    def handler(request):
        error = {"code": "key_disabled", "message": "paused", "type": "authentication_error"}
        return httpx.Response(401, json={"error": error})

    with pytest.raises(AcsApiError) as caught, client_answering(handler).stream_completions({}):
        pass
    assert caught.value.code == "key_disabled"


def test_sse_lines_other_than_data_are_ignored():
    assert parse_sse_line(": keepalive") is None
    assert parse_sse_line("data: [DONE]") is None
    assert parse_sse_line('data: {"a": 1}') == {"a": 1}


async def test_async_client_completes_and_streams():
    def handler(request):
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [MODEL_CARD]})
        if b'"stream": true' in request.content or b'"stream":true' in request.content:
            return httpx.Response(200, text=recorded("stream.txt"))
        return httpx.Response(200, json=recorded("completion_logprobs.json"))

    client = client_answering(handler, AsyncAcsClient)
    assert [m.id for m in await client.models()] == ["m"]
    result = await client.completions({"prompt": "x"})
    assert result.body["usage"]["completion_tokens"] == 6
    async with client.stream_completions({"stream": True}) as stream:
        frames = [frame async for frame in stream]
    assert stream.done and len(frames) == 4


async def test_async_stream_error_frame_raises():
    body = 'data: {"error":{"code":"upstream_deadline","message":"late","type":"server_error"}}\n\n'
    client = client_answering(lambda r: httpx.Response(200, text=body), AsyncAcsClient)
    with pytest.raises(AcsApiError) as caught:
        async with client.stream_completions({}) as stream:
            async for _ in stream:
                pass
    assert caught.value.code == "upstream_deadline"
