"""Plotly figures of harvest results, as plain JSON-able dicts for `json_script`."""

import numpy as np
import plotly.graph_objects as go
from safetensors.numpy import load

from api.jobs.storage import STATS_NAME, harvest_file_open


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
