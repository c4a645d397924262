"""Activation downloads: a playground run's capture and a harvest job's shards, in one format
that this module reads into numpy arrays with their metadata (numpy and json only).

The format is safetensors. Capture i of a file is the tensor `prompt_i` (bfloat16
`[layers, tokens, hidden]`: row k of it is the output of decoder block `layers[k]`, before
the final norm) with `tokens_i` (int32 `[tokens]`: the token id at each position, -1 where it
is unknown). The header's `__metadata__["acs"]` is a JSON document: the model, the layers, the
capture convention, the request id(s), the steering applied, and per capture the token
strings and how many of its positions are the prompt (position r < prompt_length is prompt
token r; the rest are the generated tokens fed back, the last generated token having none).

Example (also runnable as `python -m acs_client.downloads FILE...`, which prints a summary)::

    from acs_client.downloads import load_activations

    download = load_activations("run-….safetensors")   # or a harvest shard
    capture = download.captures[0]
    block_12 = capture.layer(12)                       # float32 [tokens, hidden]
    norms = np.linalg.norm(block_12, axis=-1)
    for token, norm, is_prompt in zip(capture.token_strings, norms, capture.is_prompt):
        print(repr(token), f"{norm:.1f}", "prompt" if is_prompt else "generated")

Files written before the metadata existed (harvest shards without `__metadata__`) load too:
their metadata is empty, so `layers`, `token_strings` and `prompt_length` are None.
"""

import json
import os
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

FORMAT = "acs-activations"
VERSION = 1
METADATA_KEY = "acs"
CAPTURE_CONVENTION = "output of decoder block k, before the final norm"
UNKNOWN_TOKEN_ID = -1
# The file of a harvest that lists its shards (as the gateway names it).
MANIFEST_NAME = "manifest.json"

# A safetensors header larger than this is not one of ours (ours are a few kB per capture).
MAX_HEADER_BYTES = 64 * 1024 * 1024
_DTYPES = {"BF16": np.dtype("<u2"), "F32": np.dtype("<f4"), "I32": np.dtype("<i4"),
           "I64": np.dtype("<i8")}  # fmt: skip


# ---------------------------------------------------------------------------------------
# Writing the metadata (the files themselves are written by the service)


def capture_metadata(
    *,
    index: int,
    token_strings: list[str | None] | None,
    prompt_length: int,
    request_id: str | None = None,
) -> dict:
    """The metadata of capture `index` (the tensors `prompt_<index>` and `tokens_<index>`)."""
    return {
        "index": index,
        "tensor": f"prompt_{index}",
        "tokens": f"tokens_{index}",
        "token_strings": token_strings,
        "prompt_length": prompt_length,
        "request_id": request_id,
    }


def file_metadata(
    *,
    kind: str,
    model: str,
    layers: list[int],
    captures: list[dict],
    steering: list[dict] | None = None,
    **details,
) -> dict[str, str]:
    """The safetensors `__metadata__` of a file of `captures` (see `capture_metadata`):
    `kind` is "run" or "harvest_shard"; `details` (run or job id, ...) are kept as given."""
    document = {
        "format": FORMAT,
        "version": VERSION,
        "kind": kind,
        "model": model,
        "layers": list(layers),
        "capture": CAPTURE_CONVENTION,
        "steering": steering or [],
        **details,
        "captures": captures,
    }
    return {METADATA_KEY: json.dumps(document, ensure_ascii=False)}


# ---------------------------------------------------------------------------------------
# Reading


@dataclass
class CapturedPrompt:
    """One prompt's capture: `activations` float32 `[layers, tokens, hidden]`, `token_ids`
    int32 `[tokens]` (-1: unknown), and per position its token string and whether it is
    part of the prompt."""

    index: int
    activations: np.ndarray
    token_ids: np.ndarray
    layers: list[int] | None
    token_strings: list[str | None] | None
    prompt_length: int | None
    request_id: str | None

    def layer(self, layer: int) -> np.ndarray:
        """The `[tokens, hidden]` output of decoder block `layer`."""
        if self.layers is None:
            raise KeyError("This file does not say which layers it holds; index activations.")
        if layer not in self.layers:
            raise KeyError(f"Layer {layer} was not captured; the file has {self.layers}.")
        return self.activations[self.layers.index(layer)]

    @property
    def is_prompt(self) -> np.ndarray:
        """Boolean `[tokens]`: True at the prompt's positions, False at generated ones."""
        positions = np.arange(self.activations.shape[1])
        length = positions.size if self.prompt_length is None else self.prompt_length
        return positions < length


@dataclass
class ActivationsFile:
    """A loaded download: the header's metadata and the captures in index order."""

    metadata: dict
    captures: list[CapturedPrompt] = field(default_factory=list)

    @property
    def model(self) -> str | None:
        return self.metadata.get("model")

    @property
    def layers(self) -> list[int] | None:
        return self.metadata.get("layers")

    @property
    def steering(self) -> list[dict]:
        return self.metadata.get("steering") or []


def _read_bytes(source) -> bytes:
    if isinstance(source, bytes | bytearray | memoryview):
        return bytes(source)
    with open(os.fspath(source), "rb") as file:
        return file.read()


