"""The figures of a steering comparison: baseline and steered runs scored on the same tokens
(Δ logprob and KL by position), and a sweep's target logprob by scale."""

import numpy as np
import plotly.graph_objects as go

from playground import scoring
from playground.plots import download_meta, export_labels, figure_layout, plot_text, token_label
from playground.token_positions import completion_positions

# ---------------------------------------------------------------------------------------
# Steering


def same_token_summary(compared: dict) -> dict:
    """The means of one steered run's same-token comparison (an entry of
    `SteeringScore.results["runs"]`, which scores the generated tokens only), in nats per
    token: Δ logprob (steered − baseline; `scoring.MEAN_DELTA_DEFINITION`) on the baseline's
    tokens and on the steered run's tokens, and KL(baseline ‖ steered) on the baseline's
    tokens (None without full distributions)."""

    def mean_delta(part: dict) -> float | None:
        deltas = np.asarray(part["under_steered"]) - np.asarray(part["under_baseline"])
        return scoring.mean_generated_delta(deltas, range(len(deltas)), 0)

    kl = compared["baseline_tokens"]["kl"]
    return {
        "delta_baseline_tokens": mean_delta(compared["baseline_tokens"]),
        "delta_steered_tokens": mean_delta(compared["steered_tokens"]),
        "kl": float(np.mean(kl)) if kl else None,
    }


DELTA_AXIS = "Δ logprob, steered − baseline (nats)"
KL_AXIS = "KL(baseline ‖ steered) (nats)"


def _pair_label(position: int, base: str | None, steered: str | None, shown=token_label) -> str:
    """ "position baseline/steered" (the token once where both are the same), each token
    `shown` (by default as a figure shows it; `str` for the downloads' own text)."""
    if base == steered or steered is None:
        return f"{position} {shown(base)}" if base is not None else f"{position} –/{shown(steered)}"
    if base is None:
        return f"{position} –/{shown(steered)}"
    return f"{position} {shown(base)}/{shown(steered)}"


