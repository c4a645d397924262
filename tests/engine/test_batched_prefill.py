"""Prompts that wait together are prefilled together: one left-padded forward pass.

These tests drive a Scheduler in-process, so that they can count the model's forward passes and
look inside them. Every request is submitted before the scheduler starts, so its first step
admits them all (up to max_active) in one prefill batch. Batched and solo runs are compared on a
float32 copy of the model, where they agree to ~1e-5: in bfloat16 a row's logprobs move by up
to ~0.3 with its batch (with or without padding), which flips near-ties of greedy decoding.
"""

import asyncio
import json
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from conftest import MODEL

from acs_client.codec import decode, encode_vector
from acs_client.protocol import in_vllm_xargs
from engine import scheduler
from engine.preparation import prepare_completion
from engine.protocol import CompletionRequest, parse_model
from engine.scheduler import EngineRequest, Scheduler
from engine.server import complete

HIDDEN = 576
SHORT_PROMPT = "The capital of France is"  # 5 tokens
LONG_PROMPT = "Once upon a time, in a land far away, there lived a"


@dataclass
class Forward:
    """One forward pass of the decoder stack: its input shape [rows, tokens], and whether its
    final hidden states or its KV cache hold a NaN anywhere (padding included)."""

    shape: tuple[int, int]
    has_nan: bool


@pytest.fixture(scope="module")
def exact(model_loaded_with):
    """A float32 copy of the model."""
    return model_loaded_with(ACS_ENGINE_DTYPE="float32")


@contextmanager
def recorded_forwards(loaded):
    """A list that receives the forward passes `loaded` runs within the block, in order."""
    calls: list[Forward] = []
    decoder = loaded.decoder
    forward = decoder.forward

    def record(input_ids, mask, position_ids, cache, hooks):
        final_hidden = forward(input_ids, mask, position_ids, cache, hooks)
        keys, values = (state[:, :, :, : cache.length] for state in (cache.keys, cache.values))
        has_nan = any(bool(tensor.isnan().any()) for tensor in (final_hidden, keys, values))
        calls.append(Forward(tuple(input_ids.shape), has_nan))
        return final_hidden

    decoder.forward = record
    try:
        yield calls
    finally:
        del decoder.forward


def run_together(loaded, bodies: list[dict], max_active: int = 16) -> list[dict]:
    """Complete `bodies` on a fresh scheduler that holds them all before it starts; the
    response bodies, in order."""

    async def run():
        loop = asyncio.get_running_loop()
        scheduler = Scheduler(loaded, max_active, max_waiting=64, threads=torch.get_num_threads())
        requests = [EngineRequest(prepare(loaded, body), loop) for body in bodies]
        for request in requests:
            scheduler.submit(request)
        scheduler.start()
        try:
            return await asyncio.gather(
                *(complete(request, loaded.model_id) for request in requests)
            )
        finally:
            scheduler.stop()

    responses = asyncio.run(run())
    assert [response.status_code for response in responses] == [200] * len(bodies)
    return [json.loads(response.body) for response in responses]


def prepare(loaded, body: dict):
    parsed = parse_model(CompletionRequest, in_vllm_xargs({"model": MODEL, **body}))
    return prepare_completion(parsed, loaded)


def run_alone(loaded, body: dict) -> dict:
    return run_together(loaded, [body])[0]


def prompt_length(loaded, prompt: str) -> int:
    return len(loaded.tokenizer(prompt)["input_ids"])


MIXED_BATCH = [
    dict(prompt=SHORT_PROMPT, max_tokens=6, temperature=0),
    dict(prompt=LONG_PROMPT, max_tokens=6, temperature=0, n=3),
    dict(prompt="Hi", max_tokens=6, temperature=0, logprobs=2),
    dict(prompt="def add(a, b):", max_tokens=4, temperature=0, prompt_logprobs=1, echo=True),
]


