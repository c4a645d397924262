"""The native decode step (engine/csrc/decode.c): built once per machine, called by ctypes.

The C file is compiled with the machine's C compiler (`CC`, default `cc`) the first time an
engine needs it (~1 s), into `$XDG_CACHE_HOME/acs-engine/native` (`~/.cache` by default) under
a name made of the source's and flags' hash, so an edited file is rebuilt and processes started
together never load a half-written library.
It needs an x86-64 CPU with AVX2, FMA and F16C (torch's CPU capability AVX2 or AVX512); where
it cannot be built or run, `library()` is None and the decoder keeps its PyTorch path.

Its OpenMP runtime is the one torch already loaded (the same `libgomp.so.1`), so its threads are
torch's threads; every call is told how many to use.
"""

import ctypes
import functools
import hashlib
import logging
import os
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("csrc") / "decode.c"
# Rows and columns of a packed block (decode.c's BLOCK).
BLOCK = 8
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC"]

log = logging.getLogger(__name__)


class Layer(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_void_p)
        for name in ("qkv", "o", "gate_up", "down", "input_norm", "post_norm")
    ]


class Model(ctypes.Structure):
    _fields_ = [
        *(
            (name, ctypes.c_long)
            for name in ("hidden", "heads", "kv_heads", "head_dim", "intermediate")
        ),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("layers", ctypes.POINTER(Layer)),
        ("cos", ctypes.c_void_p),
        ("sin", ctypes.c_void_p),
    ]


class Step(ctypes.Structure):
    _fields_ = [
        ("hidden", ctypes.c_void_p),
        ("rows", ctypes.c_long),
        ("positions", ctypes.c_void_p),
        ("mask", ctypes.c_void_p),
        ("columns", ctypes.c_long),
        ("keys", ctypes.c_void_p),
        ("values", ctypes.c_void_p),
        ("layer_stride", ctypes.c_long),
        ("row_stride", ctypes.c_long),
        ("head_stride", ctypes.c_long),
        ("cache_bfloat16", ctypes.c_int),
        ("scratch", ctypes.c_void_p),
        ("threads", ctypes.c_int),
    ]


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built library, or None where this CPU or machine cannot run it."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None
    try:
        native = ctypes.CDLL(str(_built_library()))
    except subprocess.CalledProcessError as error:
        reason = error.stderr.decode(errors="replace").strip() or error
        log.warning("native decode step did not build, decoding with PyTorch: %s", reason)
        return None
    except OSError as error:
        log.warning("native decode step unavailable, decoding with PyTorch: %s", error)
        return None
    native.decode_layers.argtypes = [
        ctypes.POINTER(Model),
        ctypes.POINTER(Step),
        ctypes.c_long,
        ctypes.c_long,
    ]
    native.decode_scratch_floats.argtypes = [ctypes.POINTER(Model), ctypes.c_long, ctypes.c_long]
    native.decode_scratch_floats.restype = ctypes.c_long
    return native


def _built_library() -> Path:
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source + " ".join(FLAGS).encode()).hexdigest()[:16]
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    directory = Path(cache) / "acs-engine" / "native"
    path = directory / f"decode-{digest}.so"
    if path.exists():
        return path
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as scratch:
        built = Path(scratch) / path.name
        compiler = os.environ.get("CC", "cc")
        subprocess.run(
            [compiler, *FLAGS, str(SOURCE), "-o", str(built)],
            check=True,
            capture_output=True,
        )
        os.replace(built, path)
    # Builds of earlier versions of the file (a running engine keeps its loaded copy).
    for stale in directory.glob("decode-*.so"):
        if stale != path:
            stale.unlink(missing_ok=True)
    return path


