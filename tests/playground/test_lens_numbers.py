"""Every number of a run page's logit lens and direct logit attribution, recomputed with numpy
from the raw /v1 response and the model's own files, and compared with the figure data the
page embeds (and the htmx section its pickers load).

As in test_figure_numbers.py, the runs go through the real path (worker, live gateway, real
embedded engine) and the expected numbers come from the raw bodies alone: the captured rows
decoded by hand, the final norm's weight and the (tied) unembedding read from the weights
directory's safetensors file by hand, the tokens from its tokenizer.json; never with
`playground.lens`, its `run_lens` or its figures.
"""

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlencode

import numpy as np
import pytest
from django.urls import reverse
from safetensors.numpy import save_file
from tokenizers import Tokenizer

from api.models import LanguageModel
from api.selectors import registry_clear
from tests.tolerances import WIDEST
from testsupport.vllm_lens import weights_directory

from . import test_figure_numbers as numbers
from .conftest import HTMX

pytestmark = pytest.mark.django_db(transaction=True)

# The fixtures of test_figure_numbers: the real path, recorded, and a logged-in page client.
science = numbers.science
page_client = numbers.page_client

MODEL, PROMPT = numbers.MODEL, numbers.PROMPT

CAPTURE = {**numbers.CAPTURE, "logprobs": 5}
N_LAYERS = 30
# Agreement of two float computations of the same number from the same bfloat16 rows.
SAME = 2e-3


class Model:
    """The model's final norm (weight, epsilon), unembedding (the tied embedding, float64) and
    tokenizer, read from its weights directory with nothing but json, struct and numpy."""

    def __init__(self, directory: Path):
        config = json.loads((directory / "config.json").read_text())
        assert config["tie_word_embeddings"] and config["num_hidden_layers"] == N_LAYERS
        self.directory = directory
        self.eps = config["rms_norm_eps"]
        content = (directory / "model.safetensors").read_bytes()
        (length,) = struct.unpack("<Q", content[:8])
        header = json.loads(content[8 : 8 + length])

        def tensor(name):
            entry = header[name]
            assert entry["dtype"] == "BF16"
            begin, end = entry["data_offsets"]
            words = np.frombuffer(content[8 + length + begin : 8 + length + end], dtype="<u2")
            widened = (words.astype(np.uint32) << 16).view(np.float32)
            return widened.reshape(entry["shape"]).astype(np.float64)

        self.norm = tensor("model.norm.weight")
        self.unembedding = tensor("model.embed_tokens.weight")
        self.tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))

    def scale(self, rows: np.ndarray) -> np.ndarray:
        """The final norm's per-unit scale of each row: weight / RMS."""
        return self.norm / np.sqrt((rows**2).mean(axis=-1, keepdims=True) + self.eps)

    def logprobs(self, rows: np.ndarray) -> np.ndarray:
        logits = (rows * self.scale(rows)) @ self.unembedding.T
        peak = logits.max(axis=-1, keepdims=True)
        return logits - peak - np.log(np.exp(logits - peak).sum(axis=-1, keepdims=True))

    def shown(self, token_id: int) -> str:
        return numbers.shown(self.tokenizer.decode([int(token_id)], skip_special_tokens=False))


@pytest.fixture(scope="module")
def model() -> Model:
    return Model(Path(weights_directory()))


@pytest.fixture
def lens_science(science, model):
    """`science` with the registry's model given its weights directory."""
    LanguageModel.objects.filter(name=MODEL).update(weights_dir=str(model.directory))
    registry_clear()
    return science


@dataclass
class Captured:
    """A capture run, its raw answer and capture (float64 [layers, tokens, hidden]), the token
    after each position (its id), each position's label, and the lens of every row (float64
    logprobs [layers, tokens, vocabulary])."""

    run: object
    raw: dict
    tensor: np.ndarray
    following: list[int]
    labels: list[str]
    logprobs: np.ndarray


