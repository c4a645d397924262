"""The run page's token figures: pure functions of a run's request and response (no
database): each position's token, probability and top-k, prompt surprisal and the
distribution at one prompt position."""

import math

import plotly.graph_objects as go

from playground.plots import (
    CELL_TEXT,
    PROBABILITY_COLOURS,
    STRIP_WIDTH,
    download_meta,
    figure_layout,
    integer_ticks,
    token_label,
)


def _hover(position: dict, top_shown: int = 5) -> str:
    logprob = position["logprob"]
    lines = [
        f"<b>{token_label(position['token'])}</b> ({position['source']} #{position['position']})",
        "logprob: n/a" if logprob is None else f"logprob: {logprob:.3f}  p={math.exp(logprob):.3f}",
        f"rank: {position['rank'] if position['rank'] is not None else 'beyond top-k'}",
    ]
    for item in position["top"][:top_shown]:
        lines.append(f"  {token_label(item['token'])}: {item['logprob']:.3f}")
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
    z, text, tokens, custom, names = [], [], [], [], []
    for name, cells in rows:
        padding = STRIP_WIDTH - len(cells)
        names.append(name)
        z.append([c["probability"] for c in cells] + [None] * padding)
        text.append([token_label(c["token"]) for c in cells] + [""] * padding)
        tokens.append([c["token"] for c in cells] + [""] * padding)
        custom.append([[_hover(c), c["position"]] for c in cells] + [["", -1]] * padding)
    figure = go.Figure(
        go.Heatmap(
            z=z,
            text=text,
            meta={"text": tokens},
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
    # The names of a cell's hover values, for its numbers' download (static/js/exports.js).
    download_meta(figure, customdata=["hover", "position"])
    return figure_layout(figure, "Tokens by probability", height=max(160, 48 * len(names) + 80))


def top_k_shown(position: dict) -> tuple[list[dict], bool]:
    """The bars of a top-k chart: the `top_k` most likely alternatives the request asked for,
    then the position's own token when it is not among them (the API always returns it), and
    whether it was added."""
    top = position["top"][: position["top_k"]]
    if any(item["is_actual"] for item in top) or position["logprob"] is None:
        return top, False
    actual = {"token": position["token"], "logprob": position["logprob"], "is_actual": True}
    return [*top, actual], True


def top_k_figure(position: dict) -> go.Figure:
    """Bar chart of the alternatives at one position, the actual token highlighted."""
    top, added = top_k_shown(position)
    figure = go.Figure(
        go.Bar(
            x=[math.exp(item["logprob"]) for item in top],
            y=[token_label(item["token"]) for item in top],
            meta={"y": [item["token"] for item in top]},
            orientation="h",
            marker_color=["#1f5fbf" if item["is_actual"] else "#9db3d6" for item in top],
            hovertemplate="%{y}: p=%{x:.4f}<extra></extra>",
        )
    )
    figure.update_yaxes(autorange="reversed")
    figure.update_xaxes(title="probability")
    k = position["top_k"]
    what = f"Top-{k}" if k else "The token itself"
    if position.get("full_vocabulary"):
        what = f"Top-{k} of the whole vocabulary"
    title = f"{what} at position {position['position']} ({token_label(position['token'])})"
    if added and k:
        rank = position["rank"]
        title += f", and the token itself ({f'rank {rank}' if rank else 'below them'})"
    return figure_layout(figure, title, height=max(200, 24 * len(top) + 80))


def prompt_surprisal_figure(positions: list[dict]) -> go.Figure:
    """−logprob (nats) of each prompt token after the first."""
    scored = [p for p in positions if p["source"] == "prompt" and p["logprob"] is not None]
    figure = go.Figure(
        go.Bar(
            x=[p["position"] for p in scored],
            y=[-p["logprob"] for p in scored],
            text=[token_label(p["token"]) for p in scored],
            meta={"text": [p["token"] for p in scored]},
            hovertemplate="#%{x} %{text}: %{y:.3f} nats<extra></extra>",
            marker_color="#1f5fbf",
        )
    )
    figure.update_xaxes(title="prompt position", **integer_ticks([p["position"] for p in scored]))
    figure.update_yaxes(title="surprisal (−logprob, nats)")
    return figure_layout(figure, "Prompt surprisal")


def prompt_distribution_figure(prompt_logprobs: list, position: int, limit: int = 2000):
    """Next-token distribution at one prompt position from full-vocabulary prompt_logprobs:
    probability by rank (log-log), the first `limit` ranks, the actual token marked."""
    entry = prompt_logprobs[position]
    ordered = sorted(entry.values(), key=lambda item: item["rank"])[:limit]
    figure = go.Figure(
        go.Scatter(
            x=[item["rank"] for item in ordered],
            y=[math.exp(item["logprob"]) for item in ordered],
            text=[token_label(item["decoded_token"]) for item in ordered],
            meta={"text": [item["decoded_token"] for item in ordered]},
            mode="lines",
            hovertemplate="rank %{x}: %{text} p=%{y:.2e}<extra></extra>",
            name="distribution",
        )
    )
    figure.update_xaxes(type="log", title="rank")
    figure.update_yaxes(type="log", title="probability")
    title = f"Distribution at prompt position {position} ({len(entry)} tokens)"
    return figure_layout(figure, title)
