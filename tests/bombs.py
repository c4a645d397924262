"""Decompression bombs for the steering-vector tests of the engine and gateway suites (plain
Python + zstandard, importable from both virtualenvs)."""

import base64

import zstandard


def zero_bomb(shape: list[int], values: int) -> dict:
    """A codec object claiming `shape` whose data is a small zstd frame of `values` zero
    bfloat16 values, compressed in pieces so that the test never holds them all (233017 × 576
    values make an 11 KB body that decompresses to 268 MB)."""
    compressor = zstandard.ZstdCompressor().compressobj(size=2 * values)
    piece, left, frame = bytes(2 * 1024 * 1024), 2 * values, b""
    while left:
        frame += compressor.compress(piece[: min(left, len(piece))])
        left -= min(left, len(piece))
    frame += compressor.flush()
    data = base64.b64encode(frame).decode()
    return {"data": data, "dtype": "int16", "shape": shape, "compression": "zstd"}
