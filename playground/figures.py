"""Plotly figure builders: pure functions of a run's request and response (no database).

Every token string shown in a figure goes through `_label` (or `_text` when its whitespace is
already made visible), because plotly renders a subset of HTML tags inside text: model output
must always appear as text.
"""

import html
import itertools
import math
from collections.abc import Sequence

import numpy as np
import plotly.graph_objects as go

from acs_client.codec import decode

STRIP_WIDTH = 12
# Light colours, so the dark token text on every cell stays readable.
PROBABILITY_COLOURS = [[0.0, "#f4a582"], [0.5, "#fee08b"], [1.0, "#a6d96a"]]
CELL_TEXT = {"size": 12, "color": "#111111"}


def visible_token(token: str) -> str:
    """A token with its whitespace made visible (plain text, not yet escaped)."""
    return token.replace("\n", "⏎").replace("\t", "⇥").replace(" ", "·") or "∅"


def _text(text: str) -> str:
    """Plain text as safe plotly text: HTML escaped. Quotes stay: plotly shows `&quot;`
    literally (it decodes only a few named entities), and text needs none."""
    return html.escape(text, quote=False)


def _label(token: str) -> str:
    """A token as safe plotly text, its whitespace made visible."""
    return _text(visible_token(token))


# An axis of whole numbers (token positions, layers) shows at most this many ticks.
MAX_INTEGER_TICKS = 12


def _integer_ticks(values: Sequence[int]) -> dict:
    """Axis settings for whole numbers: ticks on whole numbers only, every 1, 2, 5, 10, 20,
    ... so that at most MAX_INTEGER_TICKS show (plotly's own fall on halves for few values),
    and a range of just the values (its own padding can show a tick at, say, layer −2)."""
    low, high = min(values, default=0), max(values, default=0)
    steps = (unit * 10**power for power in itertools.count() for unit in (1, 2, 5))
    step = next(step for step in steps if high - low + 1 <= step * MAX_INTEGER_TICKS)
    return {"tickmode": "linear", "tick0": 0, "dtick": step, "range": [low - 0.5, high + 0.5]}


def _layout(figure: go.Figure, title: str, height: int = 320) -> go.Figure:
    figure.update_layout(
        title={"text": title, "x": 0},
        height=height,
        margin={"l": 60, "r": 20, "t": 40, "b": 40},
        template="plotly_white",
    )
    return figure


# ---------------------------------------------------------------------------------------
# Token positions from logprobs and prompt_logprobs


def _actual_prompt_entry(entry: dict, remaining: str, k: int) -> tuple[str, dict]:
    """Which `{token id: {logprob, rank, decoded_token}}` item is the prompt's own token.

    The contract lists the top-`k` plus the actual token, so with `k + 1` items the actual
    one is the item ranked last; otherwise (or with the full vocabulary) it is the longest
    decoded token that ends the prompt text not yet accounted for.
    """
    items = list(entry.items())
    if k >= 0 and len(items) == k + 1:
        return max(items, key=lambda pair: pair[1]["rank"])
    suffixes = [
        pair
        for pair in items
        if pair[1]["decoded_token"] and remaining.endswith(pair[1]["decoded_token"])
    ]
    if suffixes:
        return max(suffixes, key=lambda pair: (len(pair[1]["decoded_token"]), -pair[1]["rank"]))
    return min(items, key=lambda pair: pair[1]["rank"])


def _top_list(pairs, actual: str, top_k: int) -> list[dict]:
    ordered = sorted(pairs, key=lambda pair: -pair[1])[:top_k]
    return [
        {"token": token, "logprob": logprob, "is_actual": token == actual}
        for token, logprob in ordered
    ]


def prompt_positions(
    prompt: str, prompt_logprobs: list | None, k: int, top_k: int = 20
) -> list[dict]:
    """Per prompt token: {source, token, logprob, rank, top}, from prompt_logprobs requested
    with `k` alternatives (−1: full vocabulary). The first token has no logprob; its text is
    what the others leave of the prompt."""
    if not prompt_logprobs:
        return []
    remaining = prompt
    reversed_positions = []
    for entry in reversed(prompt_logprobs[1:]):
        token_id, actual = _actual_prompt_entry(entry, remaining, k)
        token = actual["decoded_token"]
        if remaining.endswith(token):
            remaining = remaining[: len(remaining) - len(token)]
        top = _top_list(
            [(item["decoded_token"], item["logprob"]) for item in entry.values()], token, top_k
        )
        reversed_positions.append(
            {
                "source": "prompt",
                "token": token,
                "token_id": token_id,
                "logprob": actual["logprob"],
                "rank": actual["rank"],
                "top": top,
            }
        )
    first = {"source": "prompt", "token": remaining, "logprob": None, "rank": None, "top": []}
    return [first, *reversed(reversed_positions)]


