"""Plotly figures of the portal pages (usage per day, harvest results), as plain JSON-able
dicts that templates embed with `json_script`."""

import numpy as np
import plotly.graph_objects as go
from safetensors.numpy import load

from api.jobs.storage import STATS_NAME, harvest_file_open

STATUS_COLOURS = {"2xx": "#1e7b34", "4xx": "#c77700", "5xx": "#b3261e"}


def harvest_norm_figure(job) -> dict:
    """Mean L2 norm of the residual stream per captured layer (all positions but the
    first), read from the job's stats.safetensors."""
    with harvest_file_open(job.storage_prefix, STATS_NAME) as handle:
        stats = load(handle.read())
    norms = np.nan_to_num(stats["norm_mean"].astype(np.float64)).tolist()
    figure = go.Figure(
        [go.Scatter(x=list(job.layers), y=norms, mode="lines+markers", name="mean norm")],
        layout={
            "title": {"text": f"Mean activation norm per layer · {job.model}", "x": 0},
            "height": 320,
            "margin": {"l": 60, "r": 20, "t": 40, "b": 40},
            "template": "plotly_white",
            "xaxis": {"title": {"text": "layer"}},
            "yaxis": {"title": {"text": "mean ‖residual‖₂"}},
        },
    )
    return figure.to_plotly_json()


def usage_figures(summary: dict) -> dict:
    """Plotly figures of tokens and requests per UTC day of a usage summary. Built as plain
    figure dicts, not graph objects: plotly's per-point validation would cost more than the
    rest of the page on a year of days."""
    days = [row["day"].isoformat() for row in summary["days"]]
    layout = {
        "barmode": "stack",
        "margin": {"l": 60, "r": 10, "t": 40, "b": 40},
        "height": 320,
        "legend": {"orientation": "h", "y": -0.2},
        # Days as the page's tables print them (YYYY-MM-DD), not plotly's "Nov 8 2026".
        "xaxis": {
            "type": "date",
            "title": {"text": "Day (UTC)"},
            "tickformat": "%Y-%m-%d",
            "hoverformat": "%Y-%m-%d",
        },
    }
    tokens = {
        "data": [
            _bar(days, summary, "prompt_tokens", "Prompt", "#1f5fbf"),
            _bar(days, summary, "completion_tokens", "Completion", "#7fa7e0"),
        ],
        "layout": {**layout, "title": {"text": "Tokens per day"}},
    }
    requests = {
        "data": [
            _bar(days, summary, status, status, colour) for status, colour in STATUS_COLOURS.items()
        ],
        "layout": {**layout, "title": {"text": "Requests per day by status"}},
    }
    return {"tokens": tokens, "requests": requests}


def _bar(days, summary, field, name, colour) -> dict:
    return {
        "type": "bar",
        "x": days,
        "y": [row[field] for row in summary["days"]],
        "name": name,
        "marker": {"color": colour},
    }
