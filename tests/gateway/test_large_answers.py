"""Full-vocabulary answers (prompt_logprobs -1, up to ~1 GB) are relayed as they arrive, in a
small multiple of a chunk's memory, and at most FULL_VOCAB_IN_FLIGHT of them at once per
process (issue 43 item 1). The stub's `large` mode sends such an answer in 64 KiB chunks as
it generates it."""

import json
import random
import threading
import time
import tracemalloc
import types
import zlib

import httpx
import pytest

from api import completions, dialect
from api.models import LanguageModel
from api.relay import PublicBody
from api.selectors import registry_clear
from metering.models import UsageRecord
from testsupport.stub import large_body, large_mode

from .conftest import gateway_client, key_day_window, wait_settled

pytestmark = pytest.mark.django_db(transaction=True)

# 40 prompt tokens (the stub counts words): 39 positions of full-vocabulary entries.
PROMPT = " ".join(["tok"] * 40)
PROMPT_TOKENS = 40
CHUNK = 64 * 1024
VLLM_EXTRAS = {
    "system_fingerprint": "fp_1",
    "kv_transfer_params": {"remote": [1, '}]"x']},
    "metrics": {"queue_time_ms": 1.5},
    "routed_experts": "QUJD",
    "prompt_tokens_details": {"cached_tokens": 3},
}


def full_vocab(**fields) -> dict:
    return {
        "model": "stub-model",
        "prompt": PROMPT,
        "max_tokens": 2,
        "prompt_logprobs": -1,
        **fields,
    }


def wait_until(condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.005)


def relays_ended() -> bool:
    return completions.full_vocab_counts() == {"running": 0, "waiting": 0}


@pytest.fixture
def renamed(model):
    """The model served upstream under another name, which the answer must not show."""
    LanguageModel.objects.filter(name="stub-model").update(served_model_name="upstream-name")
    registry_clear()


def _valid(return_token_ids: bool):
    request = types.SimpleNamespace(
        prompt_logprobs=-1, return_token_ids=return_token_ids, logprobs=None
    )
    return types.SimpleNamespace(request=request, capture_layers=None, special_tokens=frozenset())