def completion_positions(logprobs: dict | None, *, skip: int = 0) -> list[dict]:
    """Per generated token from the legacy `logprobs` object (positions after `skip`)."""
    if not logprobs:
        return []
    positions = []
    tops = logprobs.get("top_logprobs") or []
    for index, token in enumerate(logprobs["tokens"]):
        if index < skip:
            continue
        logprob = logprobs["token_logprobs"][index]
        alternatives = tops[index] if index < len(tops) and tops[index] else {}
        top = _top_list(alternatives.items(), token, len(alternatives))
        higher = [item for item in top if logprob is not None and item["logprob"] > logprob]
        in_top = any(item["is_actual"] for item in top)
        positions.append(
            {
                "source": "completion",
                "token": token,
                "logprob": logprob,
                "rank": len(higher) + 1 if in_top else None,
                "top": top,
            }
        )
    return positions


def _prompt_text(request: dict, prompt_index: int) -> str:
    prompt = request.get("prompt", "")
    if isinstance(prompt, list):
        prompt = prompt[prompt_index] if prompt and isinstance(prompt[0], str) else ""
    return prompt if isinstance(prompt, str) else ""


def token_positions(request: dict, response: dict, choice_index: int = 0) -> list[dict]:
    """Prompt then completion tokens of one choice, each with `position` and `probability`.

    With `echo` the legacy logprobs start with the prompt tokens; those are taken as the
    prompt part unless prompt_logprobs is present.
    """
    choice = response["choices"][choice_index]
    n = request.get("n") or 1
    prompt = _prompt_text(request, choice_index // n)
    prompt_part = prompt_positions(
        prompt, choice.get("prompt_logprobs"), request.get("prompt_logprobs") or 0
    )
    logprobs = choice.get("logprobs")
    echoed = 0
    if request.get("echo") and logprobs:
        offsets = logprobs.get("text_offset") or []
        echoed = sum(1 for offset in offsets if offset < len(prompt))
        if not prompt_part:
            prompt_part = [
                {**position, "source": "prompt"}
                for position in completion_positions(logprobs)[:echoed]
            ]
    positions = prompt_part + completion_positions(logprobs, skip=echoed)
    for index, position in enumerate(positions):
        position["position"] = index
        logprob = position["logprob"]
        position["probability"] = None if logprob is None else math.exp(logprob)
    return positions


def _hover(position: dict, top_shown: int = 5) -> str:
    logprob = position["logprob"]
    lines = [
        f"<b>{_label(position['token'])}</b> ({position['source']} #{position['position']})",
        "logprob: n/a" if logprob is None else f"logprob: {logprob:.3f}  p={math.exp(logprob):.3f}",
        f"rank: {position['rank'] if position['rank'] is not None else 'beyond top-k'}",
    ]
    for item in position["top"][:top_shown]:
        lines.append(f"  {_label(item['token'])}: {item['logprob']:.3f}")
    return "<br>".join(lines)


def token_strip_figure(positions: list[dict]) -> go.Figure:
    """Prompt and completion tokens as a strip of cells coloured by probability, wrapped
    every `STRIP_WIDTH` tokens, the completion starting on a new row. Hover shows logprob,
    rank and the top alternatives; clicking a cell selects its position (customdata[1])."""
    rows = []
    for source in ("prompt", "completion"):
        part = [p for p in positions if p["source"] == source]
        for start in range(0, len(part), STRIP_WIDTH):
            cells = part[start : start + STRIP_WIDTH]
            first, last = cells[0]["position"], cells[-1]["position"]
            rows.append(
                (f"{source} #{first}–{last}" if last > first else f"{source} #{first}", cells)
            )
    z, text, custom, names = [], [], [], []
    for name, cells in rows:
        padding = STRIP_WIDTH - len(cells)
        names.append(name)
        z.append([c["probability"] for c in cells] + [None] * padding)
        text.append([_label(c["token"]) for c in cells] + [""] * padding)
        custom.append([[_hover(c), c["position"]] for c in cells] + [["", -1]] * padding)
    figure = go.Figure(
        go.Heatmap(
            z=z,
            text=text,
            customdata=custom,
            texttemplate="%{text}",
            textfont=CELL_TEXT,
            hovertemplate="%{customdata[0]}<extra></extra>",
            colorscale=PROBABILITY_COLOURS,
            zmin=0,
            zmax=1,
            xgap=2,
            ygap=2,
            colorbar={"title": {"text": "p"}},
        )
    )
    figure.update_yaxes(
        autorange="reversed", tickvals=list(range(len(names))), ticktext=names, showgrid=False
    )
    figure.update_xaxes(visible=False)
    return _layout(figure, "Tokens by probability", height=max(160, 48 * len(names) + 80))


def top_k_figure(position: dict) -> go.Figure:
    """Bar chart of the alternatives at one position, the actual token highlighted."""
    top = position["top"]
    figure = go.Figure(
        go.Bar(
            x=[math.exp(item["logprob"]) for item in top],
            y=[_label(item["token"]) for item in top],
            orientation="h",
            marker_color=["#1f5fbf" if item["is_actual"] else "#9db3d6" for item in top],
            hovertemplate="%{y}: p=%{x:.4f}<extra></extra>",
        )
    )
    figure.update_yaxes(autorange="reversed")
    figure.update_xaxes(title="probability")
    title = f"Top-{len(top)} at position {position['position']} ({_label(position['token'])})"
    return _layout(figure, title, height=max(200, 24 * len(top) + 80))


def prompt_surprisal_figure(positions: list[dict]) -> go.Figure:
    """−logprob (nats) of each prompt token after the first."""
    scored = [p for p in positions if p["source"] == "prompt" and p["logprob"] is not None]
    figure = go.Figure(
        go.Bar(
            x=[p["position"] for p in scored],
            y=[-p["logprob"] for p in scored],
            text=[_label(p["token"]) for p in scored],
            hovertemplate="#%{x} %{text}: %{y:.3f} nats<extra></extra>",
            marker_color="#1f5fbf",
        )
    )
    figure.update_xaxes(title="prompt position", **_integer_ticks([p["position"] for p in scored]))
    figure.update_yaxes(title="surprisal (−logprob, nats)")
    return _layout(figure, "Prompt surprisal")


def prompt_distribution_figure(prompt_logprobs: list, position: int, limit: int = 2000):
    """Next-token distribution at one prompt position from full-vocabulary prompt_logprobs:
    probability by rank (log-log), the first `limit` ranks, the actual token marked."""
    entry = prompt_logprobs[position]
    ordered = sorted(entry.values(), key=lambda item: item["rank"])[:limit]
    figure = go.Figure(
        go.Scatter(
            x=[item["rank"] for item in ordered],
            y=[math.exp(item["logprob"]) for item in ordered],
            text=[_label(item["decoded_token"]) for item in ordered],
            mode="lines",
            hovertemplate="rank %{x}: %{text} p=%{y:.2e}<extra></extra>",
            name="distribution",
        )
    )
    figure.update_xaxes(type="log", title="rank")
    figure.update_yaxes(type="log", title="probability")
    title = f"Distribution at prompt position {position} ({len(entry)} tokens)"
    return _layout(figure, title)


# ---------------------------------------------------------------------------------------
# Activations


def activations(request: dict, response: dict) -> tuple[np.ndarray, list[int]]:
    """The captured residual stream `[layers, tokens, hidden]` (float32) and the layer
    index of each row."""
    tensor = decode(response["activations"]["residual_stream"])
    wanted = request.get("output_residual_stream")
    layers = list(wanted) if isinstance(wanted, list) else list(range(tensor.shape[0]))
    return tensor, layers


def position_labels(request: dict, response: dict, count: int) -> list[str]:
    """Labels of `count` captured positions as plain text: "index token" where the run
    returned the token (prompt logprobs or echo), the index alone otherwise."""
    positions = token_positions(request, response) if response.get("choices") else []
    return [
        f"{index} {visible_token(positions[index]['token'])}"
        if index < len(positions)
        else str(index)
        for index in range(count)
    ]


# How the norm heatmap's colours follow ‖h‖: the first position's norm is often many times
# the others', which leaves everything else one colour on a linear scale.
NORM_COLOUR_SCALES = {
    "linear": "linear",
    "log": "log₁₀",
    "clip": "clipped at the 95th percentile",
}


def _position_axis(figure: go.Figure, labels: list[str], axis: str = "x", **extra) -> None:
    update = figure.update_xaxes if axis == "x" else figure.update_yaxes
    update(
        tickmode="array",
        tickvals=list(range(len(labels))),
        ticktext=[_text(label) for label in labels],
        title="position",
        **extra,
    )


def activation_norm_heatmap(
    tensor: np.ndarray, layers: list[int], labels: list[str], colour: str = "linear"
) -> go.Figure:
    """‖residual‖ by layer × position, coloured linearly, by log₁₀ or clipped (see
    NORM_COLOUR_SCALES); hover always shows the norm itself."""
    norms = np.linalg.norm(tensor, axis=-1)
    shown = norms
    zmax = None
    if colour == "log":
        shown = np.log10(np.maximum(norms, 1e-6))
    elif colour == "clip":
        zmax = float(np.percentile(norms, 95))
    figure = go.Figure(
        go.Heatmap(
            z=shown.tolist(),
            customdata=norms.tolist(),
            y=[str(layer) for layer in layers],
            x=list(range(tensor.shape[1])),
            zmax=zmax,
            colorscale="Viridis",
            hovertemplate="layer %{y}, position %{x}: ‖h‖=%{customdata:.2f}<extra></extra>",
            colorbar={"title": {"text": "log₁₀ ‖h‖" if colour == "log" else "‖h‖"}},
        )
    )
    _position_axis(figure, labels, tickangle=-45)
    figure.update_yaxes(title="layer", type="category")
    title = f"Residual-stream norm by layer × position ({NORM_COLOUR_SCALES[colour]})"
    return _layout(figure, title, height=460)


def activation_norm_by_layer(
    tensor: np.ndarray, layers: list[int], position: int, labels: list[str]
) -> go.Figure:
    """‖residual‖ at one position for each captured layer."""
    norms = np.linalg.norm(tensor[:, position, :], axis=-1)
    figure = go.Figure(go.Scatter(x=layers, y=norms.tolist(), mode="lines+markers"))
    figure.update_xaxes(title="layer", **_integer_ticks(layers))
    figure.update_yaxes(title="‖h‖")
    return _layout(figure, f"Norm by layer at position {_text(labels[position])}")


def cosine_similarity_matrix(rows: np.ndarray) -> np.ndarray:
    """Pairwise cosine similarity of `[n, d]` rows (a zero row has similarity 0)."""
    norms = np.linalg.norm(rows, axis=-1, keepdims=True)
    unit = rows / np.where(norms == 0, 1, norms)
    return unit @ unit.T


def activation_cosine_figure(
    tensor: np.ndarray, layers: list[int], layer: int, labels: list[str]
) -> go.Figure:
    """Cosine similarity between positions at one captured layer."""
    similarity = cosine_similarity_matrix(tensor[layers.index(layer)])
    figure = go.Figure(
        go.Heatmap(
            z=similarity.tolist(),
            zmin=-1,
            zmax=1,
            colorscale="RdBu",
            hovertemplate="positions %{y} · %{x}: %{z:.3f}<extra></extra>",
        )
    )
    _position_axis(figure, labels, "y", autorange="reversed")
    _position_axis(figure, labels, tickangle=-45)
    return _layout(figure, f"Cosine similarity between positions, layer {layer}", height=460)


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
    tensor: np.ndarray, layers: list[int], layer: int, labels: list[str]
) -> go.Figure:
    """Positions at one captured layer projected on their first two principal components,
    each marked with its label."""
    coordinates, share = pca_projection(tensor[layers.index(layer)])
    positions = list(range(coordinates.shape[0]))
    figure = go.Figure(
        go.Scatter(
            x=coordinates[:, 0].tolist(),
            y=coordinates[:, 1].tolist(),
            text=[_text(label) for label in labels],
            mode="markers+text",
            textposition="top center",
            marker={"color": positions, "colorscale": "Viridis", "size": 9},
            hovertemplate="position %{text}<extra></extra>",
        )
    )
    figure.update_xaxes(title=f"PC1 ({share[0]:.0%})")
    figure.update_yaxes(title=f"PC2 ({share[1]:.0%})")
    return _layout(figure, f"PCA of positions, layer {layer}", height=420)


