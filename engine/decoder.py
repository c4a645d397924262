"""A compact forward pass of the Llama decoder stack (SmolLM2), with a preallocated KV cache.

It computes what transformers' `LlamaModel` computes, op for op in the same dtype, in far fewer
dispatched ops: one matmul for Q, K and V, one for gate and up, RMSNorm as one fused op, RoPE
from a precomputed table, keys and values written in place into spare cache columns instead of
concatenated each step. A decode step of this 135M model is bound by per-op overhead, not by
arithmetic (see docs/engine.md, "Where a decode step's time goes"), so fewer ops is what makes
it fast. The transformers model keeps its weights: the fused matrices are the same storage.
Decode steps of up to `plan.native_rows` rows run the same layers in C where the machine can
and the load-time measurement found it faster (engine/native.py, docs/engine.md "Compute
dtype").
"""

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine import native
from engine.kernels import KernelPlan, Linear, fastest_times, half_weights_exact, measure_plan

# Columns of spare KV cache room added whenever a forward pass needs more than is left: a
# decode step then writes in place, and the buffers are reallocated once every this many steps.
CACHE_GROWTH_COLUMNS = 64

# Row counts of the decode steps timed at load, natively and in PyTorch: single-stream, small
# and moderate batches and the engine's default ACS_ENGINE_MAX_ACTIVE. Where bfloat16 is
# multiplied by AMX, PyTorch overtakes the native step between 8 and 16 rows (8.6 against 20.2
# ms at 1 row, 24.9 against 27.0 at 8, 42.8 against 29.0 at 16), so 4 and 8 are measured too.
NATIVE_ROW_COUNTS = (1, 4, 8, 16, 64)
# Columns already cached in those timed steps: a short prompt's.
NATIVE_MEASURED_COLUMNS = 32

LayerHook = Callable[[torch.Tensor], None]


