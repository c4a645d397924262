"""What every figure of the playground shares: token text made safe and visible, the layout,
whole-number axes, the meta its downloads read, and the position axis of captured rows.

Every token string shown in a figure goes through `token_label` (or `plot_text` when its
whitespace is already made visible), because plotly renders a subset of HTML tags inside
text: model output must always appear as text.
"""

import html
import itertools
import json
from collections.abc import Sequence

import plotly.graph_objects as go

STRIP_WIDTH = 12
# Light colours, so the dark token text on every cell stays readable.
PROBABILITY_COLOURS = [[0.0, "#f4a582"], [0.5, "#fee08b"], [1.0, "#a6d96a"]]
CELL_TEXT = {"size": 12, "color": "#111111"}


def visible_token(token: str) -> str:
    """A token with its whitespace made visible (plain text, not yet escaped)."""
    return token.replace("\n", "⏎").replace("\t", "⇥").replace(" ", "·") or "∅"


def plot_text(text: str) -> str:
    """Plain text as safe plotly text: HTML escaped. Quotes stay: plotly shows `&quot;`
    literally (it decodes only a few named entities), and text needs none."""
    return html.escape(text, quote=False)


def token_label(token: str) -> str:
    """A token as safe plotly text, its whitespace made visible."""
    return plot_text(visible_token(token))


# A figure draws tokens with their whitespace made visible (`token_label`); its downloads
# (static/js/exports.js) hold the tokens' own text, which the figure carries beside what it
# draws: a trace's `meta` holds the plain text of its `text`, `x`, `y`, `customdata` or
# `name` where they show tokens, the layout's `meta["labels"]` the plain text naming each
# value of an axis ("x", "y2") whose ticks show tokens.


def export_labels(figure: go.Figure, axis: str, labels: dict) -> None:
    """Name each value of `axis` by its plain text (`labels`: value → text) in the figure's
    downloads, in place of the tick labels drawn."""
    meta = dict(figure.layout.meta or {})
    meta["labels"] = {**meta.get("labels", {}), axis: {str(k): v for k, v in labels.items()}}
    figure.update_layout(meta=meta)


def download_meta(figure: go.Figure, **entries) -> None:
    """Add `entries` to the layout's `meta`, which the downloads read."""
    figure.update_layout(meta={**(figure.layout.meta or {}), **entries})


# An axis of whole numbers (token positions, layers) shows at most this many ticks.
MAX_INTEGER_TICKS = 12


def round_steps():
    """1, 2, 5, 10, 20, 50, ... without end."""
    return (unit * 10**power for power in itertools.count() for unit in (1, 2, 5))


def integer_ticks(values: Sequence[int]) -> dict:
    """Axis settings for whole numbers: ticks on whole numbers only, every 1, 2, 5, 10, 20,
    ... so that at most MAX_INTEGER_TICKS show (plotly's own fall on halves for few values),
    and a range of just the values (its own padding can show a tick at, say, layer −2)."""
    low, high = min(values, default=0), max(values, default=0)
    step = next(step for step in round_steps() if high - low + 1 <= step * MAX_INTEGER_TICKS)
    return {"tickmode": "linear", "tick0": 0, "dtick": step, "range": [low - 0.5, high + 0.5]}


def figure_layout(figure: go.Figure, title: str, height: int = 320) -> go.Figure:
    figure.update_layout(
        title={"text": title, "x": 0},
        height=height,
        margin={"l": 60, "r": 20, "t": 40, "b": 40},
        template="plotly_white",
    )
    return figure


def figure_entry(name: str, figure: go.Figure) -> dict:
    """A figure as the pages embed it (`json_script`, drawn by static/js/figures.js)."""
    return {"name": name, "data": json.loads(figure.to_json())}
