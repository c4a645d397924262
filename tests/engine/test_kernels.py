"""The decoder's matrix products (engine.kernels) and the startup measurements that pick them."""

import time

import pytest
import torch
import torch.nn.functional as F

from engine import kernels, loader
from engine.kernels import KernelPlan, Linear, measure_plan

# A matrix whose every entry is a bfloat16 value, as the model's are (so float16 holds it).
WEIGHT = torch.randn(96, 64, generator=torch.Generator().manual_seed(0)).bfloat16()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_half_kernel_computes_the_products_of_the_dtypes_matmul(dtype):
    weight = WEIGHT.to(dtype)
    linear = Linear(weight, KernelPlan(half_rows=4))
    x = torch.randn(1, 3, 64).to(dtype)
    expected = F.linear(x.float(), weight.float())
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(linear(x).float(), expected, rtol=tolerance, atol=tolerance)
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
    measured_rows = []

    def times(candidates):
        rows = [*kernels.ROW_COUNTS, kernels.PREFILL_ROWS][len(measured_rows)]
        measured_rows.append(rows)
        return [1.0, 0.5] if rows <= half_wins_up_to else [1.0, 2.0]

    monkeypatch.setattr(kernels, "fastest_times", times)
    assert measure_plan([WEIGHT], prefill_weights=[WEIGHT]).half_rows == expected


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
