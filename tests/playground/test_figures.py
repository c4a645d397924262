"""Figure builders on recorded answers of the embedded engine (smollm2-135m)."""

import json
import math

import numpy as np
import pytest

from playground import figures

from .conftest import recorded

COMPLETION_REQUEST = {
    "model": "smollm2-135m",
    "prompt": "The capital of France is",
    "max_tokens": 6,
    "temperature": 0,
    "logprobs": 5,
    "prompt_logprobs": 3,
    "seed": 1,
}


@pytest.fixture
def positions():
    return figures.token_positions(COMPLETION_REQUEST, recorded("completion_logprobs.json"))


def test_token_positions_align_prompt_and_completion_tokens(positions):
    assert [p["token"] for p in positions] == [
        "The", " capital", " of", " France", " is",
        " Paris", ".", "\n", "\n", "The", " answer",
    ]  # fmt: skip
    assert [p["source"] for p in positions].count("prompt") == 5
    assert positions[0]["logprob"] is None
    # " capital" is outside the top-3, so its entry is the fourth, with its real rank.
    assert positions[1]["rank"] == 2787
    assert positions[5]["rank"] == 1
    assert positions[5]["probability"] == pytest.approx(math.exp(-0.27716827392578125))


def test_full_vocabulary_prompt_tokens_are_found_by_the_prompt_text():
    response = recorded("full_vocab_trimmed.json")
    positions = figures.token_positions(
        {"prompt": "Paris is nice", "prompt_logprobs": -1}, response
    )
    assert [p["token"] for p in positions] == ["Paris", " is", " nice"]
    assert positions[2]["rank"] == 4351


def test_echo_logprobs_split_into_prompt_and_completion():
    request = {"prompt": "ab", "echo": True, "logprobs": 1}
    response = {
        "choices": [
            {
                "text": "abc",
                "logprobs": {
                    "tokens": ["a", "b", "c"],
                    "token_logprobs": [None, -1.0, -0.5],
                    "top_logprobs": [None, {"b": -1.0}, {"c": -0.5}],
                    "text_offset": [0, 1, 2],
                },
            }
        ]
    }
    positions = figures.token_positions(request, response)
    assert [(p["source"], p["token"]) for p in positions] == [
        ("prompt", "a"),
        ("prompt", "b"),
        ("completion", "c"),
    ]


def test_token_strip_colours_by_probability_and_hovers_details(positions):
    figure = figures.token_strip_figure(positions)
    heatmap = figure.data[0]
    assert len(heatmap.z) == 2  # prompt row, completion row
    assert heatmap.z[0][0] is None and heatmap.z[1][0] == pytest.approx(0.758, abs=1e-3)
    assert "rank: 2787" in heatmap.customdata[0][1][0]
    assert heatmap.customdata[1][0][1] == 5  # click → position


def test_token_labels_escape_html():
    positions = [
        {"source": "completion", "token": "<script>", "logprob": -1.0, "rank": 1,
         "top": [{"token": "<b>", "logprob": -1.0, "is_actual": False}],
         "position": 0, "probability": 0.37},
    ]  # fmt: skip
    text = figures.token_strip_figure(positions).to_json()
    assert "<script>" not in text
    assert "&lt;script&gt;" in text and "&lt;b&gt;" in text


def test_token_labels_keep_quotes_plotly_would_show_as_entities():
    # plotly decodes &lt; &gt; &amp; and numeric entities in text, but not &quot;, which it
    # would show literally: quotes need no escaping in text, so they stay as they are.
    assert figures._label("say \"hi\" & 'bye'") == "say·\"hi\"·&amp;·'bye'"


def test_top_k_figure_highlights_the_actual_token(positions):
    bar = figures.top_k_figure(positions[6]).data[0]
    assert list(bar.y) == [".", ",", "·and", ").", "·("]
    assert bar.marker.color[0] == "#1f5fbf" and bar.marker.color[1] == "#9db3d6"


