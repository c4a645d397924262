"""Figure builders on recorded answers of the embedded engine (smollm2-135m)."""

import json
import math

import numpy as np
import pytest

from playground import captures, plots, token_positions
from playground.models import StoredRequest
from playground.runs import activation_figures, figures
from playground.steering import figures as steering_figures

from .conftest import recorded

COMPLETION_REQUEST = StoredRequest(
    model="smollm2-135m",
    prompt="The capital of France is",
    max_tokens=6,
    temperature=0,
    logprobs=5,
    prompt_logprobs=3,
    seed=1,
)


@pytest.fixture
def positions():
    return token_positions.token_positions(COMPLETION_REQUEST, recorded("completion_logprobs.json"))


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
    positions = token_positions.token_positions(
        StoredRequest(prompt="Paris is nice", prompt_logprobs=-1), response
    )
    assert [p["token"] for p in positions] == ["Paris", " is", " nice"]
    assert positions[2]["rank"] == 4351


def test_echo_logprobs_split_into_prompt_and_completion():
    request = StoredRequest(prompt="ab", echo=True, logprobs=1)
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
    positions = token_positions.token_positions(request, response)
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
    assert plots.token_label("say \"hi\" & 'bye'") == "say·\"hi\"·&amp;·'bye'"


def test_top_k_figure_highlights_the_actual_token(positions):
    bar = figures.top_k_figure(positions[6]).data[0]
    # ")." and " (" are equally likely (bfloat16): ties go by token text.
    assert list(bar.y) == [".", ",", "·and", "·(", ")."]
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


TOKENS = [None, None, None, None, "<b>"]


def with_tokens(capture, tokens):
    """The capture with its positions named `tokens` (all prompt tokens)."""
    rows = [captures.CapturedRow(row, "prompt", token, None) for row, token in enumerate(tokens)]
    return captures.Capture(capture.tensor, capture.layers, rows)


@pytest.fixture
def captured():
    capture = captures.activations(
        StoredRequest(prompt="", output_residual_stream=[0, 4, 8]), recorded("capture.json")
    )
    return with_tokens(capture, TOKENS)


ALL_POSITIONS = captures.PositionWindow(exclude_first=False)


def test_activation_norm_heatmap_is_layers_by_positions(captured):
    heatmap = activation_figures.activation_norm_heatmap(captured, ALL_POSITIONS).data[0]
    assert np.array(heatmap.z).shape == (3, 5)
    assert list(heatmap.y) == ["0", "4", "8"]
    assert heatmap.z[1][2] == pytest.approx(float(np.linalg.norm(captured.tensor[1, 2])), rel=1e-5)


def test_activation_views_leave_out_the_first_token_by_default(captured):
    heatmap = activation_figures.activation_norm_heatmap(captured).data[0]
    assert list(heatmap.x) == [1, 2, 3, 4] and np.array(heatmap.z).shape == (3, 4)
    cosine = activation_figures.activation_cosine_figure(captured, 4).data[0]
    assert np.array(cosine.z).shape == (4, 4)
    assert len(activation_figures.activation_pca_figure(captured, 4).data[0].x) == 4
    window = captures.PositionWindow(start=2, end=3)
    assert list(activation_figures.activation_norm_heatmap(captured, window).data[0].x) == [2, 3]


def test_all_layer_capture_numbers_rows_from_zero():
    response = recorded("capture.json")
    assert captures.activations(
        StoredRequest(prompt="", output_residual_stream=True), response
    ).layers == [0, 1, 2]


def test_norm_by_layer_follows_one_position(captured):
    line = activation_figures.activation_norm_by_layer(captured, 3).data[0]
    assert list(line.x) == [0, 4, 8]
    assert line.y[2] == pytest.approx(float(np.linalg.norm(captured.tensor[2, 3])), rel=1e-5)


def test_cosine_similarity_has_unit_diagonal_and_is_symmetric(captured):
    z = np.array(activation_figures.activation_cosine_figure(captured, 4, ALL_POSITIONS).data[0].z)
    assert np.allclose(np.diag(z), 1, atol=1e-5)
    assert np.allclose(z, z.T, atol=1e-6)


