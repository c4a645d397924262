"""Residual-stream capture and steering through the real server, checked against the model."""

import numpy as np
import pytest
import torch
from conftest import reference_forward

from acs_client.codec import decode, encode_vector

PROMPT = "The capital of France is"
PROMPT_TOKENS = 5
HIDDEN = 576


def relative_error(got: np.ndarray, expected: torch.Tensor) -> float:
    expected = expected.float().numpy()
    return float(np.linalg.norm(got - expected) / np.linalg.norm(expected))


def capture(complete, layers, **fields) -> tuple[np.ndarray, dict]:
    body = complete(prompt=PROMPT, temperature=0, output_residual_stream=layers, **fields)
    return decode(body["activations"]["residual_stream"]), body


def test_capture_matches_the_models_hidden_states(complete, reference):
    residual, body = capture(complete, True, max_tokens=3, logprobs=0)
    assert residual.shape == (30, PROMPT_TOKENS + 3 - 1, HIDDEN)
    generated = [reference.token_strings.index(t) for t in body["choices"][0]["logprobs"]["tokens"]]
    prompt_ids = reference.tokenizer(PROMPT)["input_ids"]
    _, hidden_states = reference_forward(reference, prompt_ids + generated[:-1])
    for layer in range(30):
        assert relative_error(residual[layer], hidden_states[layer + 1]) < 0.02, layer


def test_captured_layers_come_in_ascending_order_as_vllm_lens_sends_them(complete):
    """The gateway puts them back in the request's order (api.dialect)."""
    everything, _ = capture(complete, True, max_tokens=1)
    chosen, _ = capture(complete, [29, 3], max_tokens=1)
    assert chosen.shape == (2, PROMPT_TOKENS, HIDDEN)
    np.testing.assert_array_equal(chosen[0], everything[3])
    np.testing.assert_array_equal(chosen[1], everything[29])


def steering(vector: np.ndarray, layers: list[int], **options) -> list[dict]:
    return [{"activations": encode_vector(vector), "layer_indices": layers, **options}]


def test_scale_zero_is_bit_identical(complete):
    vector = np.random.default_rng(0).normal(size=(1, HIDDEN)).astype(np.float32) * 50
    fields = dict(max_tokens=4, logprobs=3, prompt_logprobs=2)
    plain, plain_body = capture(complete, [5, 20], **fields)
    zero, zero_body = capture(
        complete, [5, 20], apply_steering_vectors=steering(vector, [10], scale=0.0), **fields
    )
    np.testing.assert_array_equal(plain, zero)
    assert plain_body["choices"] == zero_body["choices"]


def test_unembedding_direction_raises_that_token(complete, reference):
    target = reference.tokenizer(" banana")["input_ids"][0]
    direction = reference.model.lm_head.weight[target].detach().float().numpy()
    direction = direction / np.linalg.norm(direction)
    prompt = [reference.tokenizer(PROMPT)["input_ids"] + [target]]

    def target_logprob(**fields) -> float:
        body = complete(prompt=prompt, max_tokens=1, prompt_logprobs=0, **fields)
        return body["choices"][0]["prompt_logprobs"][-1][str(target)]["logprob"]

    baseline = target_logprob()
    steered = target_logprob(apply_steering_vectors=steering(direction[None], [26], scale=60.0))
    assert steered > baseline + 3


def test_norm_match_scales_the_vector_to_the_hidden_state(complete):
    vector = np.zeros((1, HIDDEN), dtype=np.float32)
    vector[0, 7] = 1e-3  # tiny: norm_match must blow it up to the state's norm
    base, _ = capture(complete, [12], max_tokens=1)
    steered, _ = capture(
        complete,
        [12],
        max_tokens=1,
        apply_steering_vectors=steering(vector, [12], norm_match=True, scale=1.0),
    )
    difference = steered[0] - base[0]
    expected_norms = np.linalg.norm(base[0], axis=-1)
    np.testing.assert_allclose(np.abs(difference[:, 7]), expected_norms, rtol=0.03)
    assert np.abs(np.delete(difference, 7, axis=1)).max() == 0


def test_position_indices_steer_only_those_positions(complete):
    vector = np.full((1, 1, HIDDEN), 2.0, dtype=np.float32)
    base, _ = capture(complete, [5], max_tokens=1)
    steered, _ = capture(
        complete,
        [5],
        max_tokens=1,
        apply_steering_vectors=steering(vector, [5], position_indices=[2]),
    )
    changed = np.abs(steered[0] - base[0]).max(axis=-1) > 0
    assert changed.tolist() == [False, False, True, False, False]
    assert np.abs(steered[0, 2] - base[0, 2] - 2.0).max() < 0.1


def test_steering_applies_to_generated_tokens_too(complete):
    vector = np.random.default_rng(1).normal(size=(1, HIDDEN)).astype(np.float32)
    base = complete(prompt=PROMPT, max_tokens=6, temperature=0)["choices"][0]["text"]
    body = complete(
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        apply_steering_vectors=steering(vector, [8], scale=40.0),
    )
    assert body["choices"][0]["text"] != base


@pytest.mark.parametrize("layers", [[3], [3, 9]])
def test_steering_at_several_layers_takes_one_row_each(complete, layers):
    vector = np.ones((len(layers), HIDDEN), dtype=np.float32)
    body = complete(
        prompt=PROMPT, max_tokens=2, temperature=0, apply_steering_vectors=steering(vector, layers)
    )
    assert body["usage"]["completion_tokens"] == 2