def packable(weight: torch.Tensor) -> bool:
    return weight.ndim == 2 and weight.shape[0] % BLOCK == 0 and weight.shape[1] % BLOCK == 0


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [n, k] as float16 in decode.c's packed layout [n/8][k/8][8][8]."""
    n, k = weight.shape
    blocks = weight.detach().half().view(n // BLOCK, BLOCK, k // BLOCK, BLOCK)
    return blocks.permute(0, 2, 1, 3).contiguous()


class DecodeLayers:
    """decode.c's layers of a `LlamaDecoder` whose Linear matrices are packed for it. It
    computes in float32 whatever the decoder's dtype: a bfloat16 decoder's norm weights and
    RoPE tables (bfloat16 values) are copied as float32, and its cache stays bfloat16."""

    def __init__(self, decoder):
        self.layers = (Layer * len(decoder.layers))()
        # float32 copies (or the tensors themselves), kept alive here for the pointers.
        self.norms = []
        for slot, layer in zip(self.layers, decoder.layers, strict=True):
            for name in ("qkv", "o", "gate_up", "down"):
                setattr(slot, name, getattr(layer, name).native.data_ptr())
            norms = (layer.input_norm, layer.post_norm)
            input_norm, post_norm = (norm.float().contiguous() for norm in norms)
            self.norms += [input_norm, post_norm]
            slot.input_norm, slot.post_norm = input_norm.data_ptr(), post_norm.data_ptr()
        self.cos, self.sin = decoder.cos.float().contiguous(), decoder.sin.float().contiguous()
        self.model = Model(
            hidden=decoder.hidden_size,
            heads=decoder.heads,
            kv_heads=decoder.kv_heads,
            head_dim=decoder.head_dim,
            intermediate=decoder.layers[0].down.weight.shape[1],
            eps=decoder.eps,
            scale=decoder.scale,
            layers=self.layers,
            cos=self.cos.data_ptr(),
            sin=self.sin.data_ptr(),
        )

    def step(self, hidden, positions, mask, cache) -> "Step":
        """The Step that runs layers over `hidden` [rows, 1, hidden] (float32 whatever the
        decoder's dtype, contiguous, changed in place) at `positions` [rows] (int64), attending
        to `mask` [rows, columns] (bool; None if every column is real), with this step's keys
        and values written to `cache` column `columns - 1`. It keeps its tensors alive."""
        rows, columns = hidden.shape[0], cache.length + 1
        if cache.keys.stride() != cache.values.stride() or not cache.keys.is_contiguous():
            raise ValueError("decode.c reads a contiguous cache, keys and values alike")
        if cache.keys.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"decode.c reads no {cache.keys.dtype} cache")
        # decode.c indexes these without bounds checks.
        if mask is not None and mask.shape != (rows, columns):
            raise ValueError(f"mask {tuple(mask.shape)} for {rows} rows of {columns} columns")
        if positions.shape != (rows,) or int(positions.max()) >= self.cos.shape[0]:
            table = self.cos.shape[0]
            raise ValueError(f"positions {positions.tolist()} for {rows} rows, table of {table}")
        scratch_floats = library().decode_scratch_floats(ctypes.byref(self.model), rows, columns)
        scratch = torch.empty(scratch_floats, dtype=torch.float32)
        layer_stride, row_stride, head_stride = cache.keys.stride()[:3]
        step = Step(
            hidden=hidden.data_ptr(),
            rows=rows,
            positions=positions.data_ptr(),
            mask=None if mask is None else mask.data_ptr(),
            columns=columns,
            keys=cache.keys.data_ptr(),
            values=cache.values.data_ptr(),
            layer_stride=layer_stride,
            row_stride=row_stride,
            head_stride=head_stride,
            cache_bfloat16=cache.keys.dtype == torch.bfloat16,
            scratch=scratch.data_ptr(),
            threads=torch.get_num_threads(),
        )
        step.keep_alive = (hidden, positions, mask, cache.keys, cache.values, scratch)
        return step

    def run(self, step: "Step", first: int, last: int) -> None:
        """Layers [first, last) of `step`."""
        library().decode_layers(ctypes.byref(self.model), ctypes.byref(step), first, last)