def test_prompt_surprisal_is_minus_logprob_of_scored_prompt_tokens(positions):
    bar = figures.prompt_surprisal_figure(positions).data[0]
    assert list(bar.x) == [1, 2, 3, 4]
    assert bar.y[0] == pytest.approx(11.6055, abs=1e-4)


def test_prompt_distribution_plots_probability_by_rank():
    prompt_logprobs = recorded("full_vocab_trimmed.json")["choices"][0]["prompt_logprobs"]
    line = figures.prompt_distribution_figure(prompt_logprobs, 2).data[0]
    assert line.x[0] == 1 and list(line.x) == sorted(line.x)
    assert line.y[0] >= line.y[-1]


@pytest.fixture
def captured():
    return figures.activations({"output_residual_stream": [0, 4, 8]}, recorded("capture.json"))


def test_activation_norm_heatmap_is_layers_by_positions(captured):
    tensor, layers = captured
    heatmap = figures.activation_norm_heatmap(tensor, layers).data[0]
    assert np.array(heatmap.z).shape == (3, 5)
    assert list(heatmap.y) == [0, 4, 8]
    assert heatmap.z[1][2] == pytest.approx(float(np.linalg.norm(tensor[1, 2])), rel=1e-5)


def test_all_layer_capture_numbers_rows_from_zero():
    response = recorded("capture.json")
    _, layers = figures.activations({"output_residual_stream": True}, response)
    assert layers == [0, 1, 2]


def test_norm_by_layer_follows_one_position(captured):
    tensor, layers = captured
    line = figures.activation_norm_by_layer(tensor, layers, 3).data[0]
    assert list(line.x) == [0, 4, 8]
    assert line.y[2] == pytest.approx(float(np.linalg.norm(tensor[2, 3])), rel=1e-5)


def test_cosine_similarity_has_unit_diagonal_and_is_symmetric(captured):
    tensor, layers = captured
    z = np.array(figures.activation_cosine_figure(tensor, layers, 4).data[0].z)
    assert np.allclose(np.diag(z), 1, atol=1e-5)
    assert np.allclose(z, z.T, atol=1e-6)


def test_pca_recovers_a_planar_point_cloud():
    rng = np.random.default_rng(0)
    plane = rng.standard_normal((8, 2)) @ rng.standard_normal((2, 16))
    coordinates, share = figures.pca_projection(plane)
    assert share.sum() == pytest.approx(1.0)
    assert np.allclose(
        np.linalg.norm(coordinates, axis=1), np.linalg.norm(plane - plane.mean(0), axis=1)
    )


def test_pca_figure_places_every_position(captured):
    tensor, layers = captured
    scatter = figures.activation_pca_figure(tensor, layers, 8).data[0]
    assert len(scatter.x) == 5 and list(scatter.text) == ["0", "1", "2", "3", "4"]


def test_steering_difference_is_steered_minus_baseline_per_position():
    baseline, steered = recorded("steer_baseline.json"), recorded("steer_steered.json")
    bar = figures.steering_difference_figure(baseline, steered).data[0]
    base = baseline["choices"][0]["logprobs"]["token_logprobs"]
    other = steered["choices"][0]["logprobs"]["token_logprobs"]
    assert list(bar.y) == pytest.approx([s - b for b, s in zip(base, other, strict=True)])
    assert bar.customdata[0][0] == "'s"


def test_sweep_points_report_target_logprob_and_mean_shift():
    baseline, steered = recorded("steer_baseline.json"), recorded("steer_steered.json")
    points = figures.sweep_points([(4.0, steered), (0.0, baseline)], "'s")
    assert [p["scale"] for p in points] == [0.0, 4.0]
    assert points[0]["mean_shift"] == 0
    assert points[0]["target_logprob"] == pytest.approx(-0.79675, abs=1e-4)
    assert points[1]["target_logprob"] is None  # not in the steered top-5
    figure = figures.scale_sweep_figure(points, "'s")
    assert [trace.name for trace in figure.data] == ["logprob of 's", "mean logprob shift"]
    assert json.loads(figure.to_json())["data"][1]["yaxis"] == "y2"
