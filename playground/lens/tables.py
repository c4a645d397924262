"""The logit lens and direct logit attribution of a captured residual stream: numpy on the
model's final norm and unembedding, read from its weights directory. No Django: the engine
suite's fidelity tests run this very code against transformers' float32 model.

Where it runs, and why. The capture already holds everything but two matrices, the final
RMSNorm's weight and the unembedding, which are files of the model's directory
(`LanguageModel.weights_dir`). So the playground's worker computes the lens itself, once per
capture run, just before it stores the run (`services.lens.run_lens_compute`): the costly part
is the product [layers × positions, hidden] · [hidden, vocabulary], 2 × 390 × 576 × 49,152
≈ 22 GFLOP for 30 layers × 13 positions. Measured on this project's 2-core machine (Intel
Xeon with AMX, numpy 2.5 on OpenBLAS, float32): 0.64 s for those 390 rows (0.25 s the
product, the rest the log-normaliser and the top tokens), 1.0 s for 30 × 20, 3.7 s for
30 × 64 (LENS_MAX_POSITIONS), and 1.1 s to load the weights once per process: too slow for
every page view and every pick of a target. The web process then computes what a page picks
from the stored lens and the captured rows: a target's logprob (one dot product per cell
against the stored log-normaliser), its rank by layer at one position (30 rows of logits,
0.07 s) and the attribution (a few hundred products). Not the upstream:
vLLM-Lens runs no code a request brings (a user's request never uploads code), and the lens
needs nothing of it beyond the capture the API already returns.
"""

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors import deserialize
from tokenizers import Tokenizer

# The tokens the lens keeps per layer × position, most likely first.
LENS_TOP = 5
# The lens covers at most this many positions: the last ones of the capture (the product
# grows with them; 30 layers × 64 positions took 3.7 s here).
LENS_MAX_POSITIONS = 64
# How far (nats) a logit difference the upstream reported may be from the lens's of its
# captured rows: the bound tests/tolerances.py gives an engine computing in bfloat16, which
# rounds every matmul to 8 significant bits (the captured rows are bfloat16 too).
RESIDUE_BOUND = 0.5
# Rows of logits computed at once: 256 × 49,152 float32 values are 50 MB.
CHUNK_ROWS = 256

NORM_WEIGHT = "model.norm.weight"
EMBEDDING = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"


class LensUnavailable(Exception):
    """The model's weights cannot be read; the message says why, for the page."""


class NotOneToken(ValueError):
    """A target text that the model's tokenizer does not read as exactly one token."""