def test_pca_recovers_a_planar_point_cloud():
    rng = np.random.default_rng(0)
    plane = rng.standard_normal((8, 2)) @ rng.standard_normal((2, 16))
    coordinates, share = activation_figures.pca_projection(plane)
    assert share.sum() == pytest.approx(1.0)
    assert np.allclose(
        np.linalg.norm(coordinates, axis=1), np.linalg.norm(plane - plane.mean(0), axis=1)
    )


def test_pca_figure_places_every_position(captured):
    scatter = activation_figures.activation_pca_figure(captured, 8, ALL_POSITIONS).data[0]
    assert len(scatter.x) == 5 and list(scatter.text) == ["0", "1", "2", "3", "4 &lt;b&gt;"]


COMPARED = {
    "run": "r", "scale": 4.0, "scale_entered": 4.0, "label": "4",
    "baseline_tokens": {"under_baseline": [-1.0, -2.0], "under_steered": [-1.5, -1.0],
                        "kl": [0.25, 0.75]},
    "steered_tokens": {"strings": ["c", "d<"], "ids": [3, 4],
                       "under_baseline": [-4.0, -3.0], "under_steered": [-1.0, -1.0]},
}  # fmt: skip


def test_same_token_figure_plots_steered_minus_baseline_on_each_text():
    figure = steering_figures.same_token_figure(["a", " b"], COMPARED)
    base, own, kl = figure.data
    assert list(base.y) == [-0.5, 1.0] and list(own.y) == [3.0, 2.0]
    assert list(kl.y) == [0.25, 0.75] and kl.yaxis == "y2"
    assert list(figure.layout.xaxis.ticktext) == ["0 a/c", "1 ·b/d&lt;"]
    assert "nats" in figure.layout.yaxis.title.text
    assert steering_figures.same_token_summary(COMPARED) == {
        "delta_baseline_tokens": 0.25, "delta_steered_tokens": 2.5, "kl": 0.5,
    }  # fmt: skip


def test_sweep_points_report_target_logprob_and_mean_shift():
    baseline, steered = recorded("steer_baseline.json"), recorded("steer_steered.json")
    points = steering_figures.sweep_points([(4.0, steered), (0.0, baseline)], "'s", {4.0: COMPARED})
    assert [p["scale"] for p in points] == [0.0, 4.0]
    assert points[0]["mean_shift"] == 0 and points[1]["mean_shift"] == 0.25
    assert points[1]["mean_kl"] == 0.5
    assert points[0]["target_logprob"] == pytest.approx(-0.79675, abs=1e-4)
    assert points[1]["target_logprob"] is None  # not in the steered top-5
    assert points[1]["missing"] == "the target is outside the top-5 returned"
    figure = steering_figures.scale_sweep_figure(points, "'s")
    assert [trace.name for trace in figure.data] == [
        "logprob of 's (left)",
        "mean Δ logprob, baseline's tokens (right)",
        "mean KL(baseline ‖ steered) (right)",
    ]
    assert json.loads(figure.to_json())["data"][1]["yaxis"] == "y2"
    # The scale without it is named, with the reason, instead of a silent gap.
    note = figure.layout.annotations[0].text
    assert note == "No logprob of 's at 4: the target is outside the top-5 returned."


def _positions(sources: str) -> list[dict]:
    return [
        {"source": "prompt" if source == "p" else "completion", "token": f"t{index}",
         "logprob": -1.0, "rank": 1, "top": [], "position": index, "probability": 0.37}
        for index, source in enumerate(sources)
    ]  # fmt: skip


def test_token_strip_rows_are_labelled_by_token_offset():
    figure = figures.token_strip_figure(_positions("p" * 5 + "c" * 15))
    assert list(figure.layout.yaxis.ticktext) == [
        "prompt #0–4",
        "completion #5–16",
        "completion #17–19",
    ]


