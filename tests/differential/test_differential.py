"""The contract as a space: requests generated over it (hypothesis, seeded) go through the gateway
to vLLM-Lens and to the engine on the same weights, and the public answers must agree.

Valid requests: status 200 on both; the same choices (indices, count), prompt tokens, and
fields; greedy tokens until a near tie told from both sides' top 2, their logprobs, prompt
logprobs, captured rows and, where the whole generation agreed, finish reasons and token
counts, all within the bfloat16 bounds of tests/tolerances.py (twice: each side is within one
bound of the float32 model); sampled requests in their first distribution where logprobs were
asked. Invalid requests (one field made wrong): the same status and error code on both.

`make test` runs ACS_DIFFERENTIAL_EXAMPLES (default 240) valid requests and a quarter as many
invalid ones (300 generated requests, each sent to both upstreams), derandomized; a nightly
run sets it higher (`make test-differential-long`). A difference found becomes a
normalisation in api/dialect.py or a refusal with the contract's code, each in
docs/deploy.md §5's table.
"""

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from acs_client.codec import encode_vector
from api import admission
from tests.vllm.test_text_offsets import assert_offsets_map_into_text
from tests.vllm.test_vllm_lens import (
    assert_same_first_distribution,
    assert_same_generation,
    assert_same_prompt_logprobs,
    assert_same_rows,
    stream_answer,
    streamed_logprobs,
)

pytestmark = pytest.mark.django_db(transaction=True)

# Valid requests generated per run; a quarter as many invalid ones besides.
EXAMPLES = int(os.environ.get("ACS_DIFFERENTIAL_EXAMPLES", "240"))
LAYERS = 30
HIDDEN = 576
PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "def fibonacci(n):",
    "Le château se trouve à",
    "東京は日本の",
    "Emoji: 🙂🎉 and",
    "<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n",
]
TOKEN_PROMPT = [504, 3575, 282, 4649, 314]  # "The capital of France is" as token ids
# Past vLLM's 2,048-token prefill chunk (the engine's is 512): positions counted per chunk.
LONG_PROMPT = "The river runs past the old mill, under the bridge, into the sea. " * 160
# The fewest tokens any of PROMPTS has, and LONG_PROMPT's (SmolLM2's tokenizer): steering
# positions are drawn below the shortest prompt's.
SHORTEST_PROMPT_TOKENS, LONG_PROMPT_TOKENS = 4, 2561
DIRECTION = np.random.default_rng(42).normal(size=HIDDEN).astype(np.float32)
DIRECTION /= np.linalg.norm(DIRECTION)


@pytest.fixture(autouse=True)
def starts_unlimited(monkeypatch):
    """A run starts more requests a minute than a key may: the limit is tested elsewhere."""
    monkeypatch.setattr(admission, "STARTS_PER_MINUTE", 10**6)


@st.composite
def steering_vectors(draw, *, prompt_tokens: int, generating: bool) -> list[dict]:
    layers = draw(st.lists(st.integers(0, LAYERS - 1), min_size=1, max_size=2, unique=True))
    scale = draw(st.sampled_from([1.0, 4.0, 12.0, -6.0]))
    norm_match = draw(st.booleans())
    vector = {"layer_indices": layers, "scale": scale if not norm_match else 0.3}
    rows = DIRECTION[None].repeat(len(layers), 0) * draw(st.sampled_from([1.0, 5.0]))
    if draw(st.booleans()):
        # Positions of the prompt only; position 0 only where one token is generated.
        lowest = 1 if generating else 0
        positions = draw(
            st.lists(
                st.integers(lowest, prompt_tokens - 1), min_size=1, max_size=3, unique=True
            ).map(sorted)
        )
        vector["position_indices"] = positions
        if draw(st.booleans()):
            rows = np.repeat(rows[:, None, :], len(positions), axis=1)
    vector["activations"] = encode_vector(rows.astype(np.float32))
    if norm_match:
        vector["norm_match"] = True
    return [vector]


