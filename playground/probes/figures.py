"""The probe page's plotly figures: accuracy and AUROC by layer, each with its bootstrap 95%
interval, beside the shuffled-label control and the chance level (the majority-class
baseline for accuracy, 0.5 for AUROC)."""

import plotly.graph_objects as go

from playground.plots import figure_entry

PROBE_COLOUR = "#2166ac"
CONTROL_COLOUR = "#b2182b"
BASELINE_COLOUR = "#666666"


def _with_interval(layers, entries, value: str, name: str, colour: str, dash: str = "solid"):
    values = [entry[value] for entry in entries]
    intervals = [entry[f"{value}_ci"] for entry in entries]
    return go.Scatter(
        x=layers,
        y=values,
        name=name,
        mode="lines+markers",
        line={"color": colour, "dash": dash},
        error_y={
            "type": "data",
            "symmetric": False,
            "array": [high - middle for (_, high), middle in zip(intervals, values, strict=True)],
            "arrayminus": [
                middle - low for (low, _), middle in zip(intervals, values, strict=True)
            ],
            "color": colour,
        },
        customdata=intervals,
        hovertemplate="layer %{x}: %{y:.3f} (95% CI %{customdata[0]:.3f}–%{customdata[1]:.3f})"
        f"<extra>{name}</extra>",
    )


def _layout(figure: go.Figure, title: str, axis: str) -> go.Figure:
    figure.update_layout(
        title={"text": title, "x": 0},
        height=340,
        margin={"l": 60, "r": 20, "t": 40, "b": 40},
        template="plotly_white",
        legend={"orientation": "h", "y": -0.25},
    )
    figure.update_xaxes(title_text="layer (output of decoder block k)")
    figure.update_yaxes(title_text=axis, range=[0, 1.05])
    return figure


def accuracy_figure(entries: list[dict]) -> go.Figure:
    layers = [entry["layer"] for entry in entries]
    figure = go.Figure(
        [
            _with_interval(layers, entries, "accuracy", "probe", PROBE_COLOUR),
            _with_interval(
                layers,
                entries,
                "control_accuracy",
                "control (shuffled labels)",
                CONTROL_COLOUR,
                "dot",
            ),
            go.Scatter(
                x=layers,
                y=[entry["baseline_accuracy"] for entry in entries],
                name="majority-class baseline",
                mode="lines",
                line={"color": BASELINE_COLOUR, "dash": "dash"},
                hovertemplate="layer %{x}: %{y:.3f}<extra>majority class</extra>",
            ),
        ]
    )
    return _layout(figure, "Held-out accuracy by layer (95% bootstrap intervals)", "accuracy")


def auroc_figure(entries: list[dict]) -> go.Figure:
    layers = [entry["layer"] for entry in entries]
    figure = go.Figure(
        [
            _with_interval(layers, entries, "auroc", "probe", PROBE_COLOUR),
            _with_interval(
                layers,
                entries,
                "control_auroc",
                "control (shuffled labels)",
                CONTROL_COLOUR,
                "dot",
            ),
            go.Scatter(
                x=layers,
                y=[0.5] * len(layers),
                name="chance (0.5)",
                mode="lines",
                line={"color": BASELINE_COLOUR, "dash": "dash"},
                hoverinfo="skip",
            ),
        ]
    )
    return _layout(figure, "Held-out AUROC by layer (95% bootstrap intervals)", "AUROC")


def probe_figures(entries: list[dict]) -> list[dict]:
    """The page's figures as it embeds them (`figure_entry`), drawn at the page's width."""
    return [
        {**figure_entry("probe_accuracy", accuracy_figure(entries)), "width": "fit"},
        {**figure_entry("probe_auroc", auroc_figure(entries)), "width": "fit"},
    ]