@pytest.fixture
def capture(lens_science, approved_user, model) -> Captured:
    """A capture of every layer with 5 logprobs."""
    recorder, tokenizer = lens_science
    run = numbers.run_through(approved_user, CAPTURE)
    raw = recorder.answer_to(CAPTURE)
    tensor = numbers.residual_stream(raw)
    prompt_ids, prompt_texts = numbers.prompt_pieces(tokenizer, PROMPT)
    following = (prompt_ids + numbers.sampled_ids(tokenizer, raw))[1:]
    assert tensor.shape == (N_LAYERS, len(following), 576)
    generated = raw["choices"][0]["logprobs"]["tokens"]
    labels = [
        f"{row} {numbers.shown(token)}" for row, token in enumerate(prompt_texts + generated[:-1])
    ]
    return Captured(run, raw, tensor, following, labels, model.logprobs(tensor))


def page_figures(client, url: str, **headers) -> dict:
    response = client.get(url, **headers)
    assert response.status_code == 200
    return numbers.embedded(response.content.decode())


def lens_url(run, **picks) -> str:
    query = urlencode({f"lens-{name}": value for name, value in picks.items()})
    return reverse("playground:run_figure", args=[run.id, "lens"]) + f"?{query}"


def near(actual, expected) -> bool:
    """Within SAME of each other, element by element (None: NaN)."""
    actual = np.asarray(actual, dtype=np.float64)
    return actual.shape == np.shape(expected) and np.allclose(actual, expected, rtol=0, atol=SAME)


def shown_number(page: str, name: str) -> float:
    """The number the page prints in its `data-dla-<name>` cell (nats)."""
    [value] = re.findall(rf"data-dla-{name}>(-?[\d.]+) nats<", page)
    return float(value)


def ranks_between(logprobs: np.ndarray, token: int) -> tuple[np.ndarray, np.ndarray]:
    """The ranks a token may have by layer ([layers, vocabulary] logprobs), counting the
    tokens within SAME of it either way."""
    own = logprobs[:, token, None]
    return 1 + (logprobs > own + SAME).sum(axis=-1), (logprobs >= own - SAME).sum(axis=-1)


def test_lens_heatmap_and_rank_line_match_numpy(capture, page_client, model):
    run, following, labels, logprobs = (
        capture.run,
        capture.following,
        capture.labels,
        capture.logprobs,
    )
    page = page_figures(page_client, reverse("playground:run_detail", args=[run.id]))
    heatmap = page["lens"]["data"][0]
    # The activation window's positions (the first token left out), every layer.
    assert heatmap["x"] == list(range(1, 13)) and heatmap["y"] == [str(k) for k in range(30)]
    assert page["lens"]["layout"]["xaxis"]["ticktext"] == labels[1:]
    shown_lens = logprobs[:, 1:]
    assert near(heatmap["z"], np.exp(shown_lens.max(axis=-1)))
    best = np.sort(shown_lens, axis=-1)[:, :, -2:]
    for layer in range(N_LAYERS):
        for column in range(12):
            top = int(np.argmax(shown_lens[layer, column]))
            tied = best[layer, column, 1] - best[layer, column, 0] < SAME
            assert tied or heatmap["text"][layer][column] == model.shown(top), (layer, column)
    # Coloured by the next token's logprob.
    url = lens_url(run, colour="target", position=12, attributed="difference", target="", foil="")
    for headers in ({}, HTMX):
        target = page_figures(page_client, url, **headers)["lens"]["data"][0]
        expected = shown_lens[:, np.arange(12), following[1:]]
        assert near(target["z"], expected) and target["zmax"] == 0
    # The next token's rank by layer at the last position.
    line = page["lens_rank"]["data"][0]
    low, high = ranks_between(logprobs[:, -1], following[-1])
    assert line["x"] == list(range(30)) and ((low <= line["y"]) & (line["y"] <= high)).all()
    assert near(line["customdata"], logprobs[:, -1, following[-1]])
    assert page["lens_rank"]["layout"]["title"]["text"] == (
        f"Rank of {model.shown(following[-1])} by layer at position {labels[-1]}"
    )