@st.composite
def valid_requests(draw) -> dict:
    """A request within the contract, small enough for CI (a few generated tokens)."""
    # One request in forty has the long prompt (seconds of prefill on each side).
    if draw(st.integers(0, 39)) == 39:
        prompt = LONG_PROMPT
    else:
        prompt = draw(
            st.one_of(
                st.sampled_from(PROMPTS),
                st.just(TOKEN_PROMPT),
                st.lists(st.sampled_from(PROMPTS), min_size=2, max_size=2),
            )
        )
    prompts = prompt if isinstance(prompt, list) and isinstance(prompt[0], str) else [prompt]
    greedy = draw(st.booleans())
    body = {
        "prompt": prompt,
        "max_tokens": draw(st.integers(1, 4)),
        "temperature": 0 if greedy else draw(st.sampled_from([0.5, 1.0])),
    }
    if not greedy:
        body["n"] = draw(st.integers(1, 2))
        body["seed"] = draw(st.integers(0, 2**40))
    stream = draw(st.booleans())
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    if draw(st.booleans()):
        body["logprobs"] = draw(st.integers(2, 4))
    if not stream and draw(st.integers(0, 3)) == 0:
        body["prompt_logprobs"] = draw(st.integers(0, 2))
    if draw(st.integers(0, 3)) == 0:
        body["echo"] = True
    if draw(st.integers(0, 3)) == 0:
        body["stop"] = draw(st.sampled_from([["\n"], [" the", "."], "e"]))
    if draw(st.integers(0, 3)) == 0:
        body["ignore_eos"] = True
    sequences = len(prompts) * body.get("n", 1)
    if draw(st.integers(0, 2)) == 0:
        shortest = LONG_PROMPT_TOKENS if prompt is LONG_PROMPT else SHORTEST_PROMPT_TOKENS
        body["apply_steering_vectors"] = draw(
            steering_vectors(prompt_tokens=shortest, generating=body["max_tokens"] > 1)
        )
    if sequences == 1 and not stream and draw(st.integers(0, 2)) == 0:
        body["output_residual_stream"] = draw(
            st.lists(st.integers(0, LAYERS - 1), min_size=1, max_size=3, unique=True)
        )
    return body


# One field made wrong; each is refused by the contract wherever it is sent.
BREAKAGES = [
    {"temperature": 2.5},
    {"top_p": 0.0},
    {"n": 0},
    {"n": 17},
    {"max_tokens": 0},
    {"logprobs": 101},
    {"prompt": ""},
    {"prompt": []},
    {"stop": [""]},
    {"seed": 2**63},
    {"unknown_field": 1},
    {"prompt_logprobs": 1, "stream": True},
    {"echo": True, "return_token_ids": True},
    {"n": 2, "temperature": 0},
    {"output_residual_stream": [LAYERS]},
    {"output_residual_stream": [3, 3]},
    {"max_tokens": 10**6},
    {"apply_steering_vectors": [{"activations": {}, "layer_indices": [1]}]},
]


@st.composite
def invalid_requests(draw) -> dict:
    return {**draw(valid_requests()), **draw(st.sampled_from(BREAKAGES))}


def send(client, name: str, body: dict) -> tuple[int, dict]:
    """The public answer to `body` from the row `name`: status and body (a stream's frames
    put together as `{"frames": [...]}`)."""
    if not body.get("stream"):
        response = client.post("/v1/completions", json={"model": name, **body})
        return response.status_code, response.json()
    status, frames = stream_answer(client, {"model": name, **body})
    return status, {"frames": frames} if status == 200 else frames