@pytest.mark.parametrize("shape", ["vllm", "engine"])
@pytest.mark.parametrize("return_token_ids", [False, True])
@pytest.mark.parametrize("extras", [{}, VLLM_EXTRAS])
def test_public_body_is_public_answer_whatever_the_chunk_boundaries(
    shape, return_token_ids, extras
):
    """The byte filter against `dialect.public_answer` of the parsed answer, fed in pieces of
    1 byte to 100 KB so that every pattern is cut somewhere; the vocabulary's decoded tokens
    hold the patterns' bytes (escaped, as in a real answer)."""
    large = large_mode(vocab=37, shape=shape, extras=extras)
    header = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "up"}
    usage = {"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11}
    raw = b"".join(
        large_body(large, header, [3, 4], 2, 1, usage, {"return_token_ids": return_token_ids})
    )
    expected = json.loads(raw)
    dialect.public_answer(expected, _valid(return_token_ids))
    expected["model"] = "registry-name"
    chunking = random.Random(43)
    for _ in range(20):
        public = PublicBody(model_name="registry-name", keep_token_ids=return_token_ids)
        pieces, at = [], 0
        while at < len(raw):
            step = chunking.choice([1, 2, 3, 7, 64, 1000, 100_000])
            pieces.append(public.feed(raw[at : at + step]))
            at += step
        pieces.append(public.end())
        assert json.loads(b"".join(pieces)) == expected
        assert public.usage() == json.loads(raw)["usage"]


@pytest.mark.parametrize("shape", ["vllm", "engine"])
@pytest.mark.parametrize("encoding", ["gzip", "identity"])
def test_relayed_answer_is_the_parse_paths(client, stub, renamed, monkeypatch, shape, encoding):
    stub.mode["large"] = large_mode(vocab=300, shape=shape, extras=VLLM_EXTRAS)
    headers = {"Accept-Encoding": encoding}
    for body in (full_vocab(), full_vocab(return_token_ids=True, n=2, temperature=1.0)):
        relayed = client.post("/v1/completions", json=body, headers=headers)
        assert relayed.status_code == 200, relayed.text
        assert "Content-Length" not in relayed.headers  # sent as it arrived
        assert relayed.headers.get("Content-Encoding", "identity") == encoding
        assert relayed.headers["Vary"] == "Accept-Encoding"
        monkeypatch.setattr(completions, "RELAY_LARGE_ANSWERS", False)
        parsed = client.post("/v1/completions", json=body, headers=headers)
        monkeypatch.setattr(completions, "RELAY_LARGE_ANSWERS", True)
        assert parsed.status_code == 200 and "Content-Length" in parsed.headers
        answer = relayed.json()
        assert answer == parsed.json()
        assert answer["model"] == "stub-model"
        assert len(answer["choices"][0]["prompt_logprobs"][1]) == 300


def test_relay_memory_is_a_few_chunks_not_the_body(client, stub):
    """tracemalloc's peak over the whole test process while a 61 MiB answer goes through it
    gzipped: the stub, the gateway and the client all run here. In chunks of 64 KiB:
    aiohttp reads ahead of the gateway until its buffer passes 128 KiB, by socket reads of
    up to 256 KiB (about 12 chunks held, measured); the gateway's filter holds its input and
    output (2), gzip its state (256 KiB: 4) and output, uvicorn's write buffer up to 64 KiB
    (2); the stub its chunk being assembled and its write buffer (4); the client h11's buffer
    and the inflated chunk (3): about 28. The bound, 64 chunks (4 MiB), is 1/15 of the body;
    the parse path held the body, its parsed form and its gzip (over 200 MB)."""
    stub.mode["large"] = large_mode(vocab=20_000, chunk=CHUNK)
    client.post("/v1/completions", json={"model": "stub-model", "prompt": "hello"})  # warm caches
    inflater = zlib.decompressobj(wbits=31)
    received, tail = 0, b""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        with client.stream("POST", "/v1/completions", json=full_vocab()) as response:
            assert response.status_code == 200
            assert response.headers["Content-Encoding"] == "gzip"
            for raw in response.iter_raw():
                data = inflater.decompress(raw, CHUNK)
                while True:
                    received += len(data)
                    tail = (tail + data)[-4096:]
                    if not inflater.unconsumed_tail:
                        break
                    data = inflater.decompress(inflater.unconsumed_tail, CHUNK)
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    assert received > 12 * 64 * CHUNK  # the body: 39 positions x 20,000 entries, 61 MiB
    assert peak < 64 * CHUNK, f"peak {peak / 2**20:.1f} MiB relaying {received / 2**20:.0f} MiB"
    assert tail.endswith(b'"usage":{"prompt_tokens":40,"completion_tokens":2,"total_tokens":42}}')


def test_usage_is_read_from_the_tail_and_billed_once(client, stub, api_key):
    stub.mode["large"] = large_mode(vocab=5_000, completion_tokens=1, extras=VLLM_EXTRAS)
    response = client.post("/v1/completions", json=full_vocab(max_tokens=3))
    assert response.status_code == 200
    assert "Content-Length" not in response.headers
    assert response.json()["usage"] == {
        "prompt_tokens": PROMPT_TOKENS,
        "completion_tokens": 1,
        "total_tokens": PROMPT_TOKENS + 1,
    }
    wait_settled()
    record = UsageRecord.objects.get()
    assert (record.status_code, record.prompt_tokens, record.completion_tokens) == (200, 40, 1)
    window = key_day_window(api_key)
    assert (window.used_input, window.used_output, window.reserved_tokens) == (40, 1, 0)


def test_answer_without_usage_bills_the_holds_worst_case(client, stub, api_key, caplog):
    stub.mode["large"] = large_mode(vocab=500, usage=False)
    response = client.post("/v1/completions", json=full_vocab(max_tokens=3))
    assert response.status_code == 200 and "usage" not in response.json()
    wait_settled()
    record = UsageRecord.objects.get()
    assert (record.status_code, record.prompt_tokens, record.completion_tokens) == (200, 40, 3)
    window = key_day_window(api_key)
    assert (window.used_input, window.used_output, window.reserved_tokens) == (40, 3, 0)
    assert "ended without usage" in caplog.text


def test_client_gone_mid_body_is_billed_its_prompt_once(
    gateway_url, api_secret, stub, model, api_key
):
    pause = threading.Event()
    stub.mode["large"] = large_mode(vocab=5_000, pause=pause)
    try:
        with httpx.Client(base_url=gateway_url, timeout=30) as http:
            headers = {"Authorization": f"Bearer {api_secret}"}
            with http.stream("POST", "/v1/completions", json=full_vocab(), headers=headers) as r:
                assert r.status_code == 200
                assert next(r.iter_raw())  # the first chunk came; the rest is held
            # Leaving the block closed the connection mid-body.
        wait_until(relays_ended, "the relay ended")
        wait_settled()
    finally:
        pause.set()
    record = UsageRecord.objects.get()
    assert (record.status_code, record.error_code) == (499, "client_disconnected")
    assert (record.prompt_tokens, record.completion_tokens) == (PROMPT_TOKENS, 0)
    window = key_day_window(api_key)
    assert (window.used_input, window.used_output, window.reserved_tokens) == (40, 0, 0)


def test_upstream_breaking_off_mid_body_breaks_the_response(gateway_url, api_secret, stub, model):
    stub.mode["large"] = large_mode(vocab=5_000, break_after=3)
    with httpx.Client(base_url=gateway_url, timeout=30) as http:
        headers = {"Authorization": f"Bearer {api_secret}"}
        with pytest.raises(httpx.RemoteProtocolError):
            http.post("/v1/completions", json=full_vocab(), headers=headers)
    wait_until(relays_ended, "the relay ended")
    wait_settled()
    record = UsageRecord.objects.get()
    assert (record.status_code, record.error_code) == (502, "vllm_engine_dead")
    assert (record.prompt_tokens, record.completion_tokens) == (PROMPT_TOKENS, 0)


def _post_in_thread(gateway_url, secret, body, results, index):
    def post():
        with gateway_client(gateway_url, secret, timeout=60) as http:
            response = http.post("/v1/completions", json=body)
            results[index] = (response.status_code, response.headers, response.content)

    thread = threading.Thread(target=post)
    thread.start()
    return thread


def test_third_full_vocab_request_waits_for_a_slot(gateway_url, api_secret, stub, model):
    stub.mode["large"] = large_mode(vocab=200)
    stub.mode["gate"] = threading.Event()
    results = [None] * 3
    threads = [_post_in_thread(gateway_url, api_secret, full_vocab(), results, i) for i in range(2)]
    try:
        wait_until(lambda: stub.in_flight == 2, "two requests reached the upstream")
        threads.append(_post_in_thread(gateway_url, api_secret, full_vocab(), results, 2))
        wait_until(lambda: completions.full_vocab_counts()["waiting"] == 1, "the third waits")
        assert len(stub.requests) == 2
    finally:
        stub.mode["gate"].set()
        for thread in threads:
            thread.join()
    assert [result[0] for result in results] == [200, 200, 200]
    assert stub.max_in_flight == completions.FULL_VOCAB_IN_FLIGHT == 2
    assert len(json.loads(results[2][2])["choices"][0]["prompt_logprobs"]) == PROMPT_TOKENS


def test_full_vocab_request_past_the_wait_bound_is_queue_full(
    gateway_url, api_secret, stub, model, monkeypatch
):
    monkeypatch.setattr(completions, "FULL_VOCAB_WAIT_S", 0.2)
    stub.mode["large"] = large_mode(vocab=200)
    stub.mode["gate"] = threading.Event()
    results = [None] * 2
    threads = [_post_in_thread(gateway_url, api_secret, full_vocab(), results, i) for i in range(2)]
    try:
        wait_until(lambda: stub.in_flight == 2, "two requests reached the upstream")
        with gateway_client(gateway_url, api_secret) as http:
            refused = http.post("/v1/completions", json=full_vocab())
    finally:
        stub.mode["gate"].set()
        for thread in threads:
            thread.join()
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "queue_full"
    assert refused.headers["Retry-After"] == str(completions.FULL_VOCAB_RETRY_AFTER_S)
    assert len(stub.requests) == 2
    assert [result[0] for result in results] == [200, 200]


def test_other_accounts_request_is_answered_while_a_large_answer_is_relayed(
    gateway_url, api_secret, stub, model, other_user
):
    from accounts.services.keys import api_key_create

    _, other_secret = api_key_create(user=other_user, name="theirs", acting_user=None)
    pause = threading.Event()
    stub.mode["large"] = large_mode(vocab=5_000, pause=pause)
    first_bytes, received = threading.Event(), []

    def large():
        with httpx.Client(base_url=gateway_url, timeout=60) as http:
            headers = {"Authorization": f"Bearer {api_secret}", "Accept-Encoding": "gzip"}
            with http.stream("POST", "/v1/completions", json=full_vocab(), headers=headers) as r:
                for chunk in r.iter_raw():
                    received.append(chunk)
                    first_bytes.set()

    thread = threading.Thread(target=large)
    thread.start()
    try:
        assert first_bytes.wait(30), "the large answer's first bytes never came"
        with gateway_client(gateway_url, other_secret) as http:
            small = http.post("/v1/completions", json={"model": "stub-model", "prompt": "hello"})
        assert small.status_code == 200 and small.json()["choices"][0]["text"] == " tok" * 16
        assert thread.is_alive()  # the large answer is still being relayed
    finally:
        pause.set()
        thread.join()
    answer = json.loads(zlib.decompress(b"".join(received), wbits=31))
    assert len(answer["choices"][0]["prompt_logprobs"]) == PROMPT_TOKENS