def test_token_strip_text_is_dark_on_light_cells_at_a_readable_size():
    heatmap = figures.token_strip_figure(_positions("pc")).data[0]
    assert heatmap.textfont.size >= 12

    def luminance(colour: str) -> float:
        red, green, blue = (int(colour[i : i + 2], 16) / 255 for i in (1, 3, 5))
        return 0.2126 * red + 0.7152 * green + 0.0722 * blue

    assert luminance(heatmap.textfont.color) < 0.1
    assert all(luminance(colour) > 0.5 for _, colour in heatmap.colorscale)


def test_capture_positions_are_labelled_by_their_tokens():
    response = recorded("completion_logprobs.json")
    rows = captures.capture_rows(COMPLETION_REQUEST, response, None, 7)
    assert [row.label for row in rows] == [
        "0 The", "1 ·capital", "2 ·of", "3 ·France", "4 ·is", "5 ·Paris", "6 .",
    ]  # fmt: skip
    assert [row.part for row in rows].count("prompt") == 5
    unscored = COMPLETION_REQUEST.model_copy(update={"prompt_logprobs": None})
    no_tokens = {"choices": [{**response["choices"][0], "prompt_logprobs": None,
                              "logprobs": None}], "usage": response["usage"]}  # fmt: skip
    assert [row.label for row in captures.capture_rows(unscored, no_tokens, None, 2)] == ["0", "1"]


def test_capture_axes_show_the_position_tokens(captured):
    heatmap = activation_figures.activation_norm_heatmap(captured, ALL_POSITIONS)
    assert list(heatmap.layout.xaxis.ticktext) == ["0", "1", "2", "3", "4 &lt;b&gt;"]
    cosine = activation_figures.activation_cosine_figure(captured, 4, ALL_POSITIONS)
    assert list(cosine.layout.yaxis.ticktext) == list(cosine.layout.xaxis.ticktext)
    norm = activation_figures.activation_norm_by_layer(captured, 4)
    assert norm.layout.title.text == "Norm by layer at position 4 &lt;b&gt;"


def test_position_labels_keep_quotes_and_escape_markup(captured):
    capture = with_tokens(captured, ["He", ' "', "a<b", "&", "'x'"])
    shown = ["0 He", '1 ·"', "2 a&lt;b", "3 &amp;", "4 'x'"]
    heatmap = activation_figures.activation_norm_heatmap(capture, ALL_POSITIONS)
    assert list(heatmap.layout.xaxis.ticktext) == shown
    cosine = activation_figures.activation_cosine_figure(capture, 4, ALL_POSITIONS)
    assert list(cosine.layout.xaxis.ticktext) == shown
    assert (
        list(activation_figures.activation_pca_figure(capture, 4, ALL_POSITIONS).data[0].text)
        == shown
    )
    norm = activation_figures.activation_norm_by_layer(capture, 1)
    assert norm.layout.title.text == 'Norm by layer at position 1 ·"'


def _whole_number_ticks(axis, values) -> bool:
    """Ticks on whole numbers only, and none beyond the values plotted."""
    return (
        axis.tickmode == "linear"
        and axis.tick0 == 0
        and float(axis.dtick).is_integer()
        and tuple(axis.range) == (min(values) - 0.5, max(values) + 0.5)
    )


def test_position_and_layer_axes_tick_whole_numbers_only(positions, captured):
    for figure in (
        figures.prompt_surprisal_figure(positions),
        activation_figures.activation_norm_by_layer(captured, 0),
    ):
        x = figure.data[0].x
        assert _whole_number_ticks(figure.layout.xaxis, x), figure.layout.title.text
    assert figures.prompt_surprisal_figure(positions).layout.xaxis.dtick == 1


def test_long_position_axes_tick_every_few_whole_numbers():
    assert [plots.integer_ticks(range(count))["dtick"] for count in (4, 12, 13, 30, 300)] == [
        1, 1, 2, 5, 50
    ]  # fmt: skip


