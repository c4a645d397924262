"""Harvest output files: safetensors encoding (bfloat16 included, which numpy lacks) and
reads and writes through Django's default storage (MEDIA_ROOT locally, any backend in
production)."""

import json
import struct

import numpy as np
from django.core.files.base import ContentFile
from django.core.files.storage import default_storage
from safetensors import deserialize

# The name clients look for (`acs_client.downloads.HarvestDownload`), imported from here by the
# gateway.
from acs_client.downloads import MANIFEST_NAME as MANIFEST_NAME

STATS_NAME = "stats.safetensors"

_DTYPE_NAMES = {
    np.dtype(np.float32): "F32",
    np.dtype(np.int32): "I32",
    np.dtype(np.int64): "I64",
}


class Tensor:
    """One tensor to write: its safetensors dtype name, shape and little-endian raw bytes."""

    def __init__(self, dtype: str, shape, data: bytes):
        self.dtype = dtype
        self.shape = [int(size) for size in shape]
        self.data = data

    @classmethod
    def from_array(cls, array: np.ndarray) -> "Tensor":
        array = np.ascontiguousarray(array)
        little_endian = array.astype(array.dtype.newbyteorder("<"), copy=False)
        return cls(_DTYPE_NAMES[array.dtype], array.shape, little_endian.tobytes())

    @classmethod
    def bfloat16(cls, bits: np.ndarray) -> "Tensor":
        """A bfloat16 tensor from its 16-bit patterns (uint16 or int16)."""
        words = np.ascontiguousarray(bits).view(np.uint16).astype("<u2", copy=False)
        return cls("BF16", words.shape, words.tobytes())


def safetensors_bytes(tensors: dict[str, Tensor], metadata: dict[str, str] | None = None) -> bytes:
    """The safetensors file holding `tensors` in the given order: an 8-byte little-endian
    header length, the JSON header (padded with spaces to 8 bytes), then the data."""
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, tensor in tensors.items():
        header[name] = {
            "dtype": tensor.dtype,
            "shape": tensor.shape,
            "data_offsets": [offset, offset + len(tensor.data)],
        }
        offset += len(tensor.data)
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)
    return b"".join(
        [struct.pack("<Q", len(header_bytes)), header_bytes, *(t.data for t in tensors.values())]
    )


def harvest_file_write(prefix: str, name: str, content: bytes) -> None:
    """Write one file of a job, replacing any earlier copy (a retried job rewrites it)."""
    path = prefix + name
    if default_storage.exists(path):
        default_storage.delete(path)
    saved = default_storage.save(path, ContentFile(content))
    if saved != path:
        raise RuntimeError(f"storage saved {path!r} as {saved!r}")


def harvest_files_delete(prefix: str) -> None:
    """Delete every file of a job, and its folder where the storage has folders."""
    try:
        _, names = default_storage.listdir(prefix)
    except FileNotFoundError:
        return
    for name in names:
        default_storage.delete(prefix + name)
    if default_storage.exists(prefix):
        default_storage.delete(prefix)


def harvest_bytes_estimate(*, prompt_tokens: int, n_layers: int, hidden_size: int) -> int:
    """The bytes that captures of `prompt_tokens` tokens in all over `n_layers` layers take
    in a job's shards: bfloat16 activations and int32 token ids (headers aside)."""
    return prompt_tokens * (n_layers * hidden_size * 2 + 4)


def harvest_shard_captures(prefix: str, name: str) -> list[np.ndarray]:
    """The captures of a shard written earlier, in order: each `prompt_<i>` tensor as its
    bfloat16 bit patterns (uint16, [layers, tokens, hidden])."""
    with default_storage.open(prefix + name, "rb") as handle:
        tensors = deserialize(handle.read())
    return [
        np.frombuffer(bytes(spec["data"]), dtype="<u2").reshape(spec["shape"])
        for tensor_name, spec in tensors
        if tensor_name.startswith("prompt_")
    ]


def harvest_file_open(prefix: str, name: str):
    return default_storage.open(prefix + name, "rb")


def manifest_bytes(manifest: dict) -> bytes:
    return json.dumps(manifest, indent=1).encode()