def attribution(model: Model, tensor: np.ndarray, position: int, target: int, foil: int | None):
    """Each block's share of logit(target) [− logit(foil)] at `position`."""
    rows = tensor[:, position]
    deltas = rows - np.vstack([np.zeros_like(rows[:1]), rows[:-1]])
    direction = model.unembedding[target] - (0 if foil is None else model.unembedding[foil])
    return (deltas * model.scale(rows[-1])) @ direction


def test_attribution_adds_up_to_the_reported_logit_difference(capture, page_client, model):
    run, tensor, logprobs = capture.run, capture.tensor, capture.logprobs
    page = page_client.get(reverse("playground:run_detail", args=[run.id])).content.decode()
    figure = numbers.embedded(page)["dla"]
    blocks, totals = figure["data"]
    # The default: the last generated token against the likeliest other one at layer 29.
    target = capture.following[-1]
    final = logprobs[-1, -1]
    [foil] = [int(i) for i in re.findall(r"Foil: <strong>[^<]*\(id (\d+)\)", page)]
    runner_up = max(final[i] for i in range(final.size) if i != target)
    assert foil != target and final[foil] > runner_up - SAME
    expected = attribution(model, tensor, -1, target, foil)
    assert blocks["x"][:2] == ["0 (+ embedding)", "1"] and len(blocks["x"]) == 30
    assert near(blocks["y"], expected)
    # Measured from the logprobs the run reported, by token string.
    top = capture.raw["choices"][0]["logprobs"]["top_logprobs"][-1]

    def string(token_id):
        return model.tokenizer.decode([token_id], skip_special_tokens=False)

    measured = top[string(target)] - top[string(foil)]
    total, shown_measured, residue = totals["y"]
    assert totals["x"] == ["Σ blocks", "measured", "residue"]
    assert total == pytest.approx(expected.sum(), abs=SAME)
    assert shown_measured == pytest.approx(measured, abs=1e-9)
    assert residue == pytest.approx(measured - expected.sum(), abs=SAME)
    assert abs(residue) <= WIDEST.logprob
    # The table beside the figure, to the 3 decimals it prints.
    for name, value in (("sum", total), ("measured", shown_measured), ("residue", residue)):
        assert shown_number(page, name) == pytest.approx(value, abs=6e-4)
    # The sum is the lens's own logit difference at the last layer.
    assert expected.sum() == pytest.approx(final[target] - final[foil], abs=SAME)
    assert figure["layout"]["yaxis"]["title"]["text"] == "contribution (nats)"
    assert figure["layout"]["title"]["text"].startswith(
        f"Direct logit attribution of logit({model.shown(target)}) − logit({model.shown(foil)})"
        f" at position {capture.labels[-1]}"
    )


def test_a_typed_target_and_foil_at_a_picked_position(capture, page_client, model, science):
    run, tensor, labels, logprobs = capture.run, capture.tensor, capture.labels, capture.logprobs
    _, tokenizer = science
    [paris] = tokenizer.encode(" Paris", add_special_tokens=False).ids
    [london] = tokenizer.encode(" London", add_special_tokens=False).ids
    url = lens_url(run, colour="target", position=5, attributed="difference",
                   target="·Paris", foil=" London")  # fmt: skip
    for headers in ({}, HTMX):
        response = page_client.get(url, **headers)
        assert response.status_code == 200
        assert ("<html" in response.content.decode()) is not bool(headers)
        figures = numbers.embedded(response.content.decode())
        heatmap = figures["lens"]["data"][0]
        assert near(heatmap["z"], logprobs[:, 1:, paris])
        low, high = ranks_between(logprobs[:, 5], paris)
        line = figures["lens_rank"]["data"][0]["y"]
        assert ((low <= line) & (line <= high)).all()
        assert figures["lens_rank"]["layout"]["title"]["text"].endswith(f"position {labels[5]}")
        blocks, totals = figures["dla"]["data"]
        expected = attribution(model, tensor, 5, paris, london)
        assert near(blocks["y"], expected)
        # The run reported no prompt logprobs: measured is the lens at layer 29.
        lens_difference = logprobs[-1, 5, paris] - logprobs[-1, 5, london]
        assert totals["y"][1] == pytest.approx(lens_difference, abs=SAME)
        assert abs(totals["y"][2]) < SAME
    # The target's logit alone.
    url = lens_url(run, colour="top", position=5, attributed="logit", target="·Paris", foil="")
    blocks, _ = page_figures(page_client, url, **HTMX)["dla"]["data"]
    assert near(blocks["y"], attribution(model, tensor, 5, paris, None))