def _header(content: bytes) -> tuple[dict, int]:
    if len(content) < 8:
        raise ValueError("Not a safetensors file: it is shorter than its 8-byte header length.")
    (length,) = struct.unpack("<Q", content[:8])
    if length > min(MAX_HEADER_BYTES, len(content) - 8):
        raise ValueError(f"Not a safetensors file: its header claims {length} bytes.")
    return json.loads(content[8 : 8 + length]), 8 + length


def _tensor(content: bytes, start: int, name: str, entry: dict) -> np.ndarray:
    dtype = _DTYPES.get(entry["dtype"])
    if dtype is None:
        raise ValueError(f"Tensor {name} has dtype {entry['dtype']}, which this loader lacks.")
    begin, end = entry["data_offsets"]
    shape = tuple(entry["shape"])
    if end - begin != int(np.prod(shape)) * dtype.itemsize or start + end > len(content):
        raise ValueError(f"Tensor {name}: its data does not match its shape {list(shape)}.")
    count = int(np.prod(shape))
    array = np.frombuffer(content, dtype=dtype, count=count, offset=start + begin).reshape(shape)
    if entry["dtype"] == "BF16":
        # bfloat16 is the top half of a float32: widening is exact.
        return (array.astype(np.uint32) << 16).view(np.float32)
    return array.astype(dtype.newbyteorder("="))


def load_activations(source) -> ActivationsFile:
    """Load a run's activation download or a harvest shard (a path or the file's bytes)."""
    content = _read_bytes(source)
    header, start = _header(content)
    raw = (header.get("__metadata__") or {}).get(METADATA_KEY)
    metadata = json.loads(raw) if raw else {}
    described = {entry["index"]: entry for entry in metadata.get("captures") or []}
    indices = sorted(
        int(name.removeprefix("prompt_"))
        for name in header
        if name.startswith("prompt_") and name.removeprefix("prompt_").isdigit()
    )
    loaded = ActivationsFile(metadata=metadata)
    for index in indices:
        entry = described.get(index, {})
        activations = _tensor(content, start, f"prompt_{index}", header[f"prompt_{index}"])
        tokens_entry = header.get(f"tokens_{index}")
        token_ids = (
            _tensor(content, start, f"tokens_{index}", tokens_entry).astype(np.int32)
            if tokens_entry
            else np.full(activations.shape[1], UNKNOWN_TOKEN_ID, dtype=np.int32)
        )
        loaded.captures.append(
            CapturedPrompt(
                index=index,
                activations=activations,
                token_ids=token_ids,
                layers=metadata.get("layers"),
                token_strings=entry.get("token_strings"),
                prompt_length=entry.get("prompt_length"),
                request_id=entry.get("request_id"),
            )
        )
    return loaded


def load_tensors(source) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file (a path or its bytes) by name, bfloat16 widened to
    float32: e.g. a harvest's `stats.safetensors` (per layer `mean`, `std` [layers, hidden],
    `norm_mean` [layers], and `positions`, the count they were computed over)."""
    content = _read_bytes(source)
    header, start = _header(content)
    return {
        name: _tensor(content, start, name, entry)
        for name, entry in header.items()
        if name != "__metadata__"
    }


@dataclass
class HarvestDownload:
    """A harvest job's files in `directory`: `manifest.json` (model, layers, shards),
    the shards and the stats file, as `AcsClient.download_harvest` writes them."""

    directory: Path
    manifest: dict

    @classmethod
    def open(cls, directory) -> "HarvestDownload":
        """The files of a harvest downloaded earlier into `directory`."""
        directory = Path(directory)
        return cls(directory, json.loads((directory / MANIFEST_NAME).read_text()))

    @property
    def shard_paths(self) -> list[Path]:
        return [self.directory / shard["name"] for shard in self.manifest["shards"]]

    @property
    def stats_path(self) -> Path:
        return self.directory / self.manifest["stats"]["name"]

    def shards(self) -> list[ActivationsFile]:
        """Each shard loaded with its metadata, in the manifest's order."""
        return [load_activations(path) for path in self.shard_paths]

    def captures(self) -> list[CapturedPrompt]:
        """Every prompt's capture, in prompt order."""
        return [capture for shard in self.shards() for capture in shard.captures]

    def stats(self) -> dict[str, np.ndarray]:
        return load_tensors(self.stats_path)


def describe(download: ActivationsFile) -> str:
    """A few lines a person can read: the file's model, layers and steering, and each
    capture's shape and tokens."""
    lines = [
        f"{download.metadata.get('kind', 'activations')} of {download.model or 'unknown model'}"
        f", layers {download.layers}, {download.metadata.get('capture', '')}",
        f"steering: {json.dumps(download.steering) if download.steering else 'none'}",
    ]
    for capture in download.captures:
        strings = capture.token_strings or [None] * capture.activations.shape[1]
        parts = [
            f"{position}{'' if prompt else '*'}={token!r}"
            for position, (token, prompt) in enumerate(zip(strings, capture.is_prompt, strict=True))
        ]
        lines.append(
            f"capture {capture.index}: {list(capture.activations.shape)} float32, "
            f"prompt_length {capture.prompt_length}, request {capture.request_id}: "
            + " ".join(parts)
        )
    lines.append("(* marks generated positions)")
    return "\n".join(lines)


def main(paths: list[str]) -> None:
    for path in paths:
        print(f"{path}:\n{describe(load_activations(path))}")


if __name__ == "__main__":
    main(sys.argv[1:])
