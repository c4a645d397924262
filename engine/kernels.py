"""Matrix products of the decoder, and the short measurements at startup that choose them.

A decode step of a few rows is bound by reading the weights (~135M of them per token), a
prefill by arithmetic, and which kernel is faster for each depends on the CPU: bfloat16
products are fast where the CPU multiplies bfloat16 natively (AVX-512 BF16, AMX) and emulated
elsewhere, and torch's one-row bfloat16 matmul reads the weights far below the memory's speed
even there, while fbgemm's float16-weight kernel streams them well. `F.linear` in bfloat16
also reorders the whole weight into oneDNN's blocked layout at every call; oneDNN's own
product on weights reordered once at load (`torch.ops.mkldnn`) computes the same bits without
that pass. So the choice is measured on this machine, on matrices of the model's shapes, not
guessed from CPU flags.
"""

import functools
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine import native

# Row counts the startup measurement tries for the float16-weight kernel: single-stream and
# small-batch decode. Larger batches and prefill use the compute dtype's own matmul.
ROW_COUNTS = (1, 2, 4, 8, 16)
# Row counts it tries for oneDNN's product on reordered bfloat16 weights: single-stream, a
# moderate batch and the engine's default ACS_ENGINE_MAX_ACTIVE. On an AMX machine it took
# 11-13 against F.linear's 17-19 ms for 1 to 16 rows of the layers' products, 16-18 against
# 23-32 for 64 rows, but 54-62 against 52 for a 256-token prefill.
ONEDNN_ROW_COUNTS = (1, 16, 64)
# The batch size oneDNN reorders the weights for; its products of up to 64 rows on them are
# bit-identical to F.linear's (a reorder for 1 row was not, at 256 rows).
ONEDNN_REORDER_ROWS = 16
# Rows of the prefill-like product that decides the compute dtype: a 256-token prompt's chunk.
PREFILL_ROWS = 256
REPETITIONS = 3


# `half_rows` of a plan whose float16 kernel won at every size measured, prefill included.
ALL_ROWS = sys.maxsize


@dataclass(frozen=True)
class KernelPlan:
    """Products of up to `half_rows` rows use the float16-weight kernel (0: never); those of
    more rows, up to `onednn_rows`, oneDNN's product on reordered weights (0: never); decode
    steps of up to `native_rows` rows run engine/csrc/decode.c (0: never; see
    `engine.decoder`, which measures it)."""

    half_rows: int
    onednn_rows: int = 0
    native_rows: int = 0


class Linear:
    """`x @ weight.T` in `weight`'s dtype. With a plan whose `half_rows` > 0, the weight also
    has a float16 copy packed for fbgemm, whose kernel converts each weight to float32 in
    registers and accumulates in float32: the same products as a float32 matmul (the weights
    are float16 exactly, see `half_weights_exact`) reading half a float32 weight's bytes, and,
    for a bfloat16 model, the same products as bfloat16's matmul (which also accumulates in
    float32) summed in another order. Products of more rows than `half_rows`, up to
    `onednn_rows`, use `onednn`, `weight` reordered once for oneDNN (the same bits as
    F.linear); the rest F.linear on `weight`. With a plan whose `native_rows` > 0, `native`
    is the float16 copy decode.c reads."""

    def __init__(self, weight: torch.Tensor, plan: KernelPlan):
        self.weight = weight
        self.half_rows = plan.half_rows
        self.onednn_rows = plan.onednn_rows
        self.packed = _pack_half(weight) if plan.half_rows else None
        self.onednn = _reorder_onednn(weight) if plan.onednn_rows > plan.half_rows else None
        self.native = native.pack(weight) if plan.native_rows else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows <= self.half_rows:
            return _half_linear(x, self.packed)
        if rows <= self.onednn_rows:
            return _onednn_linear(x, self.onednn)
        return F.linear(x, self.weight)


def half_weights_exact(model: torch.nn.Module) -> bool:
    """Whether the float16 kernel can run this model: on a CPU with fbgemm, every matrix
    exactly representable in float16 (true of this bfloat16-valued model: no weight is below
    float16's exact range or above its maximum)."""
    if model.device.type != "cpu" or model.dtype not in (torch.float32, torch.bfloat16):
        return False
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return False
    matrices = [parameter for parameter in model.parameters() if parameter.ndim == 2]
    return all(torch.equal(matrix.half().to(matrix.dtype), matrix) for matrix in matrices)


@torch.inference_mode()
def measure_plan(
    weights: list[torch.Tensor], prefill_weights: list[torch.Tensor], *, half: bool
) -> KernelPlan:
    """The plan for `weights` (the model's matrices, in the compute dtype), each candidate
    timed as one pass over all `weights` (as a decode step reads them), the candidates
    alternating so that load changes hit both alike. `onednn_rows`: the most rows of
    ONEDNN_ROW_COUNTS up to which oneDNN on reordered weights beat F.linear at every count
    and gave the same bits (bfloat16 only). `half_rows` (where `half`: the float16 kernel can
    run these weights): the most rows up to which the float16 kernel beat that compute dtype's
    product at every row count of ROW_COUNTS; ALL_ROWS if it also wins a PREFILL_ROWS product
    by `prefill_weights` (a layer's matrices: a prefill is bound by arithmetic, not by reading
    them)."""
    onednn_rows, reordered = _measured_onednn_rows(weights)
    if not half:
        return KernelPlan(half_rows=0, onednn_rows=onednn_rows)
    # Packed once: packing reads and converts every weight, as long as a few timed passes.
    packed = [_pack_half(weight) for weight in weights]
    half_rows = 0
    for rows in ROW_COUNTS:
        dtype_kernel = (_onednn_linear, reordered) if rows <= onednn_rows else None
        if not _half_faster(weights, packed, rows, dtype_kernel):
            return KernelPlan(half_rows=half_rows, onednn_rows=onednn_rows)
        half_rows = rows
    prefill_packed = [_pack_half(weight) for weight in prefill_weights]
    prefill_wins = _half_faster(prefill_weights, prefill_packed, PREFILL_ROWS, None)
    return KernelPlan(half_rows=ALL_ROWS if prefill_wins else rows, onednn_rows=onednn_rows)