def test_waiting_prompts_share_one_prefill_and_match_running_alone(exact):
    with recorded_forwards(exact) as forwards:
        together = run_together(exact, MIXED_BATCH)
    assert forwards[0].shape == (4, prompt_length(exact, LONG_PROMPT))
    assert all(call.shape[1] == 1 for call in forwards[1:]), "later passes are decode steps"
    for body, batched in zip(MIXED_BATCH, together, strict=True):
        alone = run_alone(exact, body)
        assert [c["text"] for c in batched["choices"]] == [c["text"] for c in alone["choices"]]
        assert batched["usage"] == alone["usage"]
        batched_choice, alone_choice = batched["choices"][0], alone["choices"][0]
        if body.get("logprobs") is not None:
            got, expected = batched_choice["logprobs"], alone_choice["logprobs"]
            assert got["tokens"] == expected["tokens"]
            assert got["token_logprobs"] == pytest.approx(expected["token_logprobs"], abs=1e-3)
        if body.get("prompt_logprobs") is not None:
            got, expected = batched_choice["prompt_logprobs"], alone_choice["prompt_logprobs"]
            assert len(got) == len(expected) == prompt_length(exact, body["prompt"])
            for got_entry, expected_entry in zip(got[1:], expected[1:], strict=True):
                assert got_entry.keys() == expected_entry.keys()
                for token, entry in got_entry.items():
                    logprob = expected_entry[token]["logprob"]
                    assert entry["logprob"] == pytest.approx(logprob, abs=1e-3)


def test_batched_prefill_in_bfloat16_leaves_no_nan(reference):
    """The padding positions attend to nothing; that must not put NaN into the hidden states
    or the KV cache in the model's serving dtype."""
    with recorded_forwards(reference) as forwards:
        together = run_together(reference, MIXED_BATCH)
    assert forwards[0].shape == (4, prompt_length(reference, LONG_PROMPT))
    assert not any(call.has_nan for call in forwards)
    assert together[0]["choices"][0]["text"].startswith(" Paris")


def test_prefill_batch_takes_only_the_groups_that_fit_beside_the_active_ones(exact):
    bodies = [dict(prompt=SHORT_PROMPT, max_tokens=2, temperature=0, n=2) for _ in range(3)]
    with recorded_forwards(exact) as forwards:
        # 5 slots, of which a tenant with sequences running leaves 1 to other tenants: the
        # first two groups (4 sequences) fit, the third waits for them.
        together = run_together(exact, bodies, max_active=5)
    prefills = [call.shape for call in forwards if call.shape[1] > 1]
    length = prompt_length(exact, SHORT_PROMPT)
    assert prefills == [(2, length), (1, length)]
    alone = run_alone(exact, bodies[0])
    assert all(body["choices"] == alone["choices"] for body in together)


def residual_stream(body: dict) -> np.ndarray:
    return decode(body["activations"]["residual_stream"])


def relative_error(got: np.ndarray, expected: np.ndarray) -> float:
    return float(np.linalg.norm(got - expected) / np.linalg.norm(expected))


def test_capture_beside_a_longer_prompt_records_no_padding(exact):
    captured = dict(prompt=SHORT_PROMPT, max_tokens=3, temperature=0, output_residual_stream=True)
    longer = dict(prompt=LONG_PROMPT, max_tokens=3, temperature=0)
    with recorded_forwards(exact) as forwards:
        _, batched = run_together(exact, [longer, captured])
    assert forwards[0].shape == (2, prompt_length(exact, LONG_PROMPT))
    alone = run_alone(exact, captured)
    assert batched["choices"][0]["text"] == alone["choices"][0]["text"]
    got, expected = residual_stream(batched), residual_stream(alone)
    assert got.shape == expected.shape == (30, 5 + 3 - 1, HIDDEN)
    for layer in range(30):
        # Only the bfloat16 rounding of the capture may differ.
        assert relative_error(got[layer], expected[layer]) < 1e-3, layer


