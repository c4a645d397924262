"""ACS_ENGINE_DEVICE: CUDA when torch sees one (the default, auto), or the one forced."""

import pytest
import torch

from engine.loader import compute_dtype, engine_device


@pytest.mark.parametrize(("cuda_available", "expected"), [(True, "cuda"), (False, "cpu")])
def test_auto_runs_on_cuda_when_torch_sees_it(monkeypatch, cuda_available, expected):
    monkeypatch.delenv("ACS_ENGINE_DEVICE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda_available)
    assert engine_device() == torch.device(expected)


@pytest.mark.parametrize("forced", ["cpu", "cuda"])
def test_a_forced_device_is_used_whatever_torch_sees(monkeypatch, forced):
    monkeypatch.setenv("ACS_ENGINE_DEVICE", forced)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: forced == "cpu")
    assert engine_device() == torch.device(forced)


def test_an_unknown_device_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("ACS_ENGINE_DEVICE", "tpu")
    with pytest.raises(ValueError, match="ACS_ENGINE_DEVICE must be auto, cpu or cuda"):
        engine_device()


def test_auto_dtype_is_bfloat16_on_cuda(monkeypatch):
    monkeypatch.delenv("ACS_ENGINE_DTYPE", raising=False)
    assert compute_dtype(torch.device("cuda")) == torch.bfloat16


def test_a_forced_dtype_holds_on_cuda_too(monkeypatch):
    monkeypatch.setenv("ACS_ENGINE_DTYPE", "float32")
    assert compute_dtype(torch.device("cuda")) == torch.float32
