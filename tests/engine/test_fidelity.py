"""The engine computes what it computed before it had its own decoder (commit 74e4f92): same
greedy tokens, logprobs within 1e-2 and captured activations within bfloat16 rounding, in
both compute dtypes. The reference is fidelity_reference.json, written from that commit by
make_fidelity_reference.py."""

import json

import numpy as np
import pytest
from conftest import EngineProcess
from make_fidelity_reference import DTYPES, REFERENCE_FILE, answers

from acs_client.codec import decode

LOGPROB_TOLERANCE = 1e-2
# Captured activations are bfloat16 (8 significant bits); a summation order that differs in
# float32 can move a value to the neighbouring bfloat16 number, whose step is up to 2**-7 of
# the value; a row of them differs from the reference by far less in norm.
ACTIVATION_ROW_RELATIVE_ERROR = 2**-7


@pytest.fixture(scope="module", params=DTYPES)
def answered(request):
    """(the reference answers, the current engine's answers) in one compute dtype."""
    dtype = request.param
    reference = json.loads(REFERENCE_FILE.read_text())["answers"][dtype]
    engine = EngineProcess({"ACS_ENGINE_DTYPE": dtype, "ACS_ENGINE_DEVICE": "cpu"})
    try:
        engine.wait_until_loaded()
        return reference, answers(engine.client)
    finally:
        engine.close()


def test_greedy_tokens_are_the_references(answered):
    reference, current = answered
    for expected, got in zip(reference, current, strict=True):
        assert [choice["text"] for choice in got["choices"]] == [
            choice["text"] for choice in expected["choices"]
        ]
        for expected_choice, got_choice in zip(expected["choices"], got["choices"], strict=True):
            assert got_choice["logprobs"]["tokens"] == expected_choice["logprobs"]["tokens"]


def test_logprobs_are_within_a_hundredth_of_the_references(answered):
    reference, current = answered
    for expected, got in zip(reference, current, strict=True):
        for expected_choice, got_choice in zip(expected["choices"], got["choices"], strict=True):
            expected_logprobs, got_logprobs = expected_choice["logprobs"], got_choice["logprobs"]
            assert got_logprobs["token_logprobs"] == pytest.approx(
                expected_logprobs["token_logprobs"], abs=LOGPROB_TOLERANCE
            )
            for expected_top, got_top in zip(
                expected_logprobs["top_logprobs"], got_logprobs["top_logprobs"], strict=True
            ):
                assert_close_entries(expected_top, got_top)
            for expected_entry, got_entry in zip(
                expected_choice.get("prompt_logprobs") or [],
                got_choice.get("prompt_logprobs") or [],
                strict=True,
            ):
                if expected_entry is None:
                    assert got_entry is None
                    continue
                assert_close_entries(
                    {token: entry["logprob"] for token, entry in expected_entry.items()},
                    {token: entry["logprob"] for token, entry in got_entry.items()},
                )


def assert_close_entries(expected: dict[str, float], got: dict[str, float]) -> None:
    """Top-logprob dicts agree: every token listed in both within the tolerance, and a token
    listed in one only is a near tie with the other's least likely entry."""
    for token in expected.keys() & got.keys():
        assert got[token] == pytest.approx(expected[token], abs=LOGPROB_TOLERANCE), token
    for token in expected.keys() - got.keys():
        assert expected[token] <= min(got.values()) + LOGPROB_TOLERANCE, token
    for token in got.keys() - expected.keys():
        assert got[token] <= min(expected.values()) + LOGPROB_TOLERANCE, token


def test_captured_activations_are_the_references_to_bfloat16_rounding(answered):
    reference, current = answered
    captures = [
        (expected["activations"], got["activations"])
        for expected, got in zip(reference, current, strict=True)
        if expected["activations"] is not None
    ]
    assert captures
    for expected_activations, got_activations in captures:
        expected = decode(expected_activations["residual_stream"])
        got = decode(got_activations["residual_stream"])
        assert got.shape == expected.shape
        row_errors = np.linalg.norm(got - expected, axis=-1) / np.linalg.norm(expected, axis=-1)
        assert row_errors.max() < ACTIVATION_ROW_RELATIVE_ERROR
