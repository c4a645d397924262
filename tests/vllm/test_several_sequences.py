"""Requests of several sequences through the gateway to vLLM-Lens and to the engine: steered,
every sequence is steered on both (vLLM-Lens alone steers only a request's first: the gateway
sends it one sequence per request, `api.fanout`); seeded, the samples of neighbouring seeds
are independent on both (`api.dialect.upstream_seed`)."""

import numpy as np
import pytest

from acs_client.codec import decode

from .test_vllm_lens import (
    BOUND,
    DIRECTION,
    answer_pair,
    assert_same_answer,
    assert_same_first_distribution,
    assert_same_generation,
    steering,
    streamed,
)

pytestmark = pytest.mark.django_db(transaction=True)

PROMPTS = [
    "The capital of Italy is",
    "The capital of France is",
    "My favourite recipe is for a cake that",
]
STEERING = steering(DIRECTION[None] * 60.0, [10])


def first_logprob(choice: dict) -> float:
    return choice["logprobs"]["token_logprobs"][0]


def test_every_prompt_of_a_steered_request_is_steered_on_both(client, models):
    body = {"prompt": PROMPTS, "max_tokens": 6, "temperature": 0, "logprobs": 2}
    plain, plain_engine = answer_pair(client, models, body)
    vllm, engine = answer_pair(client, models, {**body, "apply_steering_vectors": STEERING})
    assert [c["index"] for c in vllm["choices"]] == [0, 1, 2]
    assert vllm["usage"]["prompt_tokens"] == engine["usage"]["prompt_tokens"]
    for index, prompt in enumerate(PROMPTS):
        steered, expected = vllm["choices"][index], engine["choices"][index]
        # The vector moves every prompt's first token far beyond rounding on the engine, so
        # that a sequence vLLM-Lens left unsteered cannot pass for a steered one.
        moved = first_logprob(expected) - first_logprob(plain_engine["choices"][index])
        changed = expected["text"] != plain_engine["choices"][index]["text"]
        assert changed or abs(moved) > 4 * BOUND.logprob, (prompt, moved)
        assert_same_generation(steered, expected)
        alone, _ = answer_pair(
            client, models, {**body, "prompt": prompt, "apply_steering_vectors": STEERING}
        )
        assert_same_generation(steered, alone["choices"][0])
    assert plain["choices"] != vllm["choices"]


def test_every_sample_of_a_steered_request_is_steered_on_both(client, models):
    body = {
        "prompt": PROMPTS[0],
        "max_tokens": 1,
        "temperature": 1.0,
        "seed": 7,
        "n": 3,
        "logprobs": 5,
        "apply_steering_vectors": STEERING,
    }
    vllm, engine = answer_pair(client, models, body)
    alone, _ = answer_pair(client, models, {**body, "n": 1, "temperature": 0})
    assert [c["index"] for c in vllm["choices"]] == [0, 1, 2]
    for got, expected in zip(vllm["choices"], engine["choices"], strict=True):
        assert_same_first_distribution(got["logprobs"], expected["logprobs"])
        assert_same_first_distribution(got["logprobs"], alone["choices"][0]["logprobs"])
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [vllm["usage"][k] for k in counts] == [engine["usage"][k] for k in counts] == [5, 3, 8]


def test_a_steered_stream_of_several_prompts_is_steered_on_both(client, models):
    body = {
        "prompt": PROMPTS,
        "max_tokens": 4,
        "temperature": 0,
        "logprobs": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
        "apply_steering_vectors": STEERING,
    }
    texts = []
    for name in (models["vllm"], models["engine"]):
        frames = streamed(client, {"model": name, **body})
        by_index = {index: "" for index in range(len(PROMPTS))}
        for frame in frames[:-1]:
            for choice in frame["choices"]:
                by_index[choice["index"]] += choice["text"]
        assert frames[-1]["usage"]["completion_tokens"] == 4 * len(PROMPTS)
        texts.append(by_index)
    whole, _ = answer_pair(client, models, {**body, "stream": False, "stream_options": None})
    assert texts[0] == {c["index"]: c["text"] for c in whole["choices"]}


def test_the_samples_of_neighbouring_seeds_are_independent_on_both(client, models):
    """vLLM draws sample j of seed s with seed s + j: sent as they are, seeds 100 and 101 with
    n = 4 share three of their samples. The same seed repeats its samples."""
    body = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 2.0, "n": 4}
    for name in models.values():
        samples = {}
        for seed in (100, 101, 100):
            response = client.post("/v1/completions", json={"model": name, **body, "seed": seed})
            assert response.status_code == 200, response.text
            texts = [choice["text"] for choice in response.json()["choices"]]
            assert samples.setdefault(seed, texts) == texts, (name, seed)
        assert not set(samples[100]) & set(samples[101]), (name, samples)


# About 2,100 tokens: past vLLM's default prefill chunk (2,048 tokens on a CPU).
LONG_PROMPT = " ".join(f"Line {i}: the river runs past the old mill." for i in range(190))


def test_positions_past_a_prefill_chunk_steer_the_positions_asked_for_on_both(client, models):
    """vLLM-Lens counts a position from the start of the prompt's part in the prefill step
    that computes it: with chunked prefill, 2060 steered row 2053 and 2048 nothing. vLLM is
    served with chunked prefill off (docs/deploy.md §5), so a prompt is prefilled in one step
    and a position is the prompt's own."""
    positions = [5, 2047, 2048, 2060]
    vectors = np.repeat(DIRECTION[None, None] * 40.0, len(positions), axis=1)
    body = {
        "prompt": LONG_PROMPT,
        "max_tokens": 1,
        "temperature": 0,
        "logprobs": 2,
        "output_residual_stream": [10],
        "apply_steering_vectors": steering(vectors, [10], position_indices=positions),
    }
    vllm, engine = answer_pair(client, models, body)
    assert vllm["usage"]["prompt_tokens"] > 2060
    plain, _ = answer_pair(
        client, models, {k: v for k, v in body.items() if k != "apply_steering_vectors"}
    )
    steered, unsteered = (decode(a["activations"]["residual_stream"])[0] for a in (vllm, plain))
    moved = np.flatnonzero(np.linalg.norm(steered - unsteered, axis=-1) > 20.0)
    assert moved.tolist() == positions
    assert_same_answer(vllm, engine, body)