def assert_same_answer(vllm: dict, engine: dict, body: dict) -> None:
    if "frames" in vllm:
        return assert_same_stream(vllm["frames"], engine["frames"], body)
    assert sorted(vllm) == sorted(engine), "top-level fields"
    assert vllm["usage"]["prompt_tokens"] == engine["usage"]["prompt_tokens"]
    assert [c["index"] for c in vllm["choices"]] == [c["index"] for c in engine["choices"]]
    agreed_everywhere, agreed = True, 0
    for got, expected in zip(vllm["choices"], engine["choices"], strict=True):
        assert sorted(got) == sorted(expected), "choice fields"
        assert_same_prompt_logprobs(got.get("prompt_logprobs"), expected.get("prompt_logprobs"))
        if body.get("echo") and isinstance(body["prompt"], str):
            assert got["text"].startswith(body["prompt"])
        # Not with echo: both name an echoed prompt's first token alone (vLLM's rule), so a
        # prompt that begins inside a multi-byte character names it "\ufffd", not its text.
        for choice in (got, expected):
            if choice["logprobs"] and not body.get("echo"):
                assert_offsets_map_into_text(choice)
        if body["temperature"] == 0 and expected["logprobs"]:
            agreed = assert_same_generation(got, expected)
            if agreed == len(expected["logprobs"]["tokens"]):
                assert got["finish_reason"] == expected["finish_reason"]
                assert got["text"] == expected["text"]
            else:
                agreed_everywhere = False
        elif expected["logprobs"] and expected["logprobs"]["top_logprobs"]:
            assert_same_first_distribution(got["logprobs"], expected["logprobs"])
    if body["temperature"] == 0 and agreed_everywhere and "logprobs" in body:
        assert vllm["usage"]["completion_tokens"] == engine["usage"]["completion_tokens"]
    if "output_residual_stream" in body:
        # Rows of the prompt, and of each generated token both sides chose alike (an echoed
        # answer's logprobs begin with the prompt's tokens); sampled tokens differ, and so may
        # their number (a stop string met on one side only).
        prompt_tokens = vllm["usage"]["prompt_tokens"]
        generated = max(agreed - prompt_tokens, 0) if body.get("echo") else agreed
        assert_same_rows(vllm, engine, rows=prompt_tokens + generated, same_shape=False)


def assert_same_stream(vllm: list[dict], engine: list[dict], body: dict) -> None:
    assert vllm[-1]["choices"] == engine[-1]["choices"] == []
    assert vllm[-1]["usage"]["prompt_tokens"] == engine[-1]["usage"]["prompt_tokens"]
    indices = [{c["index"] for f in frames[:-1] for c in f["choices"]} for frames in (vllm, engine)]
    assert indices[0] == indices[1]
    if body["temperature"] == 0 and "logprobs" in body:
        for index in indices[1]:
            ours, theirs = (
                {"logprobs": streamed_logprobs([only(frame, index) for frame in frames[:-1]])}
                for frames in (vllm, engine)
            )
            assert_same_generation(ours, theirs)


def only(frame: dict, index: int) -> dict:
    return {**frame, "choices": [c for c in frame["choices"] if c["index"] == index]}


@settings(
    max_examples=EXAMPLES,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(body=valid_requests())
def test_a_valid_request_gets_the_same_answer_from_both(client, models, body):
    if body["temperature"] == 0 and body.get("logprobs") is None:
        body = {**body, "logprobs": 2}  # both sides' top 2 tell a near tie
    vllm_status, vllm = send(client, models["vllm"], body)
    engine_status, engine = send(client, models["engine"], body)
    assert (vllm_status, engine_status) == (200, 200), (vllm, engine)
    assert_same_answer(vllm, engine, body)


@settings(
    max_examples=max(EXAMPLES // 4, 20),
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(body=invalid_requests())
def test_an_invalid_request_gets_the_same_refusal_from_both(client, models, body):
    vllm_status, vllm = send(client, models["vllm"], body)
    engine_status, engine = send(client, models["engine"], body)
    assert vllm_status == engine_status and 400 <= vllm_status < 500, (vllm, engine)
    assert vllm["error"]["code"] == engine["error"]["code"], (vllm, engine)
