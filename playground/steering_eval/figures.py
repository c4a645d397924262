"""The steering evaluation's figures: per metric, against the scale, the mean change over the
prompts with its bootstrap 95% interval, every prompt's own change, and the noise floor as a
band around 0. One entry per figure in FIGURES: the page draws them in that order."""

import plotly.graph_objects as go

from playground import plots

from .selectors import EvaluationReport

METRIC_LABELS = {
    "logit_diff": "Δ logit difference, target − foil (nats)",
    "target_logprob": "Δ log p(target) (nats)",
}


def change_by_scale_figure(report: EvaluationReport, metric: str) -> go.Figure:
    """`metric`'s change (steered − unsteered) by scale: each prompt's (grey points, hover
    names the prompt), the mean with its interval (error bars), the noise floor (band)."""
    figure = go.Figure()
    labels = report.prompt_labels()
    points = [r for r in report.records if r[f"delta_{metric}"] is not None]
    figure.add_trace(
        go.Scatter(
            x=[r["scale"] for r in points],
            y=[r[f"delta_{metric}"] for r in points],
            mode="markers",
            name="each prompt",
            marker={"color": "rgba(90, 90, 90, 0.45)", "size": 7},
            text=[labels[r["row"]] for r in points],
            hovertemplate="scale %{x:g}<br>%{y:.3f} nats<br>%{text}<extra></extra>",
        )
    )
    means = [s for s in report.summary if s[f"{metric}_mean"] is not None]
    figure.add_trace(
        go.Scatter(
            x=[s["scale"] for s in means],
            y=[s[f"{metric}_mean"] for s in means],
            mode="lines+markers",
            name="mean, bootstrap 95% interval",
            marker={"color": "#b2182b", "size": 9},
            error_y={
                "type": "data",
                "symmetric": False,
                "array": [s[f"{metric}_ci_high"] - s[f"{metric}_mean"] for s in means],
                "arrayminus": [s[f"{metric}_mean"] - s[f"{metric}_ci_low"] for s in means],
            },
        )
    )
    floor = report.noise_floors[metric]
    if floor is not None:
        figure.add_hrect(
            y0=-floor, y1=floor, fillcolor="#4393c3", opacity=0.2, line_width=0,
            annotation_text=f"noise floor ±{floor:.3g}", annotation_position="top left",
        )  # fmt: skip
    figure.update_layout(
        xaxis={
            "title": {"text": "steering scale"},
            "tickformat": "~g",
            "tickvals": report.scales,
        },
        yaxis={"title": {"text": "steered − unsteered (nats)"}, "zeroline": True},
        legend={"orientation": "h", "y": -0.3},
    )
    # The playground's one chart layout (as `compare` uses it).
    return plots.figure_layout(figure, METRIC_LABELS[metric], height=380)


FIGURES = {
    "steering-eval-logit-diff": lambda report: change_by_scale_figure(report, "logit_diff"),
    "steering-eval-target-logprob": lambda report: change_by_scale_figure(report, "target_logprob"),
}


def evaluation_figures(report: EvaluationReport) -> list[dict]:
    """The page's figures as it embeds them, once any steered pair has been scored."""
    if not any(r["delta_logit_diff"] is not None for r in report.records):
        return []
    return [plots.figure_entry(name, build(report)) for name, build in FIGURES.items()]