class KVCache:
    """Keys and values of every layer for a batch of left-padded rows, in buffers
    [layers, rows, kv_heads, capacity, head_dim] of which the first `length` columns are used."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int):
        self.keys, self.values, self.length = keys, values, length

    @classmethod
    def empty(cls, decoder: "LlamaDecoder", rows: int) -> "KVCache":
        keys = decoder.new_cache_buffer(rows, CACHE_GROWTH_COLUMNS)
        return cls(keys, torch.empty_like(keys), 0)

    @property
    def rows(self) -> int:
        return self.keys.shape[1]

    def reserve(self, columns: int) -> None:
        """Make room for `columns` more columns, growing the buffers if needed."""
        if self.length + columns > self.keys.shape[3]:
            self._resize(self.length + columns + CACHE_GROWTH_COLUMNS, rows=None, first_column=0)

    def keep_rows(self, index: torch.Tensor, first_column: int) -> None:
        """Keep rows `index` (in that order) and the used columns from `first_column` on."""
        self._resize(self.keys.shape[3] - first_column, rows=index, first_column=first_column)

    def repeat_rows(self, counts: torch.Tensor) -> None:
        """Repeat row i counts[i] times (a prompt's n samples)."""
        self.keep_rows(torch.arange(self.rows).repeat_interleave(counts), first_column=0)

    def append_rows(self, other: "KVCache") -> None:
        """Add `other`'s rows below these, left-padding the shorter one with zero columns."""
        length = max(self.length, other.length)
        layers, _, kv_heads, _, head_dim = self.keys.shape
        shape = (layers, self.rows + other.rows, kv_heads, length + CACHE_GROWTH_COLUMNS, head_dim)
        keys, values = self.keys.new_zeros(shape), self.values.new_zeros(shape)
        for merged, mine, theirs in (
            (keys, self.keys, other.keys),
            (values, self.values, other.values),
        ):
            merged[:, : self.rows, :, length - self.length : length] = mine[:, :, :, : self.length]
            merged[:, self.rows :, :, length - other.length : length] = theirs[
                :, :, :, : other.length
            ]
        self.keys, self.values, self.length = keys, values, length

    def layer(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of one layer's keys and values [rows, kv_heads, end, head_dim]."""
        return self.keys[layer, :, :, :end], self.values[layer, :, :, :end]

    def _resize(self, capacity: int, rows: torch.Tensor | None, first_column: int) -> None:
        used = self.length - first_column
        resized = []
        for buffer in (self.keys, self.values):
            kept = buffer[:, :, :, first_column : self.length]
            if rows is not None:
                kept = kept[:, rows.to(buffer.device)]
            new = buffer.new_empty(*kept.shape[:3], capacity, buffer.shape[4])
            new[:, :, :, :used] = kept
            resized.append(new)
        self.keys, self.values = resized
        self.length = used


class LlamaDecoder:
    """The decoder stack of a transformers `LlamaForCausalLM` in eval mode, as plain tensors."""

    def __init__(self, model: torch.nn.Module):
        config = model.config
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.hidden_size = config.hidden_size
        self.eps = config.rms_norm_eps
        self.scale = self.head_dim**-0.5
        self.embed = model.model.embed_tokens.weight
        self.final_norm = model.model.norm.weight
        layer_matrices = [_layer_matrices(layer) for layer in model.model.layers]
        self.plan = _kernel_plan(model, layer_matrices)
        # decode.c runs the layers only: the LM head keeps the compute dtype's kernels.
        self.lm_head = Linear(model.lm_head.weight, dataclasses.replace(self.plan, native_rows=0))
        self.layers = [
            _fused_layer(layer, matrices, self.plan)
            for layer, matrices in zip(model.model.layers, layer_matrices, strict=True)
        ]
        self.cos, self.sin = _rope_tables(
            model.model.rotary_emb, config.max_position_embeddings, self.dtype
        )
        self.native_layers = native.DecodeLayers(self) if self.plan.native_rows else None
        if self.native_layers is not None:
            rows = _measured_native_rows(self)
            self.plan = dataclasses.replace(self.plan, native_rows=rows)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def new_cache_buffer(self, rows: int, capacity: int) -> torch.Tensor:
        shape = (len(self.layers), rows, self.kv_heads, capacity, self.head_dim)
        return torch.empty(shape, dtype=self.dtype, device=self.device)

    def forward(
        self,
        input_ids: torch.Tensor,
        mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache: KVCache,
        hooks: dict[int, LayerHook],
    ) -> torch.Tensor:
        """Run `input_ids` [rows, tokens] (left-padded; `mask` [rows, cached + tokens] is 0 on
        padding) at `position_ids`, appending their keys and values to `cache`; `hooks[i]`
        reads and may change in place the residual stream [rows, tokens, hidden] after layer i.
        Returns the final normed hidden states [rows, tokens, hidden]."""
        rows, tokens = input_ids.shape
        if tokens == 1 and rows <= self.plan.native_rows:
            return self._native_forward(input_ids, mask, position_ids, cache, hooks)
        return self._torch_forward(input_ids, mask, position_ids, cache, hooks)

    def _torch_forward(self, input_ids, mask, position_ids, cache, hooks) -> torch.Tensor:
        """`forward` in PyTorch ops."""
        rows, tokens = input_ids.shape
        cache.reserve(tokens)
        start, end = cache.length, cache.length + tokens
        attention_mask = _attention_mask(mask, tokens)
        cos = self.cos[position_ids].unsqueeze(2)
        sin = self.sin[position_ids].unsqueeze(2)
        rotated_heads = self.heads + self.kv_heads
        hidden = F.embedding(input_ids, self.embed)
        for index, layer in enumerate(self.layers):
            qkv = layer.qkv(self._norm(hidden, layer.input_norm))
            qkv = qkv.view(rows, tokens, rotated_heads + self.kv_heads, self.head_dim)
            query_key = _rope(qkv[:, :, :rotated_heads], cos, sin).transpose(1, 2)
            cache.keys[index, :, :, start:end] = query_key[:, self.heads :]
            cache.values[index, :, :, start:end] = qkv[:, :, rotated_heads:].transpose(1, 2)
            keys, values = cache.layer(index, end)
            attention = self._attention(query_key[:, : self.heads], keys, values, attention_mask)
            attention = attention.transpose(1, 2).reshape(rows, tokens, -1)
            hidden = hidden + layer.o(attention)
            gate, up = layer.gate_up(self._norm(hidden, layer.post_norm)).chunk(2, -1)
            hidden = hidden + layer.down(F.silu(gate) * up)
            hook = hooks.get(index)
            if hook is not None:
                hook(hidden)
        cache.length = end
        return self._norm(hidden, self.final_norm)

    def _native_forward(self, input_ids, mask, position_ids, cache, hooks) -> torch.Tensor:
        """`forward` of one token per row by decode.c: its layers in runs between hooks."""
        cache.reserve(1)
        # float32 whatever the dtype: decode.c computes in float32 (see native.DecodeLayers).
        hidden = F.embedding(input_ids, self.embed).float().contiguous()
        padding = _attention_mask(mask, tokens=1)
        step = self.native_layers.step(
            hidden,
            position_ids.reshape(-1).to(torch.int64).contiguous(),
            None if padding is None else padding.reshape(mask.shape).contiguous(),
            cache,
        )
        first = 0
        for index in sorted(hooks):
            self.native_layers.run(step, first, index + 1)
            hooks[index](hidden)
            first = index + 1
        self.native_layers.run(step, first, len(self.layers))
        cache.length += 1
        # In the decoder's dtype, as `_torch_forward` returns it (the LM head's matrix may be
        # bfloat16).
        return self._norm(hidden.to(self.dtype), self.final_norm)

    def _attention(self, query, keys, values, mask: torch.Tensor | None) -> torch.Tensor:
        """Attention of `query` [rows, heads, tokens, head_dim] over the cached `keys` and
        `values` [rows, kv_heads, columns, head_dim], computed as transformers computes it (in
        bfloat16 another order of the same sums rounds differently): one query token under a
        padding mask attends with each key/value head's query heads as its queries."""
        rows, heads, tokens, _ = query.shape
        if tokens == 1 and mask is not None:
            grouped = query.reshape(rows, self.kv_heads, heads // self.kv_heads, self.head_dim)
            attention = F.scaled_dot_product_attention(
                grouped, keys, values, attn_mask=mask, scale=self.scale
            )
            return attention.reshape(rows, heads, 1, self.head_dim)
        return F.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, scale=self.scale, enable_gqa=True
        )

    def _norm(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Llama's RMSNorm: normalised in float32, rounded to the compute dtype, then scaled."""
        normed = F.rms_norm(hidden.float(), (self.hidden_size,), eps=self.eps)
        return weight * normed.to(hidden.dtype)


class _FusedLayer:
    def __init__(self, qkv, o, gate_up, down, input_norm, post_norm):
        self.qkv, self.o, self.gate_up, self.down = qkv, o, gate_up, down
        self.input_norm, self.post_norm = input_norm, post_norm


def _layer_matrices(layer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A layer's four weight matrices as the decoder multiplies by them (Q, K, V fused, gate
    and up fused)."""
    attention, mlp = layer.self_attn, layer.mlp
    return {
        "qkv": _fuse([attention.q_proj, attention.k_proj, attention.v_proj]),
        "o": attention.o_proj.weight,
        "gate_up": _fuse([mlp.gate_proj, mlp.up_proj]),
        "down": mlp.down_proj.weight,
    }


def _fused_layer(
    layer: torch.nn.Module, matrices: dict[str, torch.Tensor], plan: KernelPlan
) -> _FusedLayer:
    return _FusedLayer(
        **{name: Linear(matrix, plan) for name, matrix in matrices.items()},
        input_norm=layer.input_layernorm.weight,
        post_norm=layer.post_attention_layernorm.weight,
    )


def _fuse(linears: list[torch.nn.Linear]) -> torch.Tensor:
    """The Linear layers' weights stacked into one matrix; the layers then hold views of it, so
    the weights are not stored twice."""
    fused = torch.cat([linear.weight.detach() for linear in linears])
    start = 0
    for linear in linears:
        rows = linear.weight.shape[0]
        linear.weight.data = fused[start : start + rows]
        start += rows
    return fused


# The startup measurement reads the tied LM head and every third layer's matrices: ~64M of the
# 135M weights, several times any L3 cache of these CPUs in either kernel's dtype, so they
# stream from memory as a decode step's do, in half the time all 30 layers took (4 s of two
# cores at each model load).
MEASURED_LAYER_STEP = 3


def _kernel_plan(model: torch.nn.Module, layer_matrices: list[dict]) -> KernelPlan:
    """Measured on the model's own matrices (see MEASURED_LAYER_STEP) on a CPU; on CUDA every
    product uses the compute dtype's matmul."""
    if model.device.type != "cpu":
        return KernelPlan(half_rows=0)
    per_layer = [[matrix.detach() for matrix in layer.values()] for layer in layer_matrices]
    measured = [matrix for layer in per_layer[::MEASURED_LAYER_STEP] for matrix in layer]
    plan = measure_plan(
        [model.lm_head.weight.detach(), *measured],
        prefill_weights=per_layer[0],
        half=half_weights_exact(model),
    )
    matrices = [matrix for layer in per_layer for matrix in layer]
    return _with_native_decode(plan, model.dtype, matrices)


def _with_native_decode(plan: KernelPlan, dtype: torch.dtype, matrices: list) -> KernelPlan:
    """`plan`, with decode.c a candidate for decode steps of up to the largest of
    NATIVE_ROW_COUNTS rows where it can run these matrices (float16 exact, float32 or bfloat16)
    on this machine; the decoder then measures how many rows it should run."""
    if dtype not in (torch.float32, torch.bfloat16) or native.library() is None:
        return plan
    if not all(native.packable(matrix) for matrix in matrices):
        return plan
    return dataclasses.replace(plan, native_rows=max(NATIVE_ROW_COUNTS))


@torch.inference_mode()
def _measured_native_rows(decoder: LlamaDecoder) -> int:
    """The most rows of NATIVE_ROW_COUNTS up to which a native decode step beat the PyTorch
    one at every count measured (0: never), each pair timed by `kernels.fastest_times`."""
    native_rows = 0
    for rows in NATIVE_ROW_COUNTS:
        steps = [
            _timed_step(decoder, rows, step)
            for step in (decoder._native_forward, decoder._torch_forward)
        ]
        native_time, torch_time = fastest_times(steps)
        if native_time >= torch_time:
            break
        native_rows = rows
    return native_rows


def _timed_step(decoder: LlamaDecoder, rows: int, step: Callable) -> Callable[[], None]:
    """A decode step of `rows` rows by `step`, each call over a cache of
    NATIVE_MEASURED_COLUMNS columns (it writes the next column, the same at every call)."""
    columns = NATIVE_MEASURED_COLUMNS
    input_ids = torch.zeros(rows, 1, dtype=torch.long)
    mask = torch.ones(rows, columns + 1, dtype=torch.long)
    positions = torch.full((rows, 1), columns)
    keys = decoder.new_cache_buffer(rows, columns + CACHE_GROWTH_COLUMNS).zero_()
    values = torch.zeros_like(keys)

    def run() -> None:
        step(input_ids, mask, positions, KVCache(keys, values, columns), {})

    return run


def _rope_tables(
    rotary_emb: torch.nn.Module, positions: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [positions, head_dim] as transformers' LlamaRotaryEmbedding computes them
    (float32 angles, then the compute dtype), for every position at once."""
    inv_freq = rotary_emb.inv_freq.float()
    angles = torch.arange(positions, dtype=torch.float32, device=inv_freq.device)[:, None]
    frequencies = angles * inv_freq[None, :]
    embedding = torch.cat((frequencies, frequencies), dim=-1)
    scaling = rotary_emb.attention_scaling
    return (embedding.cos() * scaling).to(dtype), (embedding.sin() * scaling).to(dtype)


def _rope(states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of `states` [rows, tokens, heads, head_dim] (rotate-half convention)."""
    half = states.shape[-1] // 2
    rotated = torch.cat((-states[..., half:], states[..., :half]), dim=-1)
    return states * cos + rotated * sin


def _attention_mask(mask: torch.Tensor, tokens: int) -> torch.Tensor | None:
    """Boolean [rows, 1, tokens, columns]: a query sees the real columns up to its own. A
    padding query also sees itself, so that no row of the softmax is empty (an empty row is
    NaN, which would reach the cache through later layers' padding keys). None for one query
    token without padding: it sees every column."""
    columns = mask.shape[1]
    real = mask.bool()[:, None, None, :]
    if tokens == 1:
        return None if bool(real.all()) else real
    query_columns = torch.arange(columns - tokens, columns, device=mask.device)[:, None]
    key_columns = torch.arange(columns, device=mask.device)[None, :]
    return (real & (key_columns <= query_columns)) | (key_columns == query_columns)