def test_positioned_steering_beside_a_longer_prompt_hits_the_same_positions(exact):
    vector = np.stack([np.full(HIDDEN, 2.0), np.full(HIDDEN, -3.0)])[None].astype(np.float32)
    steering = {
        "activations": encode_vector(vector),
        "layer_indices": [5],
        "position_indices": [1, 3],
    }
    plain = dict(prompt=SHORT_PROMPT, max_tokens=2, temperature=0, output_residual_stream=[5])
    steered = {**plain, "apply_steering_vectors": [steering]}
    longer = dict(prompt=LONG_PROMPT, max_tokens=2, temperature=0)

    def steering_effect(run) -> np.ndarray:
        """Steered minus plain capture at layer 5, [positions, hidden]."""
        return residual_stream(run(steered))[0] - residual_stream(run(plain))[0]

    batched = steering_effect(lambda body: run_together(exact, [longer, body])[1])
    alone = steering_effect(lambda body: run_alone(exact, body))
    changed = [bool(np.abs(effect).max() > 0) for effect in batched[:5]]
    assert changed == [False, True, False, True, False]
    assert batched[1].mean() == pytest.approx(2.0, abs=0.1)
    assert batched[3].mean() == pytest.approx(-3.0, abs=0.1)
    np.testing.assert_allclose(batched, alone, atol=0.1)


def test_prompts_of_very_different_lengths_are_not_padded_together(exact):
    long_prompt = [1000 + (37 * i) % 30000 for i in range(600)]
    bodies = [
        dict(prompt=long_prompt, max_tokens=2, temperature=0),
        dict(prompt=SHORT_PROMPT, max_tokens=2, temperature=0),
        dict(prompt="Hi", max_tokens=2, temperature=0),
    ]
    with recorded_forwards(exact) as forwards:
        run_together(exact, bodies)
    prefills = [call.shape for call in forwards if call.shape[1] > 1]
    chunk = scheduler.PREFILL_CHUNK_TOKENS
    assert prefills == [(1, chunk), (1, chunk), (1, 600 - 2 * chunk), (2, 5)]


def test_a_long_prompt_is_prefilled_in_chunks_between_decode_steps(exact):
    long_prompt = [1000 + (37 * i) % 30000 for i in range(600)]
    running = dict(prompt=SHORT_PROMPT, max_tokens=12, temperature=0)
    chunked = dict(
        prompt=long_prompt,
        max_tokens=3,
        temperature=0,
        prompt_logprobs=1,
        output_residual_stream=[0, 29],
    )
    with recorded_forwards(exact) as forwards:
        together = run_together(exact, [running, chunked])
    shapes = [call.shape for call in forwards]
    chunk = scheduler.PREFILL_CHUNK_TOKENS
    first, second = shapes.index((1, chunk)), shapes.index((1, chunk), shapes.index((1, chunk)) + 1)
    assert (1, 1) in shapes[first + 1 : second], "the running request decoded between chunks"

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(scheduler, "PREFILL_CHUNK_TOKENS", 10_000)
        whole = run_alone(exact, chunked)
    got, expected = together[1]["choices"][0], whole["choices"][0]
    assert got["text"] == expected["text"]
    assert len(got["prompt_logprobs"]) == len(expected["prompt_logprobs"]) == 600
    for got_entry, expected_entry in zip(
        got["prompt_logprobs"][1:], expected["prompt_logprobs"][1:], strict=True
    ):
        for token, entry in got_entry.items():
            assert entry["logprob"] == pytest.approx(expected_entry[token]["logprob"], abs=1e-3)
    got_capture, expected_capture = residual_stream(together[1]), residual_stream(whole)
    assert got_capture.shape == expected_capture.shape == (2, 600 + 3 - 1, HIDDEN)
    for layer in range(2):
        assert relative_error(got_capture[layer], expected_capture[layer]) < 1e-3