def _half_faster(weights, packed, rows: int, dtype_kernel: tuple | None) -> bool:
    """Whether `packed` (the float16 copies of `weights`) multiply `rows` rows faster than
    `dtype_kernel` (a kernel and its copies of `weights`; None: F.linear on `weights`)."""
    kernel, operands = dtype_kernel or (F.linear, weights)
    inputs = [torch.randn(rows, weight.shape[1], dtype=weight.dtype) for weight in weights]
    dtype_product = functools.partial(_products, kernel, inputs, operands)
    half = functools.partial(_products, _half_linear, inputs, packed)
    dtype_time, half_time = fastest_times([dtype_product, half])
    return half_time < dtype_time


def _measured_onednn_rows(weights: list[torch.Tensor]) -> tuple[int, list[torch.Tensor]]:
    """`onednn_rows` of `measure_plan` (0 unless `weights` are bfloat16 and oneDNN multiplies
    bfloat16 on this CPU) and the reordered `weights` it measured."""
    if weights[0].dtype != torch.bfloat16 or not onednn_bfloat16():
        return 0, []
    reordered = [_reorder_onednn(weight) for weight in weights]
    # oneDNN picks its kernel by shape: one matrix of each shape is enough to compare bits.
    one_per_shape = {weight.shape: index for index, weight in enumerate(weights)}.values()
    onednn_rows = 0
    for rows in ONEDNN_ROW_COUNTS:
        inputs = [torch.randn(rows, weight.shape[1], dtype=weight.dtype) for weight in weights]
        same = all(
            torch.equal(_onednn_linear(inputs[i], reordered[i]), F.linear(inputs[i], weights[i]))
            for i in one_per_shape
        )
        plain = functools.partial(_products, F.linear, inputs, weights)
        onednn = functools.partial(_products, _onednn_linear, inputs, reordered)
        plain_time, onednn_time = fastest_times([plain, onednn])
        if not same or onednn_time >= plain_time:
            break
        onednn_rows = rows
    return onednn_rows, reordered


def onednn_bfloat16() -> bool:
    """Whether this torch has oneDNN's linear on reordered weights and it multiplies
    bfloat16 on this CPU."""
    mkldnn = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(mkldnn, "_reorder_linear_weight")
        and hasattr(mkldnn, "_linear_pointwise")
        and bool(mkldnn._is_mkldnn_bf16_supported())
    )


@torch.inference_mode()
def bfloat16_prefills_faster(shapes: list[tuple[int, int]]) -> bool:
    """Whether a prefill-sized product (PREFILL_ROWS rows by random matrices of `shapes`) is
    faster in bfloat16 than in float32 on this CPU: true where bfloat16 is multiplied natively,
    false where torch emulates it (then bfloat16 gains nothing, at any batch size)."""
    candidates = []
    for dtype in (torch.bfloat16, torch.float32):
        weights = [torch.randn(shape, dtype=dtype) for shape in shapes]
        inputs = [torch.randn(PREFILL_ROWS, shape[1], dtype=dtype) for shape in shapes]
        candidates.append(functools.partial(_products, F.linear, inputs, weights))
    bfloat16_time, float32_time = fastest_times(candidates)
    return bfloat16_time < float32_time


def _products(kernel: Callable, inputs: list[torch.Tensor], weights: list) -> None:
    for x, weight in zip(inputs, weights, strict=True):
        kernel(x, weight)


def fastest_times(candidates: list[Callable[[], None]]) -> list[float]:
    """Seconds of each candidate's fastest run of REPETITIONS alternating runs, after one
    warm-up. Other work on the machine only ever adds time, so the fastest run is the least
    disturbed: with the median, a burst of load over two of a candidate's three runs made a
    float32 engine plan without the float16 kernel and decode 3x slower for its lifetime."""
    samples: list[list[float]] = [[] for _ in candidates]
    for candidate in candidates:
        candidate()
    for _ in range(REPETITIONS):
        for run, times in zip(candidates, samples, strict=True):
            started = time.perf_counter()
            run()
            times.append(time.perf_counter() - started)
    return [min(times) for times in samples]


def _pack_half(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.quantized.linear_prepack_fp16(weight.detach().float(), None)


def _reorder_onednn(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ONEDNN_REORDER_ROWS)


def _onednn_linear(x: torch.Tensor, reordered: torch.Tensor) -> torch.Tensor:
    """oneDNN's product of `x` by a weight `_reorder_onednn` reordered (`x @ weight.T`)."""
    return torch.ops.mkldnn._linear_pointwise(x, reordered, None, "none", [], "")


def _half_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """fbgemm's float16-weight product; it takes and gives float32 activations."""
    return torch.ops.quantized.linear_dynamic_fp16(x.float(), packed).to(x.dtype)
