"""The native decode step (engine/csrc/decode.c) against the decoder's PyTorch path."""

import pytest
import torch
import torch.nn.functional as F

from engine import decoder as decoder_module
from engine import native
from engine.decoder import KVCache
from engine.kernels import KernelPlan, Linear


def exact_in_half(*shape: int) -> torch.Tensor:
    """A float32 matrix whose entries float16 holds exactly, as the model's weights."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1)).half().float()


@pytest.mark.parametrize("rows", [1, 2, 3, 16])
@pytest.mark.parametrize(("n", "k"), [(64, 576), (960, 576), (576, 1536)])
def test_native_products_are_the_float32_matmuls(rows, n, k):
    weight, x = exact_in_half(n, k), torch.randn(rows, k)
    product = native.product(native.pack(weight), x)
    torch.testing.assert_close(product, F.linear(x, weight), rtol=1e-5, atol=1e-4)


def test_products_within_the_native_rows_use_the_native_kernel_and_beyond_them_the_others():
    weight = exact_in_half(64, 64)
    linear = Linear(weight, KernelPlan(half_rows=0, native_rows=2))
    within, beyond = torch.randn(2, 64), torch.randn(3, 64)
    assert torch.equal(linear(within), native.product(linear.native, within))
    assert torch.equal(linear(beyond), F.linear(beyond, weight))


@pytest.fixture(scope="module")
def float32_decoder(model_loaded_with):
    return model_loaded_with(ACS_ENGINE_DTYPE="float32").decoder


def test_a_float32_model_on_this_cpu_decodes_natively(float32_decoder):
    """Every CPU the project runs on has AVX2, FMA and F16C, and a C compiler is installed."""
    assert float32_decoder.plan.native_rows == decoder_module.NATIVE_ROWS
    assert float32_decoder.native_layers is not None


def test_float32_and_bfloat16_models_decode_natively_and_no_other():
    plan, weights = KernelPlan(half_rows=4), [exact_in_half(64, 64)]
    assert decoder_module._with_native_decode(plan, torch.float16, weights) == plan
    for dtype in (torch.float32, torch.bfloat16):
        assert decoder_module._with_native_decode(plan, dtype, weights).native_rows > 0


def decode(decoder, steps: int, hook_layer: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Logits [steps, rows, vocab] (float32) of `steps` decode steps of random tokens after a
    prefill of three left-padded rows (one shorter), steered after `hook_layer` (+0.5 on row
    0), and the residual streams the hook read."""
    rows, prompt = 3, 7
    generator = torch.Generator().manual_seed(3)
    input_ids = torch.randint(0, 40000, (rows, prompt), generator=generator)
    mask = torch.ones(rows, prompt, dtype=torch.long)
    mask[1, :3] = 0
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    cache = KVCache.empty(decoder, rows)
    seen = []

    def steer(hidden):
        seen.append(hidden.clone())
        hidden[0] += 0.5

    logits = []
    with torch.inference_mode():
        decoder.forward(input_ids, mask, positions, cache, {})
        next_ids = torch.randint(0, 40000, (rows, 1), generator=generator)
        for step in range(steps):
            mask = torch.cat([mask, mask.new_ones(rows, 1)], dim=1)
            at = positions[:, -1:] + 1 + step
            final = decoder.forward(next_ids, mask, at, cache, {hook_layer: steer})
            logits.append(decoder.lm_head(final[:, -1]).float())
            next_ids = torch.randint(0, 40000, (rows, 1), generator=generator)
    return torch.stack(logits), seen


def test_native_decode_steps_compute_the_pytorch_steps(float32_decoder, monkeypatch):
    """Padded rows, a steering hook mid-stack and several steps (the cache growing): the same
    logits and the same residual stream at the hook as the decoder's PyTorch path."""
    native_logits, native_seen = decode(float32_decoder, steps=4, hook_layer=11)
    monkeypatch.setattr(float32_decoder, "native_layers", None)
    torch_logits, torch_seen = decode(float32_decoder, steps=4, hook_layer=11)
    torch.testing.assert_close(native_logits, torch_logits, rtol=1e-4, atol=5e-4)
    for native_hidden, torch_hidden in zip(native_seen, torch_seen, strict=True):
        torch.testing.assert_close(native_hidden, torch_hidden, rtol=1e-4, atol=5e-4)


def test_where_the_native_step_cannot_be_built_the_decoder_keeps_pytorch(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    native.library.cache_clear()
    try:
        assert native.library() is None
        plan = KernelPlan(half_rows=4)
        weights = [exact_in_half(64, 64)]
        assert decoder_module._with_native_decode(plan, torch.float32, weights) == plan
    finally:
        native.library.cache_clear()


def test_a_bfloat16_models_native_steps_are_nearer_the_float32_models(
    model_loaded_with, float32_decoder, monkeypatch
):
    """A bfloat16 model decodes natively in float32 over its bfloat16 cache: its logits are
    no farther from the float32 model's than the bfloat16 PyTorch path's."""
    bfloat16_decoder = model_loaded_with(ACS_ENGINE_DTYPE="bfloat16").decoder
    assert bfloat16_decoder.native_layers is not None
    float32_logits, _ = decode(float32_decoder, steps=4, hook_layer=11)
    native_logits, _ = decode(bfloat16_decoder, steps=4, hook_layer=11)
    monkeypatch.setattr(bfloat16_decoder, "native_layers", None)
    torch_logits, _ = decode(bfloat16_decoder, steps=4, hook_layer=11)
    native_error = (native_logits - float32_logits).abs().max()
    torch_error = (torch_logits - float32_logits).abs().max()
    assert native_error <= torch_error
