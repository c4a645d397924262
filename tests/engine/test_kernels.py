"""The decoder's matrix products (engine.kernels) and the startup measurements that pick them."""

import time

import pytest
import torch
import torch.nn.functional as F
from conftest import faster_up_to

from engine import kernels, loader
from engine.kernels import KernelPlan, Linear, measure_plan
from tests.tolerances import float32_reordering_bound, row_relative_errors

# A matrix whose every entry is a bfloat16 value, as the model's are (so float16 holds it).
WEIGHT = torch.randn(96, 64, generator=torch.Generator().manual_seed(0)).bfloat16()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_half_kernel_computes_the_products_of_the_dtypes_matmul(dtype):
    weight = WEIGHT.to(dtype)
    linear = Linear(weight, KernelPlan(half_rows=4))
    x = torch.randn(1, 3, 64).to(dtype)
    expected = F.linear(x.float(), weight.float())
    # float32: the same products summed in another order. bfloat16: besides, the answer rounded
    # to 8 significant bits (each entry by at most 2**-9 of itself, so the row too), twice that.
    bound = float32_reordering_bound(reduction=64, sums_in_series=1)
    if dtype == torch.bfloat16:
        bound = 2**-8
    assert row_relative_errors(linear(x).float(), expected).max() <= bound
    assert linear(x).dtype == dtype


def test_products_of_more_rows_than_the_plan_says_use_the_dtypes_own_matmul():
    linear = Linear(WEIGHT, KernelPlan(half_rows=2))
    within, beyond = torch.randn(2, 64).bfloat16(), torch.randn(3, 64).bfloat16()
    half = Linear(WEIGHT, KernelPlan(half_rows=16))
    assert torch.equal(linear(within), half(within))
    assert torch.equal(linear(beyond), F.linear(beyond, WEIGHT))
    assert Linear(WEIGHT, KernelPlan(half_rows=0)).packed is None


@pytest.mark.parametrize(
    ("half_wins_up_to", "expected"),
    [(0, 0), (1, 1), (4, 4), (8, 8), (16, 16), (kernels.PREFILL_ROWS, kernels.ALL_ROWS)],
)
def test_the_plan_keeps_the_half_kernel_while_it_is_faster(monkeypatch, half_wins_up_to, expected):
    row_counts = [*kernels.ROW_COUNTS, kernels.PREFILL_ROWS]
    times = faster_up_to(row_counts, half_wins_up_to, candidate=1)
    monkeypatch.setattr(kernels, "fastest_times", times)
    weight = WEIGHT.float()  # oneDNN's reordered weights are measured for bfloat16 only
    assert measure_plan([weight], prefill_weights=[weight], half=True).half_rows == expected


