"""The tensor codec: exact round trips, bfloat16 rounding, and clear errors for bad objects."""

import base64

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from acs_client.codec import (
    bfloat16_bits_to_float32,
    decode,
    encode_bfloat16_bits,
    encode_vector,
    float32_to_bfloat16_bits,
)

float32_arrays = hnp.arrays(
    dtype=np.float32,
    shape=hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=6),
    elements=st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True),
)
bit_patterns = hnp.arrays(
    dtype=np.uint16, shape=hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=6)
)


def torch_bfloat16(array: np.ndarray) -> np.ndarray:
    """Reference rounding: torch's float32 -> bfloat16 conversion (round to nearest even)."""
    return torch.from_numpy(array.copy()).to(torch.bfloat16).float().numpy()


@settings(max_examples=300, deadline=None)
@given(float32_arrays)
def test_round_trip_rounds_exactly_like_bfloat16(array):
    encoded = encode_vector(array)
    assert encoded["shape"] == list(array.shape)
    assert (encoded["dtype"], encoded["original_dtype"], encoded["compression"]) == (
        "int16",
        "torch.bfloat16",
        "zstd",
    )
    decoded = decode(encoded)
    assert decoded.dtype == np.float32 and decoded.shape == array.shape
    expected = torch_bfloat16(array)
    np.testing.assert_array_equal(np.isnan(decoded), np.isnan(array))
    finite = ~np.isnan(array)
    np.testing.assert_array_equal(decoded[finite], expected[finite])
    # signs survive, including -0.0 and -inf
    np.testing.assert_array_equal(np.signbit(decoded[finite]), np.signbit(expected[finite]))


@settings(max_examples=200, deadline=None)
@given(bit_patterns)
def test_bit_patterns_round_trip_exactly(bits):
    decoded_bits = float32_to_bfloat16_bits(bfloat16_bits_to_float32(bits))
    is_nan = np.isnan(bfloat16_bits_to_float32(bits))
    np.testing.assert_array_equal(decoded_bits[~is_nan], bits[~is_nan])
    # The wire format carries every bit pattern unchanged, NaN payloads included.
    np.testing.assert_array_equal(
        decode(encode_bfloat16_bits(bits)).view(np.uint32),
        bfloat16_bits_to_float32(bits).view(np.uint32),
    )


def test_ties_round_to_even_and_overflow_goes_to_infinity():
    values = np.array(
        [1.0 + 2**-8, 1.0 + 3 * 2**-8, 3.4e38, -3.4e38, 1e-45, -0.0, 2**-130], dtype=np.float32
    )
    decoded = decode(encode_vector(values))
    assert decoded[0] == 1.0  # halfway, rounds down to the even mantissa
    assert decoded[1] == 1.0 + 2**-6  # halfway, rounds up to the even mantissa
    assert decoded[2] == np.inf and decoded[3] == -np.inf
    assert decoded[4] == 0.0  # the smallest float32 subnormal is below bfloat16's
    assert np.signbit(decoded[5])
    assert decoded[6] == 2**-130  # a bfloat16 subnormal survives exactly


def test_engine_style_bits_from_torch_decode_to_the_same_values():
    tensor = torch.randn(2, 3, 5).to(torch.bfloat16)
    encoded = encode_bfloat16_bits(tensor.view(torch.int16).numpy())
    np.testing.assert_array_equal(decode(encoded), tensor.float().numpy())


def test_float64_and_integer_inputs_are_accepted():
    np.testing.assert_array_equal(decode(encode_vector(np.arange(4.0))), np.arange(4.0))
    np.testing.assert_array_equal(decode(encode_vector(np.arange(4))), np.arange(4.0))


def good() -> dict:
    return encode_vector(np.ones((2, 3), dtype=np.float32))


@pytest.mark.parametrize(
    "change, message",
    [
        ({"data": "%%%"}, "not valid base64"),
        ({"data": 5}, "base64 string"),
        ({"data": base64.b64encode(b"not zstd").decode()}, "not a valid zstd frame"),
        ({"shape": [2, 4]}, "needs 16"),
        ({"shape": [2, -3]}, "non-negative integers"),
        ({"shape": "2x3"}, "non-negative integers"),
        ({"dtype": "float16"}, "unsupported dtype"),
        ({"compression": "none"}, "unsupported compression"),
        ({"original_dtype": "torch.float32"}, "unsupported original_dtype"),
    ],
)
def test_bad_objects_raise_value_error_naming_the_problem(change, message):
    with pytest.raises(ValueError, match=message):
        decode({**good(), **change})


def test_missing_field_and_wrong_type_raise_value_error():
    obj = good()
    del obj["dtype"]
    with pytest.raises(ValueError, match="missing field 'dtype'"):
        decode(obj)
    with pytest.raises(ValueError, match="must be an object"):
        decode([1, 2])


def test_frame_without_content_size_decodes():
    raw = float32_to_bfloat16_bits(np.ones(4, np.float32)).astype("<u2").tobytes()
    frame = zstandard.ZstdCompressor(write_content_size=False).compress(raw)
    obj = {**good(), "shape": [4], "data": base64.b64encode(frame).decode()}
    np.testing.assert_array_equal(decode(obj), np.ones(4, np.float32))
