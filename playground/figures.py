"""Plotly figure builders: pure functions of a run's request and response (no database).

Every token string shown in a figure goes through `_label`, because plotly renders a subset
of HTML tags inside text: model output must always appear as text.
"""

import html
import math

import numpy as np
import plotly.graph_objects as go

from acs_client.codec import decode

STRIP_WIDTH = 12
PROBABILITY_COLOURS = [[0.0, "#d7301f"], [0.5, "#fdd49e"], [1.0, "#1a9850"]]


def _label(token: str) -> str:
    """A token as safe plotly text: HTML escaped, whitespace made visible. Quotes stay: plotly
    shows `&quot;` literally (it decodes only a few named entities), and text needs none."""
    visible = token.replace("\n", "⏎").replace("\t", "⇥").replace(" ", "·")
    return html.escape(visible or "∅", quote=False)


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
            rows.append((f"{source} {start // STRIP_WIDTH + 1}", part[start : start + STRIP_WIDTH]))
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
    figure.update_xaxes(title="prompt position")
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


def activation_norm_heatmap(tensor: np.ndarray, layers: list[int]) -> go.Figure:
    """‖residual‖ by layer × position."""
    norms = np.linalg.norm(tensor, axis=-1)
    figure = go.Figure(
        go.Heatmap(
            z=norms.tolist(),
            y=layers,
            x=list(range(tensor.shape[1])),
            colorscale="Viridis",
            hovertemplate="layer %{y}, position %{x}: ‖h‖=%{z:.2f}<extra></extra>",
            colorbar={"title": {"text": "‖h‖"}},
        )
    )
    figure.update_xaxes(title="position")
    figure.update_yaxes(title="layer", type="category" if len(layers) < 2 else "-")
    return _layout(figure, "Residual-stream norm by layer × position", height=420)


def activation_norm_by_layer(tensor: np.ndarray, layers: list[int], position: int) -> go.Figure:
    """‖residual‖ at one position for each captured layer."""
    norms = np.linalg.norm(tensor[:, position, :], axis=-1)
    figure = go.Figure(go.Scatter(x=layers, y=norms.tolist(), mode="lines+markers"))
    figure.update_xaxes(title="layer")
    figure.update_yaxes(title="‖h‖")
    return _layout(figure, f"Norm by layer at position {position}")


def cosine_similarity_matrix(rows: np.ndarray) -> np.ndarray:
    """Pairwise cosine similarity of `[n, d]` rows (a zero row has similarity 0)."""
    norms = np.linalg.norm(rows, axis=-1, keepdims=True)
    unit = rows / np.where(norms == 0, 1, norms)
    return unit @ unit.T


def activation_cosine_figure(tensor: np.ndarray, layers: list[int], layer: int) -> go.Figure:
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
    figure.update_yaxes(autorange="reversed", title="position")
    figure.update_xaxes(title="position")
    return _layout(figure, f"Cosine similarity between positions, layer {layer}", height=420)


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


def activation_pca_figure(tensor: np.ndarray, layers: list[int], layer: int) -> go.Figure:
    """Positions at one captured layer projected on their first two principal components."""
    coordinates, share = pca_projection(tensor[layers.index(layer)])
    positions = list(range(coordinates.shape[0]))
    figure = go.Figure(
        go.Scatter(
            x=coordinates[:, 0].tolist(),
            y=coordinates[:, 1].tolist(),
            text=[str(p) for p in positions],
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
    figure.update_xaxes(title="generated position")
    figure.update_yaxes(title="Δ logprob (steered − baseline)")
    return _layout(figure, "Per-token logprob difference")


def mean_logprob(response: dict) -> float | None:
    values = [
        p["logprob"]
        for p in completion_positions(response["choices"][0].get("logprobs"))
        if p["logprob"] is not None
    ]
    return sum(values) / len(values) if values else None


def target_logprob(response: dict, target: str) -> float | None:
    """The target token's logprob at the first generated position (None if outside the
    returned top-k)."""
    positions = completion_positions(response["choices"][0].get("logprobs"))
    if not positions:
        return None
    if positions[0]["token"] == target:
        return positions[0]["logprob"]
    for item in positions[0]["top"]:
        if item["token"] == target:
            return item["logprob"]
    return None


def sweep_points(runs: list[tuple[float, dict]], target: str) -> list[dict]:
    """From `(scale, response)` pairs (one with scale 0, the baseline): per scale the
    target token's logprob and the mean logprob shift against the baseline."""
    baseline = next((response for scale, response in runs if scale == 0), None)
    base_mean = mean_logprob(baseline) if baseline else None
    points = []
    for scale, response in sorted(runs, key=lambda pair: pair[0]):
        mean = mean_logprob(response)
        shift = None if mean is None or base_mean is None else mean - base_mean
        points.append(
            {
                "scale": scale,
                "target_logprob": target_logprob(response, target),
                "mean_shift": shift,
            }
        )
    return points


def scale_sweep_figure(points: list[dict], target: str) -> go.Figure:
    """Target-token logprob and mean logprob shift against steering scale."""
    scales = [p["scale"] for p in points]
    figure = go.Figure()
    figure.add_trace(
        go.Scatter(
            x=scales,
            y=[p["target_logprob"] for p in points],
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
        xaxis={"title": {"text": "scale"}},
        yaxis={"title": {"text": "target logprob"}},
        yaxis2={"title": {"text": "mean shift"}, "overlaying": "y", "side": "right"},
        legend={"orientation": "h", "y": -0.25},
    )
    return _layout(figure, "Scale sweep", height=380)
