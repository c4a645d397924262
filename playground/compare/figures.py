"""The comparison page's figures: Δ logprob of each run's tokens, and the norm of the
activation difference by layer and position."""

import plotly.graph_objects as go

from playground import plots
from playground.compare.differences import TokenSequence

DELTA_AXIS = "Δ logprob, B's settings − A's (nats)"


def logprob_difference_figure(side: str, sequence: TokenSequence, difference: dict) -> go.Figure:
    """Bars of Δ logprob at each scored position of one run's tokens, ticks naming the
    tokens, a dashed line where the prompt ends."""
    positions = difference["positions"]
    labels = [plots.token_label(sequence.strings[p]) for p in positions]
    scores = [
        [sequence.strings[p], under_a, under_b]
        for p, under_a, under_b in zip(
            positions, difference["under_a"], difference["under_b"], strict=True
        )
    ]
    figure = go.Figure(
        go.Bar(
            x=positions,
            y=difference["delta"],
            marker_color="#1f5fbf" if side == "a" else "#e08214",
            customdata=[[label, *rest] for label, (_, *rest) in zip(labels, scores, strict=True)],
            # The downloads hold the tokens' own text (static/js/exports.js).
            meta={"customdata": scores},
            hovertemplate=(
                "position %{x} %{customdata[0]}: log p under A %{customdata[1]:.3f}, "
                "under B %{customdata[2]:.3f}, Δ %{y:.3f} nats<extra></extra>"
            ),
        )
    )
    step = max(1, -(-len(positions) // 40))
    figure.update_xaxes(
        title="position (token)",
        tickmode="array",
        tickvals=positions[::step],
        ticktext=[f"{p} {label}" for p, label in zip(positions, labels, strict=True)][::step],
        tickangle=-45,
    )
    plots.export_labels(figure, "x", {p: f"{p} {sequence.strings[p]}" for p in positions})
    plots.download_meta(figure, customdata=["token", "log p under A", "log p under B"])
    if 1 < sequence.prompt_length < len(sequence.ids):
        figure.add_vline(
            x=sequence.prompt_length - 0.5, line={"color": "#444444", "width": 1, "dash": "dash"}
        )
    figure.update_yaxes(title=DELTA_AXIS, zeroline=True, zerolinecolor="#888888")
    title = f"Run {side.upper()}'s tokens under both runs' settings"
    return plots.figure_layout(figure, title, height=380).update_layout(margin={"b": 110})


def activation_difference_figure(difference: dict) -> go.Figure:
    norms = difference["norms"]
    positions = list(range(norms.shape[1]))
    figure = go.Figure(
        go.Heatmap(
            z=norms.tolist(),
            x=positions,
            y=[str(layer) for layer in difference["layers"]],
            colorscale="Viridis",
            hovertemplate="layer %{y}, position %{x}: ‖h_A − h_B‖=%{z:.2f}<extra></extra>",
            colorbar={"title": {"text": "‖h_A − h_B‖"}},
        )
    )
    step = max(1, -(-len(positions) // 40))
    figure.update_xaxes(
        title="position (A's token/B's token where they differ)",
        tickmode="array",
        tickvals=positions[::step],
        ticktext=[plots.plot_text(label) for label in difference["labels"]][::step],
        tickangle=-45,
    )
    plots.export_labels(figure, "x", dict(enumerate(difference["texts"])))
    figure.update_yaxes(title="layer", type="category")
    return plots.figure_layout(
        figure, "Activation difference ‖h_A − h_B‖ by layer × position", height=460
    )