def test_norm_heatmap_colours_by_log_or_clipped_norm_keeping_the_norm_on_hover():
    tensor = np.ones((2, 4, 3), dtype=np.float32)
    tensor[:, 0] *= 1000  # the first position dwarfs the others, as in real models
    tensor[:, 3] *= 2
    norms = np.linalg.norm(tensor, axis=-1)
    capture = with_tokens(captures.Capture(tensor, [0, 1], []), list("abcd"))
    log = activation_figures.activation_norm_heatmap(capture, ALL_POSITIONS, colour="log")
    assert np.allclose(log.data[0].z, np.log10(norms))
    assert np.allclose(log.data[0].customdata, norms)
    clipped = activation_figures.activation_norm_heatmap(capture, ALL_POSITIONS, colour="clip")
    # Both ends of the colour range are set: plotly ignores a zmax without a zmin.
    assert clipped.data[0].zmax == pytest.approx(float(np.percentile(norms, 95)))
    assert clipped.data[0].zmin == pytest.approx(float(norms.min()))
    assert "clipped" in clipped.layout.title.text
    linear = activation_figures.activation_norm_heatmap(capture, ALL_POSITIONS).data[0]
    assert linear.zmax is None and linear.zmin is None


def _scored(prompt_tokens: list[tuple[str, float]], scored_tokens: list[tuple[str, float]]):
    """A response to a request with prompt_logprobs 0 and prompts [prompt, prompt + target]."""

    def entries(tokens):
        return [None] + [
            {str(index): {"logprob": logprob, "rank": 7, "decoded_token": token}}
            for index, (token, logprob) in enumerate(tokens[1:])
        ]

    steered = recorded("steer_steered.json")
    first = {**steered["choices"][0], "prompt_logprobs": entries(prompt_tokens)}
    second = {**steered["choices"][0], "index": 1, "prompt_logprobs": entries(scored_tokens)}
    return {**steered, "choices": [first, second]}


def test_target_logprob_comes_from_the_scored_prompt_whatever_its_rank():
    prompt = [("I", 0.0), (" think", -2.0)]
    response = _scored(prompt, [*prompt, (" happ", -9.0), ("y", -0.5)])
    assert steering_figures.target_logprob(response, " happy") == (pytest.approx(-9.5), "")


def test_target_merged_into_the_prompt_token_is_reported_missing():
    response = _scored([("I", 0.0), (" think", -2.0)], [("I", 0.0), (" thinking", -3.0)])
    assert steering_figures.target_logprob(response, "ing") == (
        None,
        "the target does not start a new token after the prompt",
    )


def test_sweep_with_no_target_logprob_says_why_instead_of_an_empty_line():
    baseline, steered = recorded("steer_baseline.json"), recorded("steer_steered.json")
    points = steering_figures.sweep_points(
        [(0.0, baseline), (-1.5, steered), (3.0, steered)], " zebra"
    )
    figure = steering_figures.scale_sweep_figure(points, " zebra", "scale (× layer's typical norm)")
    # Nothing compared on the same tokens either: no line at all, and the note says why.
    assert list(figure.data) == []
    assert figure.layout.annotations[0].text == (
        "No logprob of ·zebra at any scale: the target is outside the top-5 returned."
    )
    assert figure.layout.xaxis.title.text == "scale (× layer's typical norm)"


def test_top_k_title_counts_the_alternatives_asked_for_not_those_returned():
    # logprobs: 4 and a sampled token outside the top 4: the API returns 5 entries.
    request = StoredRequest(prompt="ab", logprobs=4)
    top = {"x": -0.1, "y": -2.0, "z": -3.0, "w": -4.0, "v": -6.0}
    response = {"choices": [{"text": "v", "logprobs": {
        "tokens": ["v"], "token_logprobs": [-6.0], "top_logprobs": [top], "text_offset": [2],
    }}]}  # fmt: skip
    position = token_positions.token_positions(request, response)[0]
    figure = figures.top_k_figure(position)
    assert figure.layout.title.text == "Top-4 at position 0 (v), and the token itself (below them)"
    assert list(figure.data[0].y) == ["x", "y", "z", "w", "v"]
    assert list(figure.data[0].marker.color) == ["#9db3d6"] * 4 + ["#1f5fbf"]