@dataclass(frozen=True)
class LensWeights:
    """What the lens needs of a model: the final RMSNorm's weight (float32 [hidden]) and
    epsilon, the unembedding (float32 [vocabulary, hidden]: row t gives token t's logit), the
    number of decoder blocks, and the tokenizer."""

    norm_weight: np.ndarray
    eps: float
    unembedding: np.ndarray
    n_layers: int
    tokenizer: Tokenizer

    def inverse_rms(self, rows: np.ndarray) -> np.ndarray:
        """1 / RMS of each row [..., hidden] as the final norm computes it (epsilon inside
        the root), keeping the last axis (size 1)."""
        return 1.0 / np.sqrt(np.mean(rows * rows, axis=-1, keepdims=True) + self.eps)

    def normed(self, rows: np.ndarray) -> np.ndarray:
        """Rows [..., hidden] through the final norm, in float32."""
        rows = rows.astype(np.float32, copy=False)
        return rows * self.inverse_rms(rows) * self.norm_weight

    def logits(self, rows: np.ndarray) -> np.ndarray:
        """The logits [..., vocabulary] of residual rows [..., hidden], in float32."""
        return self.normed(rows) @ self.unembedding.T

    def token_string(self, token_id: int) -> str:
        """Token `token_id` decoded alone, as the API names tokens."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def token_id(self, text: str) -> int:
        """The one token `text` is (NotOneToken otherwise)."""
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if len(ids) != 1:
            pieces = " ".join(repr(self.token_string(i)) for i in ids[:8])
            raise NotOneToken(
                f"{text!r} is {len(ids)} tokens for this model{f' ({pieces})' if ids else ''}; "
                "give exactly one."
            )
        return ids[0]


def lens_weights(directory: str) -> LensWeights:
    """The model's lens weights from its directory (config.json, model.safetensors,
    tokenizer.json), loaded once per process and again only when model.safetensors changes;
    LensUnavailable saying why when they cannot be read. The first load reads the whole
    file (~1 s and twice its size in memory for SmolLM2-135M's 270 MB); the process then
    keeps ~115 MB per model."""
    path = Path(directory) / "model.safetensors"
    try:
        modified = path.stat().st_mtime_ns
    except OSError as error:
        raise LensUnavailable(
            f"The weights file {path} cannot be read: {error.strerror}."
        ) from None
    return _load(str(Path(directory)), modified)


@functools.lru_cache(maxsize=2)
def _load(directory: str, modified: int) -> LensWeights:
    folder = Path(directory)
    try:
        config = json.loads((folder / "config.json").read_text())
        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        tensors = _tensors(folder / "model.safetensors", {NORM_WEIGHT, EMBEDDING, LM_HEAD})
    except Exception as error:  # a missing file, bad JSON, a broken safetensors file, ...
        raise LensUnavailable(f"The weights in {folder} cannot be read: {error}") from None
    unembedding = tensors.get(LM_HEAD)
    if unembedding is None and config.get("tie_word_embeddings"):
        unembedding = tensors.get(EMBEDDING)
    if unembedding is None or NORM_WEIGHT not in tensors or "rms_norm_eps" not in config:
        raise LensUnavailable(
            f"{folder} has no {LM_HEAD} (nor a tied {EMBEDDING}), {NORM_WEIGHT} or "
            "rms_norm_eps: the lens reads Llama-style checkpoints."
        )
    return LensWeights(
        norm_weight=tensors[NORM_WEIGHT],
        eps=float(config["rms_norm_eps"]),
        unembedding=unembedding,
        n_layers=int(config["num_hidden_layers"]),
        tokenizer=tokenizer,
    )


def _tensors(path: Path, names: set[str]) -> dict[str, np.ndarray]:
    """The tensors of a safetensors file named in `names`, as float32 (bfloat16 and float16
    widened exactly)."""
    found = {}
    for name, entry in deserialize(path.read_bytes()):
        if name not in names:
            continue
        data, shape = entry["data"], entry["shape"]
        if entry["dtype"] == "BF16":
            # bfloat16 is the top half of a float32.
            array = (np.frombuffer(data, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        elif entry["dtype"] == "F16":
            array = np.frombuffer(data, dtype="<f2").astype(np.float32)
        elif entry["dtype"] == "F32":
            array = np.frombuffer(data, dtype="<f4").astype(np.float32)
        else:
            raise ValueError(f"{name} is {entry['dtype']}, which the lens does not read")
        found[name] = array.reshape(shape)
    return found


# ---------------------------------------------------------------------------------------
# The lens


@dataclass(frozen=True)
class LensTable:
    """The lens of positions `first`.. of a capture at each captured layer: the LENS_TOP most
    likely tokens (`top_ids` int [layers, positions, LENS_TOP]) and their logprobs
    (`top_logprobs`, nats), and the log-normaliser log Σ exp(logits) (`log_normaliser`
    [layers, positions]) that turns any token's logit there into its logprob."""

    layers: list[int]
    first: int
    top_ids: np.ndarray
    top_logprobs: np.ndarray
    log_normaliser: np.ndarray

    @property
    def positions(self) -> list[int]:
        return list(range(self.first, self.first + self.top_ids.shape[1]))

    def to_json(self) -> dict:
        """A compact JSON document (`Run.lens`); logprobs to 1e-4 nats."""
        return {
            "layers": self.layers,
            "first": self.first,
            "top_ids": self.top_ids.tolist(),
            "top_logprobs": np.round(self.top_logprobs.astype(np.float64), 4).tolist(),
            "log_normaliser": np.round(self.log_normaliser.astype(np.float64), 4).tolist(),
        }

    @classmethod
    def from_json(cls, document: dict) -> "LensTable":
        return cls(
            layers=list(document["layers"]),
            first=int(document["first"]),
            top_ids=np.asarray(document["top_ids"], dtype=np.int64),
            top_logprobs=np.asarray(document["top_logprobs"], dtype=np.float32),
            log_normaliser=np.asarray(document["log_normaliser"], dtype=np.float32),
        )


def lens_table(tensor: np.ndarray, layers: list[int], weights: LensWeights) -> LensTable:
    """The lens of a capture `tensor` [layers, tokens, hidden] (row k of it the output of
    block `layers[k]`): each row through the final norm and the unembedding, at the last
    LENS_MAX_POSITIONS positions."""
    first = max(0, tensor.shape[1] - LENS_MAX_POSITIONS)
    rows = tensor[:, first:, :]
    flat = rows.reshape(-1, rows.shape[-1])
    ids, logprobs, normalisers = [], [], []
    for start in range(0, flat.shape[0], CHUNK_ROWS):
        logits = weights.logits(flat[start : start + CHUNK_ROWS])
        normaliser = log_sum_exp(logits)
        top = np.argpartition(logits, -LENS_TOP, axis=-1)[:, -LENS_TOP:]
        order = np.argsort(-np.take_along_axis(logits, top, axis=-1), axis=-1, kind="stable")
        top = np.take_along_axis(top, order, axis=-1)
        ids.append(top)
        logprobs.append(np.take_along_axis(logits, top, axis=-1) - normaliser[:, None])
        normalisers.append(normaliser)
    shape = rows.shape[:2]
    return LensTable(
        layers=list(layers),
        first=first,
        top_ids=np.concatenate(ids).reshape(*shape, LENS_TOP),
        top_logprobs=np.concatenate(logprobs).reshape(*shape, LENS_TOP),
        log_normaliser=np.concatenate(normalisers).reshape(shape),
    )


def log_sum_exp(logits: np.ndarray) -> np.ndarray:
    """log Σ exp over the last axis, without overflow."""
    peak = logits.max(axis=-1)
    return peak + np.log(np.exp(logits - peak[..., None]).sum(axis=-1))


def token_logprobs(
    rows: np.ndarray, log_normaliser: np.ndarray, weights: LensWeights, token_ids: np.ndarray
) -> np.ndarray:
    """The lens logprob of one token per position: `rows` [layers, positions, hidden] of the
    capture, `log_normaliser` [layers, positions] of the LensTable at those positions, and
    `token_ids` [positions] (the token at each; -1 where none: NaN there)."""
    known = token_ids >= 0
    vectors = weights.unembedding[np.where(known, token_ids, 0)]
    logits = np.einsum("lph,ph->lp", weights.normed(rows), vectors)
    return np.where(known[None, :], logits - log_normaliser, np.nan)


def token_ranks(rows: np.ndarray, weights: LensWeights, token_id: int) -> np.ndarray:
    """The rank (1: the most likely) of `token_id` in the lens of each row [layers, hidden]
    of one position; tokens with an equal logit do not count against it."""
    logits = weights.logits(rows)
    return 1 + (logits > logits[:, token_id : token_id + 1]).sum(axis=-1)


# ---------------------------------------------------------------------------------------
# Direct logit attribution


def direct_logit_attribution(
    rows: np.ndarray, weights: LensWeights, target: int, foil: int | None = None
) -> np.ndarray:
    """Each block's contribution (nats) to the logit of `target`, or to logit(target) −
    logit(foil), at one position, from `rows` [n_layers, hidden]: the output of every block
    there, in order. Block k contributes (h_k − h_{k−1}) through the final norm's scale at
    that position (its weight over the RMS of the last block's row, treated as fixed) dotted
    with the unembedding row(s); block 0's h_{−1} is zero, so its share includes the
    embedding (which is not captured). The contributions sum to the lens's logit (difference)
    at the last layer. Computed in float64."""
    rows = rows.astype(np.float64)
    deltas = np.diff(rows, axis=0, prepend=np.zeros_like(rows[:1]))
    scale = weights.norm_weight.astype(np.float64) * weights.inverse_rms(rows[-1])
    direction = weights.unembedding[target].astype(np.float64)
    if foil is not None:
        direction = direction - weights.unembedding[foil]
    return (deltas * scale) @ direction