# ---------------------------------------------------------------------------------------
# Steering


def steering_difference_figure(baseline: dict, steered: dict) -> go.Figure:
    """Per generated position: steered minus baseline logprob of the sampled token."""
    base = completion_positions(baseline["choices"][0].get("logprobs"))
    other = completion_positions(steered["choices"][0].get("logprobs"))
    pairs = list(zip(base, other, strict=False))
    figure = go.Figure(
        go.Bar(
            x=list(range(len(pairs))),
            y=[s["logprob"] - b["logprob"] for b, s in pairs],
            customdata=[[_label(b["token"]), _label(s["token"])] for b, s in pairs],
            hovertemplate=(
                "#%{x}: baseline %{customdata[0]}, steered %{customdata[1]}"
                "<br>Δ logprob %{y:.3f}<extra></extra>"
            ),
            marker_color=[
                "#1a9850" if s["logprob"] >= b["logprob"] else "#d7301f" for b, s in pairs
            ],
        )
    )
    figure.update_xaxes(title="generated position", **_integer_ticks(range(len(pairs))))
    figure.update_yaxes(title="Δ logprob (steered − baseline)")
    return _layout(figure, "Per-token logprob difference")


def mean_logprob(response: dict) -> float | None:
    values = [
        p["logprob"]
        for p in completion_positions(response["choices"][0].get("logprobs"))
        if p["logprob"] is not None
    ]
    return sum(values) / len(values) if values else None


