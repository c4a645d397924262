"""The activation tensor codec of the ACS API (numpy + zstandard only).

Wire format, as sent and received in `activations` objects::

    {"data": base64(zstd frame of the bfloat16 bit patterns as little-endian 16-bit words,
                    C order),
     "dtype": "int16", "original_dtype": "torch.bfloat16",
     "shape": [...], "compression": "zstd"}

`encode_vector` rounds float values to bfloat16 with round-to-nearest-even; `decode` returns
float32 and is exact for bfloat16 values. NaN stays NaN (sign kept, made quiet), ±inf and ±0
keep their sign, float32 values beyond the bfloat16 range round to ±inf, subnormals round like
any other value.

Decoding is bounded: `decode` refuses a shape of more than `max_values` values, and a zstd
frame whose declared content size differs from the shape's, before decompressing anything,
then reads at most the shape's size; no allocation depends on an unchecked number from the
sender.
"""

import base64
import binascii
import io
import math

import numpy as np
import zstandard

WIRE_DTYPE = "int16"
ORIGINAL_DTYPE = "torch.bfloat16"
COMPRESSION = "zstd"
ZSTD_LEVEL = 3
# The most values `decode` accepts unless the caller sets a tighter bound: the largest tensor
# the API returns (a capture of 64 Mi values, 128 MiB of bfloat16).
MAX_VALUES = 64 * 1024 * 1024

_BFLOAT16_QUIET_BIT = 0x0040


def float32_to_bfloat16_bits(array: np.ndarray) -> np.ndarray:
    """Round float values to bfloat16 (nearest, ties to even); return the bit patterns as uint16."""
    bits = np.ascontiguousarray(array, dtype=np.float32).view(np.uint32)
    # Adding 0x7FFF plus the lowest kept bit, then truncating, rounds to nearest-even. uint32
    # wraps only for NaN bit patterns, which are replaced below.
    lowest_kept_bit = (bits >> 16) & 1
    rounded = ((bits + 0x7FFF + lowest_kept_bit) >> 16).astype(np.uint16)
    quiet_nan = ((bits >> 16) | _BFLOAT16_QUIET_BIT).astype(np.uint16)
    return np.where(np.isnan(array), quiet_nan, rounded).astype(np.uint16)


def bfloat16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """Widen bfloat16 bit patterns (uint16 or int16) to float32, exactly."""
    words = np.ascontiguousarray(bits).view(np.uint16).astype(np.uint32)
    return (words << 16).view(np.float32)


def encode_bfloat16_bits(bits: np.ndarray) -> dict:
    """Build the codec object from bfloat16 bit patterns (uint16 or int16) of any shape."""
    words = np.ascontiguousarray(bits).view(np.uint16).astype("<u2", copy=False)
    frame = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(words.tobytes())
    return {
        "data": base64.b64encode(frame).decode("ascii"),
        "dtype": WIRE_DTYPE,
        "original_dtype": ORIGINAL_DTYPE,
        "shape": [int(size) for size in words.shape],
        "compression": COMPRESSION,
    }


def encode_vector(array: np.ndarray) -> dict:
    """Encode a float array (any shape) as the codec object, rounding values to bfloat16.

    float64 input is first narrowed to float32, then rounded to bfloat16.
    """
    array = np.asarray(array)
    if not (np.issubdtype(array.dtype, np.floating) or np.issubdtype(array.dtype, np.integer)):
        raise ValueError(f"cannot encode an array of dtype {array.dtype}; use a float array")
    return encode_bfloat16_bits(float32_to_bfloat16_bits(array.astype(np.float32)))


