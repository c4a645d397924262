"""The logit lens's figures: the top token or a target's logprob by layer and position, the
target's rank, and the direct logit attribution of each layer."""

import itertools
import math
from dataclasses import dataclass

import numpy as np
import plotly.graph_objects as go

from playground.captures import Capture, position_axis, prompt_end_line
from playground.plots import (
    CELL_TEXT,
    PROBABILITY_COLOURS,
    download_meta,
    figure_layout,
    integer_ticks,
    plot_text,
    round_steps,
    token_label,
)

# ---------------------------------------------------------------------------------------
# Inside the model: the logit lens and direct logit attribution (numbers from playground.lens)


@dataclass
class LensCells:
    """What the logit-lens heatmap shows at `layers` × positions `rows`: the top tokens
    (strings [layers][positions][k], the most likely first) with their logprobs
    ([layers, positions, k], nats), and per position the target token (None: unknown) with
    its logprob at each layer ([layers, positions], NaN where unknown)."""

    layers: list[int]
    rows: list[int]
    top_tokens: list[list[list[str]]]
    top_logprobs: np.ndarray
    targets: list[str | None]
    target_logprobs: np.ndarray


def _lens_hover(cells: LensCells, layer: int, column: int, label: str) -> str:
    lines = [f"layer {cells.layers[layer]}, position {plot_text(label)}"]
    for token, logprob in zip(
        cells.top_tokens[layer][column], cells.top_logprobs[layer, column], strict=True
    ):
        lines.append(f"  {token_label(token)}: p={math.exp(logprob):.3f} ({logprob:.3f} nats)")
    target, logprob = cells.targets[column], cells.target_logprobs[layer, column]
    if target is not None and not math.isnan(logprob):
        lines.append(
            f"target {token_label(target)}: p={math.exp(logprob):.3g} ({logprob:.3f} nats)"
        )
    return "<br>".join(lines)


def logit_lens_figure(capture: Capture, cells: LensCells, colour: str, target: str) -> go.Figure:
    """Each captured layer's output × position through the final norm and unembedding: the
    cell's text is its most likely token, its colour that token's probability (`colour`
    "top") or the target's logprob in nats ("target"; `target` names it for the title).
    Hover lists the top tokens and the target's logprob."""
    if colour == "top":
        values = np.exp(cells.top_logprobs[:, :, 0])
        scale = {"colorscale": PROBABILITY_COLOURS, "zmin": 0, "zmax": 1}
        bar, what = "p (top token)", "its probability"
    else:
        values = cells.target_logprobs
        scale = {"colorscale": "Viridis", "zmax": 0}
        bar, what = "log p target (nats)", f"logprob of {target}"
    labels = capture.labels
    figure = go.Figure(
        go.Heatmap(
            z=[[None if math.isnan(v) else float(v) for v in row] for row in values],
            x=cells.rows,
            y=[str(layer) for layer in cells.layers],
            text=[[token_label(tokens[0]) for tokens in row] for row in cells.top_tokens],
            meta={"text": [[tokens[0] for tokens in row] for row in cells.top_tokens]},
            texttemplate="%{text}",
            textfont={**CELL_TEXT, "size": 10},
            customdata=[
                [
                    _lens_hover(cells, layer, column, labels[row])
                    for column, row in enumerate(cells.rows)
                ]
                for layer in range(len(cells.layers))
            ],
            hovertemplate="%{customdata}<extra></extra>",
            xgap=1,
            ygap=1,
            colorbar={"title": {"text": bar}},
            **scale,
        )
    )
    position_axis(figure, capture, cells.rows, tickangle=-45)
    prompt_end_line(figure, capture, cells.rows)
    figure.update_yaxes(title="layer", type="category")
    title = f"Logit lens: the top token at each layer × position (colour: {what})"
    return figure_layout(figure, title, height=max(320, 20 * len(cells.layers) + 180))


def lens_rank_figure(
    capture: Capture, position: int, target: str, ranks: np.ndarray, logprobs: np.ndarray,
    layers: list[int],
) -> go.Figure:  # fmt: skip
    """The target's rank (1: the most likely; log axis, 1 at the top) in the lens of each
    captured layer at one position; hover adds its logprob (nats)."""
    figure = go.Figure(
        go.Scatter(
            x=layers,
            y=[int(rank) for rank in ranks],
            customdata=[float(logprob) for logprob in logprobs],
            mode="lines+markers",
            hovertemplate="layer %{x}: rank %{y}, logprob %{customdata:.3f} nats<extra></extra>",
        )
    )
    figure.update_xaxes(title="layer", **integer_ticks(layers))
    # Ranks are whole numbers: ticks at 1, 2, 5, 10, ... (plotly's own log ticks of a few
    # ranks fall on 1.5 and 2.5).
    ticks = list(itertools.takewhile(lambda tick: tick <= 2 * int(max(ranks)), round_steps()))
    figure.update_yaxes(
        title="rank of the target (1 = most likely)",
        type="log",
        autorange="reversed",
        tickvals=ticks,
        ticktext=[f"{tick:,}" for tick in ticks],
    )
    download_meta(figure, customdata=["target logprob (nats)"])
    title = f"Rank of {target} by layer at position {plot_text(capture.labels[position])}"
    return figure_layout(figure, title)


def logit_attribution_figure(
    capture: Capture, position: int, contributions: np.ndarray, totals: dict, measure: str
) -> go.Figure:
    """Direct logit attribution at one position: each block's contribution (nats) to
    `measure` (e.g. "logit(·Paris) − logit(·London)"), block 0's with the embedding, then
    their sum, the measured value and the residue (measured − sum) from `totals`."""
    blocks = ["0 (+ embedding)", *(str(k) for k in range(1, len(contributions)))]
    figure = go.Figure(
        [
            go.Bar(
                x=blocks,
                y=[float(c) for c in contributions],
                marker_color=["#1f5fbf" if c >= 0 else "#c0392b" for c in contributions],
                name="blocks",
                hovertemplate="block %{x}: %{y:.3f} nats<extra></extra>",
            ),
            go.Bar(
                x=["Σ blocks", "measured", "residue"],
                y=[totals["sum"], totals["measured"], totals["residue"]],
                marker_color=["#555555", "#111111", "#e08214"],
                name="totals",
                hovertemplate="%{x}: %{y:.3f} nats<extra></extra>",
            ),
        ]
    )
    figure.update_xaxes(type="category", title="block (output − input)", tickangle=-45)
    figure.update_yaxes(title="contribution (nats)")
    figure.update_layout(showlegend=False)
    title = (
        f"Direct logit attribution of {measure} at position {plot_text(capture.labels[position])}"
    )
    return figure_layout(figure, title, height=380)