class FakeOneDNN:
    """oneDNN's reorder and product, replaced by F.linear (`differ`: off by a bit), with
    the row counts it multiplied."""

    def __init__(self, monkeypatch, differ: bool = False):
        self.rows = []
        self.differ = differ
        monkeypatch.setattr(kernels, "onednn_bfloat16", lambda: True)
        monkeypatch.setattr(kernels, "_reorder_onednn", lambda weight: weight)
        monkeypatch.setattr(kernels, "_onednn_linear", self.linear)

    def linear(self, x, weight):
        self.rows.append(x.numel() // x.shape[-1])
        product = F.linear(x, weight)
        return torch.nextafter(product, product + 1) if self.differ else product


@pytest.mark.parametrize(
    ("onednn_wins_up_to", "expected"), [(0, 0), (1, 1), (16, 16), (32, 16), (64, 64)]
)
def test_the_plan_uses_onednn_up_to_the_rows_where_it_was_faster(
    monkeypatch, onednn_wins_up_to, expected
):
    FakeOneDNN(monkeypatch)
    times = faster_up_to(kernels.ONEDNN_ROW_COUNTS, onednn_wins_up_to, candidate=1)
    monkeypatch.setattr(kernels, "fastest_times", times)
    plan = measure_plan([WEIGHT], prefill_weights=[WEIGHT], half=False)
    assert plan.onednn_rows == expected


def test_onednn_is_not_planned_where_its_bits_differ_from_f_linear(monkeypatch):
    FakeOneDNN(monkeypatch, differ=True)
    monkeypatch.setattr(kernels, "fastest_times", lambda candidates: [1.0, 0.5])
    assert measure_plan([WEIGHT], prefill_weights=[WEIGHT], half=False).onednn_rows == 0


def test_onednn_is_not_planned_for_float32(monkeypatch):
    FakeOneDNN(monkeypatch)
    monkeypatch.setattr(kernels, "fastest_times", lambda candidates: [1.0, 0.5])
    weight = WEIGHT.float()
    assert measure_plan([weight], prefill_weights=[weight], half=False).onednn_rows == 0


def test_each_product_takes_the_kernel_its_row_count_is_planned_for(monkeypatch):
    onednn = FakeOneDNN(monkeypatch)
    linear = Linear(WEIGHT, KernelPlan(half_rows=2, onednn_rows=4))
    half = Linear(WEIGHT, KernelPlan(half_rows=16))
    within_half, within_onednn, beyond = (torch.randn(n, 64).bfloat16() for n in (2, 4, 5))
    assert torch.equal(linear(within_half), half(within_half))
    assert torch.equal(linear(within_onednn), F.linear(within_onednn, WEIGHT))
    assert torch.equal(linear(beyond), F.linear(beyond, WEIGHT))
    one_prompt = torch.randn(1, 3, 64).bfloat16()  # three tokens' rows
    assert torch.equal(linear(one_prompt), F.linear(one_prompt, WEIGHT))
    assert onednn.rows == [4, 3]


def test_onednn_on_reordered_weights_gives_the_bits_of_f_linear_or_is_never_planned():
    weight = torch.randn(3072, 576, generator=torch.Generator().manual_seed(1)).bfloat16()
    if not kernels.onednn_bfloat16():  # no oneDNN bfloat16 on this CPU (AVX2 only)
        assert measure_plan([weight], prefill_weights=[weight], half=False).onednn_rows == 0
        return
    linear = Linear(weight, KernelPlan(half_rows=0, onednn_rows=64))
    for shape in [(1, 576), (16, 576), (2, 8, 576), (64, 576)]:
        x = torch.randn(*shape).bfloat16()
        assert torch.equal(linear(x), F.linear(x, weight)), shape


def test_a_kernel_slowed_by_other_work_in_most_of_its_runs_still_wins(monkeypatch):
    """Load on the machine only adds time: the kernel that is faster when undisturbed wins,
    though other work slowed two of its three runs past the other kernel's."""
    monkeypatch.setattr(kernels, "REPETITIONS", 3)
    fast_runs = iter([0.001, 0.001, 0.020, 0.020])  # warm-up, then three timed runs

    def fast_but_disturbed():
        time.sleep(next(fast_runs))

    def slower():
        time.sleep(0.005)

    fast_time, slower_time = kernels.fastest_times([fast_but_disturbed, slower])
    assert fast_time < slower_time


@pytest.mark.parametrize(("bfloat16_faster", "expected"), [(True, "bfloat16"), (False, "float32")])
def test_auto_dtype_on_a_cpu_is_the_faster_prefill(monkeypatch, bfloat16_faster, expected):
    monkeypatch.delenv("ACS_ENGINE_DTYPE", raising=False)
    monkeypatch.setattr(loader, "bfloat16_prefills_faster", lambda shapes: bfloat16_faster)
    loader._measured_cpu_dtype.cache_clear()
    try:
        assert loader.compute_dtype(torch.device("cpu")) == getattr(torch, expected)
    finally:
        loader._measured_cpu_dtype.cache_clear()


def test_the_prefill_measurement_runs_on_this_cpu():
    assert isinstance(kernels.bfloat16_prefills_faster([(64, 32)]), bool)