def decode_bfloat16_bits(obj: dict, *, max_values: int = MAX_VALUES) -> np.ndarray:
    """Decode the codec object to its bfloat16 bit patterns (uint16) in the encoded shape.

    Raises ValueError naming the problem for any malformed object, a shape of more than
    `max_values` values, or data that does not decompress to exactly the shape's size.
    """
    shape = check_header(obj, max_values=max_values)
    expected_bytes = 2 * math.prod(shape)
    frame = b64decode_data(obj.get("data"))
    check_frame_size(frame, shape)
    raw = _decompress(frame, expected_bytes)
    if len(raw) != expected_bytes:
        raise ValueError(_size_mismatch(len(raw), shape))
    return np.frombuffer(raw, dtype="<u2").astype(np.uint16).reshape(shape)


def decode(obj: dict, *, max_values: int = MAX_VALUES) -> np.ndarray:
    """Decode the codec object to a float32 array; exact for the encoded bfloat16 values.

    Raises ValueError naming the problem for bad base64, a bad zstd frame, a size that does not
    match the shape, a shape of more than `max_values` values, or an unsupported dtype or
    compression.
    """
    return bfloat16_bits_to_float32(decode_bfloat16_bits(obj, max_values=max_values))


def check_header(obj: dict, *, max_values: int = MAX_VALUES) -> tuple[int, ...]:
    """Check the codec object's dtype, compression and shape (at most `max_values` values)
    without touching its data; return the shape. ValueError naming the problem otherwise."""
    if not isinstance(obj, dict):
        raise ValueError("activations must be an object with data, dtype, shape, compression")
    _check_field(obj, "dtype", WIRE_DTYPE)
    _check_field(obj, "compression", COMPRESSION)
    if obj.get("original_dtype", ORIGINAL_DTYPE) != ORIGINAL_DTYPE:
        raise ValueError(
            f"unsupported original_dtype {obj['original_dtype']!r}; expected {ORIGINAL_DTYPE!r}"
        )
    shape = _parse_shape(obj.get("shape"))
    values = math.prod(shape)
    if values > max_values:
        raise ValueError(f"shape {list(shape)} holds {values} values; at most {max_values} allowed")
    return shape


def check_frame_size(frame: bytes, shape) -> None:
    """Without decompressing, refuse a zstd frame that declares a content size other than the
    `shape`'s (frames written by streaming compressors declare none; `_decompress` then bounds
    what it reads)."""
    try:
        declared = zstandard.get_frame_parameters(frame).content_size
    except zstandard.ZstdError as error:
        raise ValueError(f"data is not a valid zstd frame: {error}") from None
    if declared != zstandard.CONTENTSIZE_UNKNOWN and declared != 2 * math.prod(shape):
        raise ValueError(_size_mismatch(declared, shape))


def _size_mismatch(size: int, shape) -> str:
    return (
        f"data holds {size} bytes but shape {list(shape)} needs {2 * math.prod(shape)} "
        "(2 bytes per value)"
    )


def _check_field(obj: dict, name: str, expected: str) -> None:
    if name not in obj:
        raise ValueError(f"missing field {name!r}")
    if obj[name] != expected:
        raise ValueError(f"unsupported {name} {obj[name]!r}; expected {expected!r}")


def _parse_shape(shape) -> tuple[int, ...]:
    valid = isinstance(shape, list) and all(
        isinstance(size, int) and not isinstance(size, bool) and size >= 0 for size in shape
    )
    if not valid:
        raise ValueError(f"shape must be a list of non-negative integers, got {shape!r}")
    return tuple(shape)


def b64decode_data(data) -> bytes:
    """The zstd frame in a codec object's base64 `data`; ValueError naming the problem."""
    if not isinstance(data, str):
        raise ValueError("data must be a base64 string")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as error:
        raise ValueError(f"data is not valid base64: {error}") from None


def _decompress(frame: bytes, expected_bytes: int) -> bytes:
    # Read at most one byte more than the shape needs, so a huge frame cannot exhaust memory.
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(frame))
        return reader.read(expected_bytes + 1) if expected_bytes else reader.read(1)
    except zstandard.ZstdError as error:
        raise ValueError(f"data is not a valid zstd frame: {error}") from None