def same_token_figure(baseline_strings: list[str], compared: dict) -> go.Figure:
    """Per generated position j, the Δ logprob (steered − baseline, nats) of the baseline's
    token j and of the steered run's token j, each scored under both models on the same
    tokens (teacher-forced), and KL(baseline ‖ steered) at the baseline's positions where
    the full distributions were available. Ticks name the baseline's / steered token."""
    base = compared["baseline_tokens"]
    own = compared["steered_tokens"]
    base_delta = np.asarray(base["under_steered"]) - np.asarray(base["under_baseline"])
    own_delta = np.asarray(own["under_steered"]) - np.asarray(own["under_baseline"])
    steered_strings = own["strings"]
    # Per token: the token, log p under the baseline, under the steered model.
    base_scores, own_scores = (
        [
            list(row)
            for row in zip(strings, part["under_baseline"], part["under_steered"], strict=True)
        ]
        for strings, part in ((baseline_strings, base), (steered_strings, own))
    )
    count = max(len(baseline_strings), len(steered_strings))
    figure = go.Figure()
    figure.add_trace(
        go.Bar(
            x=list(range(len(base_delta))),
            y=base_delta.tolist(),
            name="on the baseline's tokens",
            marker_color="#1f5fbf",
            customdata=[[token_label(token), b, s] for token, b, s in base_scores],
            meta={"customdata": base_scores},
            hovertemplate=(
                "baseline's token #%{x} %{customdata[0]}: log p_baseline %{customdata[1]:.3f},"
                " log p_steered %{customdata[2]:.3f}, Δ %{y:.3f} nats<extra></extra>"
            ),
        )
    )
    figure.add_trace(
        go.Bar(
            x=list(range(len(own_delta))),
            y=own_delta.tolist(),
            name="on the steered run's tokens",
            marker_color="#e08214",
            customdata=[[token_label(token), b, s] for token, b, s in own_scores],
            meta={"customdata": own_scores},
            hovertemplate=(
                "steered token #%{x} %{customdata[0]}: log p_baseline %{customdata[1]:.3f},"
                " log p_steered %{customdata[2]:.3f}, Δ %{y:.3f} nats<extra></extra>"
            ),
        )
    )
    if base["kl"] is not None:
        figure.add_trace(
            go.Scatter(
                x=list(range(len(base["kl"]))),
                y=base["kl"],
                name="KL(baseline ‖ steered), right axis",
                mode="lines+markers",
                yaxis="y2",
                line={"color": "#333333"},
                hovertemplate="position %{x}: KL %{y:.3f} nats<extra></extra>",
            )
        )
        top = max(max(base["kl"]), 1e-6)
        figure.update_layout(
            yaxis2={
                "title": {"text": KL_AXIS},
                "overlaying": "y",
                "side": "right",
                # Its own ticks from 0: plotly would otherwise align them with the Δ axis.
                "range": [0, top * 1.1],
                "tickmode": "auto",
                "showgrid": False,
            }
        )
    positions = list(range(count))
    padded_base = [*baseline_strings, *[None] * (count - len(baseline_strings))]
    padded_own = [*steered_strings, *[None] * (count - len(steered_strings))]
    figure.update_xaxes(
        title="generated position (baseline / steered token)",
        tickmode="array",
        tickvals=positions,
        ticktext=[
            _pair_label(j, b, o) for j, b, o in zip(positions, padded_base, padded_own, strict=True)
        ],
        tickangle=-45,
        range=[-0.5, count - 0.5],
    )
    export_labels(
        figure,
        "x",
        {
            j: _pair_label(j, b, o, shown=str)
            for j, b, o in zip(positions, padded_base, padded_own, strict=True)
        },
    )
    download_meta(figure, customdata=["token", "log p_baseline", "log p_steered"])
    # (update_yaxes would retitle the KL axis too.)
    figure.update_layout(
        yaxis={"title": {"text": DELTA_AXIS}, "zeroline": True, "zerolinecolor": "#888888"}
    )
    figure.update_layout(
        barmode="group",
        legend={"orientation": "h", "x": 0, "y": 1.0, "yanchor": "bottom"},
    )
    figure_layout(
        figure, f"Same tokens under both models, scale {plot_text(compared['label'])}", 480
    )
    # The title at the very top, the legend under it: on a narrow screen the legend wraps
    # to three lines, which the top margin leaves room for.
    figure.update_layout(title={"y": 0.99, "yanchor": "top", "yref": "container"})
    return figure.update_layout(
        margin={"r": 70 if base["kl"] is not None else 20, "t": 110, "b": 120}
    )


def _scored_target(response: dict, target: str) -> tuple[float | None, str]:
    """The target's logprob from the scored second prompt (prompt + target, see
    steering.services.with_target_scored): the sum over the prompt logprobs after the first
    prompt's own tokens."""
    choices = response["choices"]
    prompt_tokens = len(choices[0].get("prompt_logprobs") or [])
    scored = (choices[1].get("prompt_logprobs") or [])[prompt_tokens:]
    entries = [min(entry.values(), key=lambda item: item["rank"]) for entry in scored]
    if not entries or "".join(item["decoded_token"] for item in entries) != target:
        return None, "the target does not start a new token after the prompt"
    actual = [max(entry.values(), key=lambda item: item["rank"]) for entry in scored]
    return sum(item["logprob"] for item in actual), ""


def target_logprob(response: dict, target: str) -> tuple[float | None, str]:
    """The target's logprob at the first generated position and, when there is none, why.

    From the scored prompt + target when the run has one (any target, however unlikely);
    otherwise only when the target is among the top-k returned there."""
    choices = response["choices"]
    if len(choices) > 1 and choices[1].get("prompt_logprobs"):
        return _scored_target(response, target)
    positions = completion_positions(choices[0].get("logprobs"))
    if not positions:
        return None, "the run returned no logprobs"
    if positions[0]["token"] == target:
        return positions[0]["logprob"], ""
    for item in positions[0]["top"]:
        if item["token"] == target:
            return item["logprob"], ""
    return None, f"the target is outside the top-{len(positions[0]['top'])} returned"


