"""The engine's model: chosen by ACS_ENGINE_MODEL among the specs it knows, every size of it
(layers, hidden size, vocabulary, context, the matrix shapes the kernel plan measures) read
from the weights' config.json."""

import json
import shutil
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine import loader
from engine.decoder import KVCache
from tests.tolerances import float32_reordering_bound, row_relative_errors

# A Llama of other sizes than SmolLM2-135M's in every dimension, and a head size that is not
# hidden / heads: its shapes can only come from its own config.json.
TINY = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 24,
    "intermediate_size": 96,
    "max_position_embeddings": 512,
}
TINY_SHAPES = [(4 * 24 + 2 * 2 * 24, 64), (64, 4 * 24), (2 * 96, 64), (64, 96)]
TINY_SPEC = loader.ModelSpec("tiny-llama", "no_such_package", "tiny.gguf")


@pytest.fixture
def tiny_weights(tmp_path):
    """A random tiny Llama's weights directory, in bfloat16, with the engine model's
    tokenizer (so its vocabulary has that tokenizer's size)."""
    config = LlamaConfig(**TINY, vocab_size=49152, tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path)
    source = loader.weights_directory()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, tmp_path / name)
    return tmp_path


@pytest.fixture
def measured_shapes(monkeypatch):
    """The shapes each auto-dtype measurement on a CPU multiplied by."""
    shapes = []

    def bfloat16_prefills_faster(measured):
        shapes.append(measured)
        return False

    monkeypatch.delenv("ACS_ENGINE_DTYPE", raising=False)
    monkeypatch.setattr(loader, "bfloat16_prefills_faster", bfloat16_prefills_faster)
    loader._measured_cpu_dtype.cache_clear()
    yield shapes
    loader._measured_cpu_dtype.cache_clear()


def test_smollm2s_config_gives_its_known_matrix_shapes():
    config = loader.model_config(loader.weights_directory())
    assert loader.matrix_shapes(config) == [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def test_a_config_of_other_sizes_gives_other_matrix_shapes(tmp_path):
    LlamaConfig(**TINY, vocab_size=1000).save_pretrained(tmp_path)
    assert loader.matrix_shapes(loader.model_config(tmp_path)) == TINY_SHAPES


def test_the_auto_dtype_is_measured_on_the_shapes_of_the_models_config(tmp_path, measured_shapes):
    LlamaConfig(**TINY, vocab_size=1000).save_pretrained(tmp_path)
    assert loader.compute_dtype(torch.device("cpu"), tmp_path) == torch.float32
    assert measured_shapes == [TINY_SHAPES]


def test_a_model_of_other_sizes_loads_with_its_own_sizes_and_id(
    tiny_weights, measured_shapes, monkeypatch
):
    monkeypatch.setitem(loader.MODEL_SPECS, TINY_SPEC.id, TINY_SPEC)
    monkeypatch.setenv("ACS_ENGINE_MODEL", TINY_SPEC.id)
    monkeypatch.setenv("ACS_ENGINE_DEVICE", "cpu")
    loaded = loader.load_model(tiny_weights)
    assert loaded.model_id == "tiny-llama"
    sizes = (loaded.n_layers, loaded.hidden_size, loaded.vocab_size, loaded.max_model_len)
    assert sizes == (2, 64, 49152, 512)
    assert measured_shapes == [TINY_SHAPES]
    layer = loaded.decoder.layers[0]
    multiplied = [layer.qkv, layer.o, layer.gate_up, layer.down]
    assert [tuple(linear.weight.shape) for linear in multiplied] == TINY_SHAPES
    assert len(loaded.decoder.layers) == 2
    ids = torch.tensor([[1, 20, 300, 4000]])
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        final = loaded.decoder.forward(
            ids, mask, mask.cumsum(1) - 1, KVCache.empty(loaded.decoder, 1), {}
        )
        expected = loaded.model.model(ids).last_hidden_state
    # The same float32 products as transformers', summed in other orders (tests/tolerances.py).
    bound = float32_reordering_bound(reduction=TINY["intermediate_size"], sums_in_series=4)
    assert row_relative_errors(final, expected).max() <= bound


def test_the_model_is_the_one_acs_engine_model_names(monkeypatch):
    monkeypatch.setitem(loader.MODEL_SPECS, TINY_SPEC.id, TINY_SPEC)
    monkeypatch.delenv("ACS_ENGINE_CACHE", raising=False)
    monkeypatch.delenv("ACS_ENGINE_MODEL", raising=False)
    assert loader.model_spec().id == "smollm2-135m"
    monkeypatch.setenv("ACS_ENGINE_MODEL", "tiny-llama")
    assert loader.model_spec() == TINY_SPEC
    assert loader.default_cache_dir().parts[-2:] == ("acs-engine", "tiny-llama")


def test_an_unknown_model_is_refused_naming_the_known_ones(monkeypatch, capsys):
    """`python -m engine serve` (run in this process) refuses to start."""
    from engine import __main__ as command

    monkeypatch.setenv("ACS_ENGINE_MODEL", "gpt-5")
    with pytest.raises(loader.UnknownModel, match="known: smollm2-135m"):
        loader.model_spec()
    monkeypatch.setattr(sys, "argv", ["python -m engine", "serve"])
    monkeypatch.setattr(command.uvicorn, "run", lambda *args, **kwargs: pytest.fail("it served"))
    with pytest.raises(SystemExit) as exit:
        command.main()
    assert exit.value.code == 2
    error = capsys.readouterr().err
    assert "ACS_ENGINE_MODEL='gpt-5' is not a model this engine knows; known: smollm2-135m" in error


def test_the_models_card_reports_the_sizes_of_its_config_json(client):
    config = json.loads((loader.weights_directory() / "config.json").read_text())
    card = client.get("/v1/models").json()["data"][0]
    assert card["id"] == loader.model_spec().id
    assert (card["n_layers"], card["hidden_size"]) == (
        config["num_hidden_layers"],
        config["hidden_size"],
    )
    assert (card["vocab_size"], card["max_model_len"]) == (
        config["vocab_size"],
        config["max_position_embeddings"],
    )
