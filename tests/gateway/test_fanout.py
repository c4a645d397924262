"""A steered request of several sequences goes upstream one sequence per request (vLLM-Lens
steers only a request's first sequence), and its answers come back as the one public answer,
metered once (`api.fanout`). The real vLLM-Lens answers such requests in tests/vllm."""

import itertools
import json

import numpy as np
import pytest

from acs_client.codec import encode_vector
from api.dialect import upstream_seed
from metering.models import UsageRecord

from .conftest import wait_settled
from .test_errors import assert_error

pytestmark = pytest.mark.django_db(transaction=True)

STEERING = [{"activations": encode_vector(np.ones((1, 8), np.float32)), "layer_indices": [3]}]
PROMPTS = ["the capital of france is", "hello"]  # 5 and 1 tokens for the stub
STEERED = {
    "model": "stub-model",
    "prompt": PROMPTS,
    "n": 2,
    "max_tokens": 3,
    "temperature": 0.7,
    "seed": 5,
    "echo": True,
    "apply_steering_vectors": STEERING,
}
USAGE = {"prompt_tokens": 6, "completion_tokens": 12, "total_tokens": 18}


def test_a_steered_request_of_several_sequences_goes_upstream_one_sequence_each(client, stub):
    response = client.post("/v1/completions", json=STEERED)
    assert response.status_code == 200, response.text
    sent = stub.requests  # in the order they arrived: all at once
    assert all(json.loads(body["vllm_xargs"]["apply_steering_vectors"]) for body in sent)
    # Sample j with the request's upstream seed + j, as vLLM draws the samples of n > 1.
    assert sorted((body["prompt"], body["n"], body["seed"]) for body in sent) == sorted(
        (prompt, 1, upstream_seed(5) + sample) for prompt in PROMPTS for sample in (0, 1)
    )
    answer = response.json()
    assert [choice["index"] for choice in answer["choices"]] == [0, 1, 2, 3]
    echoed = [choice["text"].removesuffix(" tok" * 3) for choice in answer["choices"]]
    assert echoed == [prompt for prompt in PROMPTS for _ in range(2)]
    assert answer["usage"] == USAGE
    wait_settled()
    record = UsageRecord.objects.get()
    assert (record.prompt_tokens, record.completion_tokens) == (6, 12)


def test_a_steered_stream_of_several_sequences_is_one_stream(client, stub):
    body = {**STEERED, "echo": False, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert len(stub.requests) == 4
    assert lines[-1] == "data: [DONE]" and lines.count("data: [DONE]") == 1
    frames = [json.loads(line[6:]) for line in lines[:-1]]
    assert frames[-1]["choices"] == [] and frames[-1]["usage"] == USAGE
    indices = [choice["index"] for frame in frames[:-1] for choice in frame["choices"]]
    assert sorted(indices) == [index for index in range(4) for _ in range(3)]
    wait_settled()
    assert UsageRecord.objects.get().completion_tokens == 12


def test_an_echoed_stream_of_samples_with_logprobs_goes_upstream_one_sample_each(client, stub):
    """vLLM 0.32 fails such a stream in most runs; it answers each sample alone."""
    stub.mode["logprob"] = -1.0
    body = {key: value for key, value in STEERED.items() if key != "apply_steering_vectors"}
    body = {**body, "prompt": "hello", "stream": True, "logprobs": 1}
    with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert sorted((sent["n"], sent["seed"]) for sent in stub.requests) == [
        (1, upstream_seed(5)),
        (1, upstream_seed(5) + 1),
    ]


def test_an_unsteered_request_of_several_sequences_goes_upstream_whole(client, stub):
    body = {key: value for key, value in STEERED.items() if key != "apply_steering_vectors"}
    assert client.post("/v1/completions", json=body).status_code == 200
    assert [(sent["prompt"], sent["n"]) for sent in stub.requests] == [(PROMPTS, 2)]


def test_a_steered_request_of_one_sequence_goes_upstream_whole(client, stub):
    body = {**STEERED, "prompt": "hello", "n": 1}
    assert client.post("/v1/completions", json=body).status_code == 200
    assert len(stub.requests) == 1


def test_a_failing_sequence_fails_the_request_billed_for_what_ran(client, stub):
    stub.mode["status"] = 500
    response = client.post("/v1/completions", json=STEERED)
    assert response.status_code >= 500
    assert "error" in response.json()
    wait_settled()
    assert UsageRecord.objects.get().completion_tokens == 0


def test_neighbouring_seeds_draw_from_far_apart_upstream_seeds():
    """vLLM draws sample j of seed s with seed s + j: sent as they are, seeds 100 and 101 with
    n = 4 would share three samples. Hashed, no two public seeds near each other come within
    16 samples of each other, and every one is a signed 64-bit integer with room for n."""
    seeds = [upstream_seed(seed) for seed in range(-1000, 1000)] + [
        upstream_seed(-(2**63)),
        upstream_seed(2**63 - 1),
    ]
    assert all(0 <= seed < 2**62 for seed in seeds)
    ordered = sorted(seeds)
    assert min(b - a for a, b in itertools.pairwise(ordered)) > 16


@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1, 2**64 + 5])
def test_a_seed_outside_a_signed_64_bit_integer_is_refused(client, stub, seed):
    response = client.post("/v1/completions", json={**STEERED, "seed": seed})
    error = assert_error(response, 400, "invalid_request", should_retry=False)
    assert "seed" in error["message"]
    assert stub.requests == []