def sweep_points(
    runs: list[tuple[float, dict]], target: str, compared: dict[float, dict] | None = None
) -> list[dict]:
    """From `(scale, response)` pairs (one with scale 0, the baseline): per scale the
    target token's logprob (None, with `missing` saying why, when unknown), and from the
    same-token comparison of that scale (`compared`: scale → entry of
    `SteeringScore.results["runs"]`) the mean Δ logprob on the baseline's tokens and the
    mean KL(baseline ‖ steered), both 0 at scale 0 (the baseline against itself) and None
    where no comparison is known."""
    compared = compared or {}
    points = []
    for scale, response in sorted(runs, key=lambda pair: pair[0]):
        logprob, missing = target_logprob(response, target) if target else (None, "")
        if scale == 0:
            summary = {"delta_baseline_tokens": 0.0, "kl": 0.0}
        elif scale in compared:
            summary = same_token_summary(compared[scale])
        else:
            summary = {"delta_baseline_tokens": None, "kl": None}
        points.append(
            {
                "scale": scale,
                "target_logprob": logprob,
                "missing": missing,
                "mean_shift": summary["delta_baseline_tokens"],
                "mean_kl": summary["kl"],
            }
        )
    return points


def scale_sweep_figure(points: list[dict], target: str, unit: str = "scale") -> go.Figure:
    """Against the steering scale (in `unit`, as entered): the target token's logprob (left
    axis), and on the right axis the mean Δ logprob of the baseline's tokens (steered −
    baseline) and the mean KL(baseline ‖ steered), both in nats per token on the same
    tokens. Scales where the target's logprob is unknown are named in a note."""
    figure = go.Figure()
    known = [p for p in points if p["target_logprob"] is not None]
    if known:
        figure.add_trace(
            go.Scatter(
                x=[p["scale"] for p in known],
                y=[p["target_logprob"] for p in known],
                mode="lines+markers",
                name=f"logprob of {token_label(target)} (left)",
                meta={"name": f"logprob of {target} (left)"},
            )
        )
    shifts = [p for p in points if p["mean_shift"] is not None]
    # (Scale 0 alone is the baseline against itself: nothing was compared.)
    if len(shifts) > 1:
        figure.add_trace(
            go.Scatter(
                x=[p["scale"] for p in shifts],
                y=[p["mean_shift"] for p in shifts],
                mode="lines+markers",
                name="mean Δ logprob, baseline's tokens (right)",
                yaxis="y2",
            )
        )
    divergences = [p for p in points if p.get("mean_kl") is not None]
    if len(divergences) > 1:
        figure.add_trace(
            go.Scatter(
                x=[p["scale"] for p in divergences],
                y=[p["mean_kl"] for p in divergences],
                mode="lines+markers",
                name="mean KL(baseline ‖ steered) (right)",
                yaxis="y2",
                line={"dash": "dot"},
            )
        )
    figure.update_layout(
        xaxis={"title": {"text": unit}, "tickformat": "~g"},
        yaxis={"title": {"text": "target logprob (nats)"}},
        yaxis2={
            "title": {"text": "nats per token, same tokens"},
            "overlaying": "y",
            "side": "right",
            "zeroline": True,
            # Its own round ticks: plotly would otherwise align them with the left axis's.
            "tickmode": "auto",
            "showgrid": False,
        },
        legend={"orientation": "h", "y": -0.25},
    )
    missing = [p for p in points if p["target_logprob"] is None]
    note = ""
    if not target:
        note = "No target token given: only the same-token comparison is plotted."
    elif missing:
        where = "any scale" if not known else ", ".join(f"{p['scale']:g}" for p in missing)
        note = (
            f"No logprob of {token_label(target)} at {where}: {plot_text(missing[0]['missing'])}."
        )
    if note:
        figure.add_annotation(
            text=note, xref="paper", yref="paper", x=0, y=1.02, showarrow=False,
            xanchor="left", yanchor="bottom", font={"color": "#b30000"},
        )  # fmt: skip
    figure_layout(figure, "Scale sweep", height=420)
    # Room for the right-hand axis and for the note above the plot.
    return figure.update_layout(margin={"r": 60, "t": 70 if note else 40})