def _scored_target(response: dict, target: str) -> tuple[float | None, str]:
    """The target's logprob from the scored second prompt (prompt + target, see
    services.with_target_scored): the sum over the prompt logprobs after the first
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


def sweep_points(runs: list[tuple[float, dict]], target: str) -> list[dict]:
    """From `(scale, response)` pairs (one with scale 0, the baseline): per scale the
    target token's logprob (None, with `missing` saying why, when unknown) and the mean
    logprob shift against the baseline."""
    baseline = next((response for scale, response in runs if scale == 0), None)
    base_mean = mean_logprob(baseline) if baseline else None
    points = []
    for scale, response in sorted(runs, key=lambda pair: pair[0]):
        mean = mean_logprob(response)
        shift = None if mean is None or base_mean is None else mean - base_mean
        logprob, missing = target_logprob(response, target) if target else (None, "")
        points.append(
            {"scale": scale, "target_logprob": logprob, "missing": missing, "mean_shift": shift}
        )
    return points


def scale_sweep_figure(points: list[dict], target: str, unit: str = "scale") -> go.Figure:
    """Target-token logprob and mean logprob shift against the steering scale (in `unit`,
    as entered). Scales where the target's logprob is unknown are named in a note."""
    scales = [p["scale"] for p in points]
    figure = go.Figure()
    known = [p for p in points if p["target_logprob"] is not None]
    if known:
        figure.add_trace(
            go.Scatter(
                x=[p["scale"] for p in known],
                y=[p["target_logprob"] for p in known],
                mode="lines+markers",
                name=f"logprob of {_label(target)}",
            )
        )
    figure.add_trace(
        go.Scatter(
            x=scales,
            y=[p["mean_shift"] for p in points],
            mode="lines+markers",
            name="mean logprob shift",
            yaxis="y2",
        )
    )
    figure.update_layout(
        xaxis={"title": {"text": unit}, "tickformat": "~g"},
        yaxis={"title": {"text": "target logprob"}},
        yaxis2={"title": {"text": "mean shift"}, "overlaying": "y", "side": "right"},
        legend={"orientation": "h", "y": -0.25},
    )
    missing = [p for p in points if p["target_logprob"] is None]
    note = ""
    if not target:
        note = "No target token given: only the mean shift is plotted."
    elif missing:
        where = "any scale" if not known else ", ".join(f"{p['scale']:g}" for p in missing)
        note = f"No logprob of {_label(target)} at {where}: {_text(missing[0]['missing'])}."
    if note:
        figure.add_annotation(
            text=note, xref="paper", yref="paper", x=0, y=1.02, showarrow=False,
            xanchor="left", yanchor="bottom", font={"color": "#b30000"},
        )  # fmt: skip
    _layout(figure, "Scale sweep", height=420)
    # Room for the right-hand axis and for the note above the plot.
    return figure.update_layout(margin={"r": 60, "t": 70 if note else 40})
