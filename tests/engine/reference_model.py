"""An independent reference for the engine: transformers' own Llama forward pass in float32 on
the engine's weight directory, with forward hooks that add steering vectors to and read the
residual stream (the output of decoder block k, before the final norm).

Nothing here uses the engine's decoder, scheduler or hooks; only the weights are shared.
"""

from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

# CPU features that decide how the kernels round: printed with the suite's header and with
# every fidelity failure, so a failure says which kind of machine it came from.
ROUNDING_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512_bf16",
    "avx512_fp16",
    "amx_bf16",
    "amx_tile",
    "avx_vnni",
)


def cpu_description() -> str:
    """The CPU's model name and which of ROUNDING_FLAGS it has."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "CPU unknown (no /proc/cpuinfo)"
    flags = set(text.split())
    model = next(
        (line.split(":", 1)[1].strip() for line in text.splitlines() if "model name" in line),
        "unknown model",
    )
    present = [flag for flag in ROUNDING_FLAGS if flag in flags] or ["none of them"]
    return f"{model}; flags {' '.join(present)}"


@dataclass(frozen=True)
class Steering:
    """One steering vector as the API takes it: row i of `vector` [layers, hidden] or
    [layers, positions, hidden] is added, times `scale`, to the output of block `layers[i]`
    at every position or at `positions`; with `norm_match` first rescaled to the state's norm."""

    vector: np.ndarray
    layers: tuple[int, ...]
    scale: float = 1.0
    norm_match: bool = False
    positions: tuple[int, ...] | None = None


@dataclass
class ReferenceRun:
    """One forward pass: next-token logprobs [tokens, vocab] (float32) and the residual stream
    of the captured layers, {layer: [tokens, hidden]} (float32)."""

    logprobs: torch.Tensor
    rows: dict[int, np.ndarray] = field(default_factory=dict)


