"""The run page's figures of captured activations: the norm by layer and position, the norm
at one position, cosine similarity and PCA of the rows in a window."""

import numpy as np
import plotly.graph_objects as go

from playground.captures import (
    DEFAULT_WINDOW,
    Capture,
    PositionWindow,
    position_axis,
    prompt_end_line,
)
from playground.plots import figure_layout, integer_ticks, plot_text

NORM_COLOUR_SCALES = {
    "linear": "linear",
    "log": "log₁₀",
    "clip": "clipped at the 95th percentile",
}


def norm_colour_range(
    norms: np.ndarray, colour: str
) -> tuple[np.ndarray, float | None, float | None]:
    """The values a norm heatmap colours (‖h‖, or log₁₀ ‖h‖) and its colour range: None
    (automatic) except when clipped, where it runs from the smallest norm shown to the 95th
    percentile of the norms shown (plotly ignores a zmax given without a zmin)."""
    if colour == "log":
        return np.log10(np.maximum(norms, 1e-6)), None, None
    if colour == "clip":
        return norms, float(norms.min()), float(np.percentile(norms, 95))
    return norms, None, None


def activation_norm_heatmap(
    capture: Capture, window: PositionWindow = DEFAULT_WINDOW, colour: str = "linear"
) -> go.Figure:
    """‖residual‖ by layer × position, coloured linearly, by log₁₀ or clipped (see
    NORM_COLOUR_SCALES); hover always shows the norm itself."""
    rows = window.rows(capture.tensor.shape[1])
    norms = np.linalg.norm(capture.tensor[:, rows, :], axis=-1)
    shown, zmin, zmax = norm_colour_range(norms, colour)
    titles = {"linear": "‖h‖", "log": "log₁₀ ‖h‖", "clip": "‖h‖ (clipped)"}
    figure = go.Figure(
        go.Heatmap(
            z=shown.tolist(),
            customdata=norms.tolist(),
            y=[str(layer) for layer in capture.layers],
            x=rows,
            zmin=zmin,
            zmax=zmax,
            colorscale="Viridis",
            hovertemplate="layer %{y}, position %{x}: ‖h‖=%{customdata:.2f}<extra></extra>",
            colorbar={"title": {"text": titles[colour]}},
        )
    )
    position_axis(figure, capture, rows, tickangle=-45)
    prompt_end_line(figure, capture, rows)
    figure.update_yaxes(title="layer", type="category")
    title = (
        f"Residual-stream norm ‖h‖ by layer × position ({NORM_COLOUR_SCALES[colour]}), "
        f"{window.describe(capture.tensor.shape[1])}"
    )
    return figure_layout(figure, title, height=460)


def activation_norm_by_layer(capture: Capture, position: int) -> go.Figure:
    """‖residual‖ at one position for each captured layer."""
    norms = np.linalg.norm(capture.tensor[:, position, :], axis=-1)
    figure = go.Figure(go.Scatter(x=capture.layers, y=norms.tolist(), mode="lines+markers"))
    figure.update_xaxes(title="layer", **integer_ticks(capture.layers))
    figure.update_yaxes(title="‖h‖ (L2 norm)")
    return figure_layout(figure, f"Norm by layer at position {plot_text(capture.labels[position])}")


def cosine_similarity_matrix(rows: np.ndarray) -> np.ndarray:
    """Pairwise cosine similarity of `[n, d]` rows (a zero row has similarity 0)."""
    norms = np.linalg.norm(rows, axis=-1, keepdims=True)
    unit = rows / np.where(norms == 0, 1, norms)
    return unit @ unit.T


def activation_cosine_figure(
    capture: Capture, layer: int, window: PositionWindow = DEFAULT_WINDOW
) -> go.Figure:
    """Cosine similarity between the positions shown, at one captured layer."""
    rows = window.rows(capture.tensor.shape[1])
    similarity = cosine_similarity_matrix(capture.tensor[capture.layers.index(layer)][rows])
    figure = go.Figure(
        go.Heatmap(
            z=similarity.tolist(),
            x=rows,
            y=rows,
            zmin=-1,
            zmax=1,
            colorscale="RdBu",
            colorbar={"title": {"text": "cos"}},
            hovertemplate="positions i %{y}, j %{x}: cos %{z:.3f}<extra></extra>",
        )
    )
    # A row position and a column position: both in the downloads, under their own names.
    position_axis(figure, capture, rows, "y", title="position i (token)", autorange="reversed")
    position_axis(figure, capture, rows, title="position j (token)", tickangle=-45)
    prompt_end_line(figure, capture, rows, axes="xy")
    title = (
        f"Cosine similarity between positions, layer {layer}, "
        f"{window.describe(capture.tensor.shape[1])}"
    )
    return figure_layout(figure, title, height=460)


def pca_projection(rows: np.ndarray, components: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """Project `[n, d]` rows on their first principal components (numpy SVD); returns the
    coordinates `[n, components]` and each component's share of the variance."""
    centred = rows - rows.mean(axis=0, keepdims=True)
    _, singular, vt = np.linalg.svd(centred, full_matrices=False)
    coordinates = centred @ vt[:components].T
    variance = singular**2
    share = variance[:components] / variance.sum() if variance.sum() else variance[:components]
    if coordinates.shape[1] < components:
        coordinates = np.pad(coordinates, ((0, 0), (0, components - coordinates.shape[1])))
        share = np.pad(share, (0, components - share.shape[0]))
    return coordinates, share


def activation_pca_figure(
    capture: Capture, layer: int, window: PositionWindow = DEFAULT_WINDOW
) -> go.Figure:
    """The positions shown, at one captured layer, projected on their first two principal
    components (of those positions only), each marked with its label."""
    rows = window.rows(capture.tensor.shape[1])
    coordinates, share = pca_projection(capture.tensor[capture.layers.index(layer)][rows])
    figure = go.Figure(
        go.Scatter(
            x=coordinates[:, 0].tolist(),
            y=coordinates[:, 1].tolist(),
            text=[plot_text(capture.labels[row]) for row in rows],
            meta={"text": [capture.rows[row].text_label for row in rows]},
            mode="markers+text",
            textposition="top center",
            marker={
                "color": rows,
                "colorscale": "Viridis",
                "size": 9,
                "colorbar": {"title": {"text": "position"}},
            },
            hovertemplate="position %{text}<extra></extra>",
        )
    )
    figure.update_xaxes(title=f"PC1 ({share[0]:.0%} of the variance)")
    figure.update_yaxes(title=f"PC2 ({share[1]:.0%})")
    title = f"PCA of positions, layer {layer}, {window.describe(capture.tensor.shape[1])}"
    return figure_layout(figure, title, height=420)
