"""A figure's CSV and JSON downloads, made by static/js/exports.js (run here under node, see
figure_downloads.js) from the figures the builders make (issue 43 item 5): the cosine matrix
keeps both its positions, every token is its own text (the figures draw whitespace as · and
⏎), and no CSV cell is a formula a spreadsheet would run. The browser suite clicks the buttons
(tests/browser/test_figure_exports.py)."""

import csv
import io
import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from playground import plots
from playground.compare import differences
from playground.compare import figures as compare_figures
from playground.runs import activation_figures, figures
from playground.steering import figures as steering_figures

from .test_figures import ALL_POSITIONS, captured, positions, with_tokens  # noqa: F401

NODE = shutil.which("node")
HARNESS = Path(__file__).with_name("figure_downloads.js")

pytestmark = pytest.mark.skipif(NODE is None, reason="node is not installed")

# Tokens as a model writes them: spaces, a newline, markup, and text a spreadsheet would run.
TOKENS = ["He", " =1+1", "a<b", "\n", "@me"]


def downloads(built: dict[str, object] | None = None, cells: list | None = None) -> dict:
    """What exports.js makes of `built` (figure name → plotly figure, or the dict the page
    embeds) and of `cells` (values written as CSV cells)."""
    embedded = {
        name: figure if isinstance(figure, dict) else plots.figure_entry(name, figure)["data"]
        for name, figure in (built or {}).items()
    }
    answer = subprocess.run(
        [NODE, str(HARNESS)],
        input=json.dumps({"figures": embedded, "cells": cells or []}),
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return json.loads(answer.stdout)


def csv_rows(text: str) -> list[dict]:
    return list(csv.DictReader(io.StringIO(text, newline="")))


def test_csv_cells_a_spreadsheet_would_run_start_with_a_quote_and_numbers_stay_numbers():
    cells = [-1.25, "-1.25", "+3", "-2e-05", "-", "=1+1", "@user", "\t=1", "\r=1", "-2+3", 0]
    cells += ["a=b", " -", None, 'say "hi", -', "=a,b"]
    assert downloads(cells=cells)["cells"] == [
        "-1.25", "-1.25", "+3", "-2e-05", "'-", "'=1+1", "'@user", "'\t=1", "\"'\r=1\"",
        "'-2+3", "0", "a=b", " -", "", '"say ""hi"", -"', "\"'=a,b\"",
    ]  # fmt: skip


def test_the_cosine_csv_holds_both_positions_of_each_pair(captured):  # noqa: F811
    capture = with_tokens(captured, TOKENS)
    cosine = activation_figures.activation_cosine_figure(capture, 4, ALL_POSITIONS)
    made = downloads({"cosine": cosine})["figures"]["cosine"]
    rows = csv_rows(made["csv"])
    pairs = {(int(row["position i (token)"]), int(row["position j (token)"])) for row in rows}
    assert len(rows) == len(pairs) == 25
    rows_at_4 = capture.tensor[capture.layers.index(4)]
    unit = rows_at_4 / np.linalg.norm(rows_at_4, axis=-1, keepdims=True)
    for row in rows:
        i, j = int(row["position i (token)"]), int(row["position j (token)"])
        assert float(row["cos"]) == pytest.approx(float(unit[i] @ unit[j]), abs=1e-3)
        assert row["position i (token) label"] == f"{i} {TOKENS[i]}"
        assert row["position j (token) label"] == f"{j} {TOKENS[j]}"
    # Two axes of one name (a figure titled so) still give two columns.
    same = plots.figure_entry("cosine", cosine)["data"]
    same["layout"]["yaxis"]["title"]["text"] = same["layout"]["xaxis"]["title"]["text"]
    [record, *_] = downloads({"cosine": same})["figures"]["cosine"]["json"]["records"]
    assert {"position j (token) (x)", "position j (token) (y)"} <= set(record)


def test_downloads_hold_the_tokens_own_text_not_the_figures_visible_whitespace(
    captured,  # noqa: F811
    positions,  # noqa: F811
):
    capture = with_tokens(captured, TOKENS)
    top = {
        "position": 3, "token": " Paris", "logprob": -0.5, "rank": 1, "top_k": 3,
        "top": [{"token": t, "logprob": -0.5 - k, "is_actual": k == 0}
                for k, t in enumerate([" Paris", "-", "\n\n"])],
    }  # fmt: skip
    compared = {
        "label": "4",
        "baseline_tokens": {"under_baseline": [-1.0, -2.0], "under_steered": [-1.5, -1.0],
                            "kl": None},
        "steered_tokens": {"under_baseline": [-3.0], "under_steered": [-2.0],
                           "strings": ["=x"]},
    }  # fmt: skip
    built = {
        "tokens": figures.token_strip_figure(positions),
        "heatmap": activation_figures.activation_norm_heatmap(capture, ALL_POSITIONS),
        "pca": activation_figures.activation_pca_figure(capture, 4, ALL_POSITIONS),
        "topk": figures.top_k_figure(top),
        "same": steering_figures.same_token_figure([" the", "\n"], compared),
        "sweep": steering_figures.scale_sweep_figure(
            [{"scale": 0.0, "target_logprob": -2.0, "missing": "", "mean_shift": None}], " Paris"
        ),
    }
    made = downloads(built)["figures"]
    # The token strip: each cell's token, as the API returned it ("\n", not ⏎).
    records = made["tokens"]["json"]["records"]
    assert [record["text"] for record in records] == [p["token"] for p in positions]
    assert "\n" in [row["text"] for row in csv_rows(made["tokens"]["csv"])]
    # A position axis names each position by "index token", the token's own text.
    heatmap = csv_rows(made["heatmap"]["csv"])
    labels = {int(row["position (token)"]): row["position (token) label"] for row in heatmap}
    assert labels == {i: f"{i} {token}" for i, token in enumerate(TOKENS)}
    pca = made["pca"]["json"]["records"]
    assert [record["text"] for record in pca] == [f"{i} {t}" for i, t in enumerate(TOKENS)]
    # Top-k bars by their token; a token a spreadsheet would run quoted in the CSV only.
    assert [r["y"] for r in made["topk"]["json"]["records"]] == [" Paris", "-", "\n\n"]
    assert [r["y"] for r in csv_rows(made["topk"]["csv"])] == [" Paris", "'-", "\n\n"]
    # The same-token bars: each bar's token and scores, the ticks' pairs, negative Δ as numbers.
    same = csv_rows(made["same"]["csv"])
    pair = "generated position (baseline / steered token) label"
    assert [(row["token"], row[pair]) for row in same] == [
        (" the", "0  the/=x"), ("\n", "1 \n"), ("'=x", "0  the/=x"),
    ]  # fmt: skip
    assert [row[steering_figures.DELTA_AXIS] for row in same] == ["-0.5", "1", "1"]
    assert [row["log p_baseline"] for row in same] == ["-1", "-2", "-3"]
    # A sweep's line named by its target's own text.
    assert made["sweep"]["json"]["records"][0]["trace"] == "logprob of  Paris (left)"
    # The figures themselves still draw the visible forms.
    assert list(built["topk"].data[0].y) == ["·Paris", "-", "⏎⏎"]


def test_a_comparisons_downloads_hold_the_tokens_own_text():
    sequence = differences.TokenSequence(
        ids=[1, 2, 3], strings=["He", " said", "\n"], prompt_length=2
    )
    difference = {"positions": [1, 2], "delta": [-0.25, 0.5], "under_a": [-1.0, -2.0],
                  "under_b": [-1.25, -1.5]}  # fmt: skip
    activations = {"layers": [0], "norms": np.array([[0.0, 1.0]]), "labels": ["0 He", "1 ·a/·b"],
                   "texts": ["0 He", "1  a/ b"]}  # fmt: skip
    made = downloads(
        {
            "delta": compare_figures.logprob_difference_figure("a", sequence, difference),
            "activations": compare_figures.activation_difference_figure(activations),
        }
    )["figures"]
    delta = made["delta"]["json"]["records"]
    assert [(r["token"], r["position (token) label"]) for r in delta] == [
        (" said", "1  said"), ("\n", "2 \n"),
    ]  # fmt: skip
    assert [r["log p under B"] for r in delta] == [-1.25, -1.5]
    labels = [r["position (A's token/B's token where they differ) label"]
              for r in made["activations"]["json"]["records"]]  # fmt: skip
    assert labels == ["0 He", "1  a/ b"]