def test_a_target_that_is_not_one_token_is_a_field_error(capture, page_client):
    run = capture.run
    url = lens_url(run, colour="top", position=12, attributed="difference",
                   target="Paris is", foil="")  # fmt: skip
    plain = page_client.get(url)
    assert plain.status_code == 400
    partial = page_client.get(url, **HTMX)
    assert partial.status_code == 200
    for response in (plain, partial):
        assert "&#x27;Paris is&#x27; is 2 tokens for this model" in response.content.decode()
    wrong_position = page_client.get(lens_url(run, colour="top", position=99,
                                              attributed="logit", target="", foil=""))  # fmt: skip
    assert wrong_position.status_code == 400


def test_some_layers_get_the_lens_without_the_attribution(lens_science, approved_user,
                                                          page_client, model):  # fmt: skip
    recorder, _ = lens_science
    request = {**CAPTURE, "output_residual_stream": [3, 17]}
    run = numbers.run_through(approved_user, request)
    tensor = numbers.residual_stream(recorder.answer_to(request))
    page = page_client.get(reverse("playground:run_detail", args=[run.id])).content.decode()
    heatmap = numbers.embedded(page)["lens"]["data"][0]
    assert heatmap["y"] == ["3", "17"]
    assert near(heatmap["z"], np.exp(model.logprobs(tensor[:, 1:]).max(axis=-1)))
    assert "needs every layer captured (output_residual_stream: true)" in page
    assert "layers 3, 17 of 30" in page and "dla" not in numbers.embedded(page)


def test_a_model_without_weights_directory_says_so(science, approved_user, page_client):
    run = numbers.run_through(approved_user, CAPTURE)
    page = page_client.get(reverse("playground:run_detail", args=[run.id])).content.decode()
    assert "gives smollm2-135m no weights directory" in page
    assert "lens" not in numbers.embedded(page)


def test_a_weights_directory_that_cannot_be_read_is_named(
    science, approved_user, page_client, tmp_path
):
    LanguageModel.objects.filter(name=MODEL).update(weights_dir=str(tmp_path / "gone"))
    run = numbers.run_through(approved_user, CAPTURE)
    page = page_client.get(reverse("playground:run_detail", args=[run.id])).content.decode()
    assert f"The weights file {tmp_path / 'gone' / 'model.safetensors'} cannot be read" in page
    assert "lens" not in numbers.embedded(page)


def test_another_models_weights_are_named_not_used(
    science, approved_user, page_client, tmp_path, model
):
    (tmp_path / "config.json").write_text(
        json.dumps({"rms_norm_eps": 1e-5, "num_hidden_layers": 2, "tie_word_embeddings": True})
    )
    (tmp_path / "tokenizer.json").write_bytes((model.directory / "tokenizer.json").read_bytes())
    tiny = {"model.norm.weight": np.ones(8, np.float32),
            "model.embed_tokens.weight": np.ones((16, 8), np.float32)}  # fmt: skip
    save_file(tiny, str(tmp_path / "model.safetensors"))
    LanguageModel.objects.filter(name=MODEL).update(weights_dir=str(tmp_path))
    run = numbers.run_through(approved_user, CAPTURE)
    page = page_client.get(reverse("playground:run_detail", args=[run.id])).content.decode()
    assert "have 8 hidden units and this capture 576" in page
    assert "lens" not in numbers.embedded(page)