class ReferenceModel:
    def __init__(self, directory: Path):
        self.model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(directory)
        self._ids_of_string: dict[str, list[int]] = {}
        # Tokens that decode alone to an unfinished character: vLLM names them by context.
        self._byte_tokens: list[int] = []
        for token_id in range(self.model.config.vocab_size):
            string = self.tokenizer.decode([token_id])
            if string.endswith("\ufffd"):
                self._byte_tokens.append(token_id)
            else:
                self._ids_of_string.setdefault(string, []).append(token_id)
        self._byte_tokens_named: dict[tuple[int, ...], dict[str, list[int]]] = {}

    @property
    def blocks(self) -> torch.nn.ModuleList:
        return self.model.model.layers

    def tokenize(self, prompt: str) -> list[int]:
        return self.tokenizer(prompt)["input_ids"]

    def ids_of(self, string: str, context: list[int] | tuple[int, ...] = ()) -> list[int]:
        """The token ids named `string` in logprobs at a generated position after `context`
        (the tokens generated before it; usually one id): those that decode alone to it, and
        byte tokens that vLLM names so there (`vllm_name`); or the id of "token_id:N", as vLLM
        names tokens with `return_tokens_as_token_ids`."""
        if string.startswith("token_id:"):
            return [int(string.removeprefix("token_id:"))]
        named = self._byte_tokens_after(tuple(context[-4:]))
        return self._ids_of_string.get(string, []) + named.get(string, [])

    def _byte_tokens_after(self, context: tuple[int, ...]) -> dict[str, list[int]]:
        """The byte tokens by their name after `context`, computed once per context."""
        if context not in self._byte_tokens_named:
            named: dict[str, list[int]] = {}
            for token_id in self._byte_tokens:
                named.setdefault(self.vllm_name(token_id, list(context)), []).append(token_id)
            self._byte_tokens_named[context] = named
        return self._byte_tokens_named[context]

    def vllm_name(self, token_id: int, context_token_ids: list[int]) -> str:
        """vLLM 0.32's name of a byte token after the tokens chosen before it: its
        `LogprobsProcessor._correct_decoded_token` (vllm/v1/engine/logprobs.py), transcribed."""
        decode = self.tokenizer.decode
        max_ctx = min(len(context_token_ids), 4)
        for num_ctx in range(1, max_ctx + 1):
            context = context_token_ids[-num_ctx:]
            full_decoded = decode([*context, token_id])
            if full_decoded.endswith("\ufffd"):
                continue
            clean_end = len(context)
            for j in range(len(context) - 1, -1, -1):
                if decode([context[j]]).endswith("\ufffd"):
                    clean_end = j
                else:
                    break
            clean_prefix = decode(context[:clean_end]) if clean_end > 0 else ""
            if full_decoded.startswith(clean_prefix):
                return full_decoded[len(clean_prefix) :]
            common_len = 0
            for a, b in zip(clean_prefix, full_decoded, strict=False):
                if a != b:
                    break
                common_len += 1
            return full_decoded[common_len:]
        return ""

    def run(
        self, ids: list[int], steering: list[Steering] = (), capture: list[int] = ()
    ) -> ReferenceRun:
        """Forward `ids` with `steering` added and the blocks in `capture` read after it."""
        rows: dict[int, np.ndarray] = {}
        handles = [
            self.blocks[layer].register_forward_hook(self._block_hook(layer, steering, rows))
            for layer in sorted(set(capture) | {layer for s in steering for layer in s.layers})
        ]
        try:
            with torch.inference_mode():
                logits = self.model(torch.tensor([ids])).logits[0].float()
        finally:
            for handle in handles:
                handle.remove()
        return ReferenceRun(
            torch.log_softmax(logits, dim=-1), {k: v for k, v in rows.items() if k in capture}
        )

    def token_ids(
        self, prompt_ids: list[int], strings: list[str], steering: list[Steering] = ()
    ) -> list[int]:
        """The ids of generated tokens given as their names in logprobs: a name several ids
        have there is the one the reference finds likeliest after the tokens before it."""
        ids = list(prompt_ids)
        for string in strings:
            candidates = self.ids_of(string, ids[len(prompt_ids) :])
            if len(candidates) != 1:
                assert candidates, f"no token decodes to {string!r}"
                last = self.run(ids, steering).logprobs[-1]
                candidates = [max(candidates, key=lambda i: float(last[i]))]
            ids.append(candidates[0])
        return ids[len(prompt_ids) :]

    @staticmethod
    def _block_hook(layer: int, steering: list[Steering], rows: dict[int, np.ndarray]):
        def hook(module, args, output):
            hidden = output[0] if isinstance(output, tuple) else output
            state = hidden[0].float().clone()
            for addition in steering:
                for index, steered_layer in enumerate(addition.layers):
                    if steered_layer == layer:
                        state = _steered(state, addition, index)
            rows[layer] = state.numpy().copy()
            steered = state[None].to(hidden.dtype)
            return (steered, *output[1:]) if isinstance(output, tuple) else steered

        return hook

    @contextmanager
    def without_final_norm(self):
        """A defect: logits from the residual stream without the final RMSNorm."""
        norm = self.model.model.norm
        self.model.model.norm = torch.nn.Identity()
        try:
            yield
        finally:
            self.model.model.norm = norm

    @contextmanager
    def rotary_base(self, base: float):
        """A defect: rotary embeddings computed with another base (theta)."""
        rotary = self.model.model.rotary_emb
        original = rotary.inv_freq.clone()
        dim = original.shape[0] * 2
        rotary.inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        try:
            yield
        finally:
            rotary.inv_freq = original


def _steered(state: torch.Tensor, addition: Steering, index: int) -> torch.Tensor:
    """`state` [tokens, hidden] with row `index` of the vector added as the API defines it."""
    vector = torch.from_numpy(np.asarray(addition.vector[index], dtype=np.float32))
    if addition.positions is None:
        targets = list(range(state.shape[0]))
        vectors = vector.expand(len(targets), -1)
    else:
        pairs = [(p, i) for i, p in enumerate(addition.positions) if p < state.shape[0]]
        targets = [p for p, _ in pairs]
        vectors = vector if vector.ndim == 1 else vector[[i for _, i in pairs]]
        vectors = vectors.expand(len(targets), -1)
    if addition.norm_match:
        vectors = (
            vectors / vectors.norm(dim=-1, keepdim=True) * state[targets].norm(dim=-1, keepdim=True)
        )
    state = state.clone()
    state[targets] = state[targets] + addition.scale * vectors
    return state
