"""Plotly figure builders: pure functions of a run's request and response (no database).

Every token string shown in a figure goes through `_label` (or `_text` when its whitespace is
already made visible), because plotly renders a subset of HTML tags inside text: model output
must always appear as text.
"""

import html
import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import plotly.graph_objects as go

from acs_client.codec import decode
from playground import scoring

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


# A figure draws tokens with their whitespace made visible (`_label`); its downloads
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


def _round_steps():
    """1, 2, 5, 10, 20, 50, ... without end."""
    return (unit * 10**power for power in itertools.count() for unit in (1, 2, 5))


def _integer_ticks(values: Sequence[int]) -> dict:
    """Axis settings for whole numbers: ticks on whole numbers only, every 1, 2, 5, 10, 20,
    ... so that at most MAX_INTEGER_TICKS show (plotly's own fall on halves for few values),
    and a range of just the values (its own padding can show a tick at, say, layer −2)."""
    low, high = min(values, default=0), max(values, default=0)
    step = next(step for step in _round_steps() if high - low + 1 <= step * MAX_INTEGER_TICKS)
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


# The alternatives shown per prompt position when the whole vocabulary came back.
FULL_VOCAB_TOP_SHOWN = 20


def _top_list(pairs, actual: str, limit: int | None = None) -> list[dict]:
    """The alternatives `(token, logprob)` from the most likely down (the first `limit`),
    equally likely ones by token text: bfloat16 logprobs tie often, and the stored answer
    (jsonb) does not keep the order the API sent them in. Give `pairs` in rank order where
    the API states ranks: ties then keep it."""
    ordered = sorted(pairs, key=lambda pair: -pair[1])[:limit]
    return [
        {"token": token, "logprob": logprob, "is_actual": token == actual}
        for token, logprob in ordered
    ]


def prompt_positions(
    prompt: str, prompt_logprobs: list | None, k: int, prompt_tokens: dict | None = None
) -> list[dict]:
    """Per prompt token: {source, token, token_id, logprob, rank, top, top_k}, from
    prompt_logprobs requested with `k` alternatives (−1: the full vocabulary, of which the
    first FULL_VOCAB_TOP_SHOWN are kept). The actual token of each entry is the run's own
    prompt token where its ids are known (`prompt_tokens`, see run_tokens), else found from
    the prompt text. The first token has no logprob."""
    if not prompt_logprobs:
        return []
    ids = (prompt_tokens or {}).get("ids")
    strings = (prompt_tokens or {}).get("strings")
    if ids is not None and len(ids) != len(prompt_logprobs):
        ids = strings = None
    top_k = FULL_VOCAB_TOP_SHOWN if k < 0 else k
    remaining = prompt
    reversed_positions = []
    for offset, entry in enumerate(reversed(prompt_logprobs[1:])):
        index = len(prompt_logprobs) - 1 - offset
        if ids is not None and str(ids[index]) in entry:
            token_id, actual = str(ids[index]), entry[str(ids[index])]
        else:
            token_id, actual = _actual_prompt_entry(entry, remaining, k)
        token = actual["decoded_token"]
        if remaining.endswith(token):
            remaining = remaining[: len(remaining) - len(token)]
        # Among equal ranks the position's own token comes last: when the API added it to
        # the k asked for, it is that extra one.
        by_rank = sorted(
            entry.items(),
            key=lambda pair: (pair[1]["rank"], pair[0] == token_id, pair[1]["decoded_token"]),
        )
        pairs = [(item["decoded_token"], item["logprob"]) for _, item in by_rank]
        reversed_positions.append(
            {
                "source": "prompt",
                "token": token,
                "token_id": int(token_id),
                "logprob": actual["logprob"],
                "rank": actual["rank"],
                "top": _top_list(pairs, token, FULL_VOCAB_TOP_SHOWN if k < 0 else None),
                "top_k": top_k,
                "full_vocabulary": k < 0,
            }
        )
    first = {
        "source": "prompt",
        "token": strings[0] if strings else remaining,
        "token_id": ids[0] if ids else None,
        "logprob": None,
        "rank": None,
        "top": [],
        "top_k": top_k,
    }
    return [first, *reversed(reversed_positions)]


def completion_positions(logprobs: dict | None, *, skip: int = 0, k: int = 0) -> list[dict]:
    """Per generated token from the legacy `logprobs` object (positions after `skip`),
    requested with `k` alternatives (the API adds the sampled token when it is not among
    them)."""
    if not logprobs:
        return []
    positions = []
    tops = logprobs.get("top_logprobs") or []
    for index, token in enumerate(logprobs["tokens"]):
        if index < skip:
            continue
        logprob = logprobs["token_logprobs"][index]
        alternatives = tops[index] if index < len(tops) and tops[index] else {}
        top = _top_list(sorted(alternatives.items()), token)
        higher = [item for item in top if logprob is not None and item["logprob"] > logprob]
        # Its rank is known only within the k asked for; beyond them, tokens that were not
        # returned may come between.
        known = logprob is not None and len(higher) < k
        positions.append(
            {
                "source": "completion",
                "token": token,
                "logprob": logprob,
                "rank": len(higher) + 1 if known else None,
                "top": top,
                "top_k": k,
            }
        )
    return positions


def _prompt_text(request: dict, prompt_index: int) -> str:
    prompt = request.get("prompt", "")
    if isinstance(prompt, list):
        prompt = prompt[prompt_index] if prompt and isinstance(prompt[0], str) else ""
    return prompt if isinstance(prompt, str) else ""


def token_positions(
    request: dict, response: dict, choice_index: int = 0, tokens: dict | None = None
) -> list[dict]:
    """Prompt then completion tokens of one choice, each with `position`, `probability` and
    `label` (the token as every figure and list shows it).

    With `echo` the legacy logprobs start with the prompt tokens; those are taken as the
    prompt part unless prompt_logprobs is present. `tokens` are the run's stored tokens
    (`Run.tokens`), which name each prompt_logprobs entry's actual token exactly.
    """
    choice = response["choices"][choice_index]
    n = request.get("n") or 1
    prompt = _prompt_text(request, choice_index // n)
    prompt_tokens = None
    if tokens and len(tokens.get("prompts") or []) > choice_index // n:
        prompt_tokens = tokens["prompts"][choice_index // n]
    prompt_part = prompt_positions(
        prompt,
        choice.get("prompt_logprobs"),
        request.get("prompt_logprobs") or 0,
        prompt_tokens,
    )
    logprobs = choice.get("logprobs")
    k = request.get("logprobs") or 0
    echoed = 0
    if request.get("echo") and logprobs:
        offsets = logprobs.get("text_offset") or []
        echoed = sum(1 for offset in offsets if offset < len(prompt))
        if not prompt_part:
            prompt_part = [
                {**position, "source": "prompt"}
                for position in completion_positions(logprobs, k=k)[:echoed]
            ]
    if not prompt_part and prompt_tokens and prompt_tokens.get("strings"):
        # No logprobs for the prompt, but its tokens are known: show them (unscored), so
        # that positions count from the prompt's first token everywhere on the page.
        prompt_part = [
            {"source": "prompt", "token": token, "token_id": token_id, "logprob": None,
             "rank": None, "top": [], "top_k": 0}
            for token, token_id in zip(prompt_tokens["strings"], prompt_tokens["ids"], strict=True)
        ]  # fmt: skip
    positions = prompt_part + completion_positions(logprobs, skip=echoed, k=k)
    for index, position in enumerate(positions):
        position["position"] = index
        position["label"] = visible_token(position["token"])
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
    z, text, tokens, custom, names = [], [], [], [], []
    for name, cells in rows:
        padding = STRIP_WIDTH - len(cells)
        names.append(name)
        z.append([c["probability"] for c in cells] + [None] * padding)
        text.append([_label(c["token"]) for c in cells] + [""] * padding)
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
    return _layout(figure, "Tokens by probability", height=max(160, 48 * len(names) + 80))


def figure_entry(name: str, figure: go.Figure) -> dict:
    """A figure as the pages embed it (`json_script`, drawn by static/js/figures.js)."""
    return {"name": name, "data": json.loads(figure.to_json())}


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
            y=[_label(item["token"]) for item in top],
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
    title = f"{what} at position {position['position']} ({_label(position['token'])})"
    if added and k:
        rank = position["rank"]
        title += f", and the token itself ({f'rank {rank}' if rank else 'below them'})"
    return _layout(figure, title, height=max(200, 24 * len(top) + 80))


def prompt_surprisal_figure(positions: list[dict]) -> go.Figure:
    """−logprob (nats) of each prompt token after the first."""
    scored = [p for p in positions if p["source"] == "prompt" and p["logprob"] is not None]
    figure = go.Figure(
        go.Bar(
            x=[p["position"] for p in scored],
            y=[-p["logprob"] for p in scored],
            text=[_label(p["token"]) for p in scored],
            meta={"text": [p["token"] for p in scored]},
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
            meta={"text": [item["decoded_token"] for item in ordered]},
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


@dataclass
class CapturedRow:
    """One row of a capture: rows 0..P-1 are the prompt's tokens, P.. the generated tokens
    fed back (the last generated token is never fed back, so it has no row). `token` is None
    where the run does not say which token it was."""

    row: int
    part: str  # "prompt" or "generated"
    token: str | None
    token_id: int | None

    @property
    def label(self) -> str:
        """ "index token" as plain text (whitespace made visible), the index alone when the
        token is unknown."""
        return str(self.row) if self.token is None else f"{self.row} {visible_token(self.token)}"

    @property
    def text_label(self) -> str:
        """ "index token" with the token's own text, as the downloads hold it."""
        return str(self.row) if self.token is None else f"{self.row} {self.token}"


@dataclass
class Capture:
    """A run's captured residual stream `[layers, tokens, hidden]` (float32, the output of
    decoder block k before the final norm), the layer index of each of its rows, and what
    each position is."""

    tensor: np.ndarray
    layers: list[int]
    rows: list[CapturedRow]

    @property
    def labels(self) -> list[str]:
        return [row.label for row in self.rows]

    @property
    def prompt_length(self) -> int:
        return sum(1 for row in self.rows if row.part == "prompt")


def _known_prompt_tokens(request: dict, response: dict) -> list[str] | None:
    """The prompt's token strings from the response itself (prompt_logprobs or echo)."""
    positions = token_positions(request, response)
    prompt = [p["token"] for p in positions if p["source"] == "prompt"]
    return prompt or None


def capture_rows(request: dict, response: dict, tokens: dict | None, count: int):
    """What each of the `count` captured positions is, from the run's stored tokens
    (`Run.tokens`: the prompt as the gateway's tokenizer counts it, and the generated
    tokens), else from what the response itself shows (usage's prompt count, prompt_logprobs
    or echo, logprobs)."""
    if tokens and tokens.get("prompts"):
        prompt_ids = tokens["prompts"][0]["ids"]
        prompt_strings = tokens["prompts"][0]["strings"] or _known_prompt_tokens(request, response)
        completion = (tokens.get("completions") or [None])[0] or {}
        generated_ids = completion.get("ids") or []
        generated_strings = completion.get("strings") or []
    else:
        prompt_strings = _known_prompt_tokens(request, response)
        prompt_count = (response.get("usage") or {}).get("prompt_tokens")
        prompt_ids = [None] * (
            prompt_count if prompt_count is not None else len(prompt_strings or [])
        )
        generated = [p for p in token_positions(request, response) if p["source"] == "completion"]
        generated_strings = [p["token"] for p in generated]
        generated_ids = []
    if prompt_strings is not None and len(prompt_strings) != len(prompt_ids):
        prompt_strings = None  # not the same tokenization: better no label than a wrong one
    rows = []
    for row in range(count):
        if row < len(prompt_ids):
            token = prompt_strings[row] if prompt_strings else None
            rows.append(CapturedRow(row, "prompt", token, prompt_ids[row]))
        else:
            index = row - len(prompt_ids)
            token = generated_strings[index] if index < len(generated_strings) else None
            token_id = generated_ids[index] if index < len(generated_ids) else None
            rows.append(CapturedRow(row, "generated", token, token_id))
    return rows


def activations(request: dict, response: dict, tokens: dict | None = None) -> Capture:
    """The run's capture, its positions named by `capture_rows`."""
    tensor = decode(response["activations"]["residual_stream"])
    wanted = request.get("output_residual_stream")
    layers = list(wanted) if isinstance(wanted, list) else list(range(tensor.shape[0]))
    return Capture(tensor, layers, capture_rows(request, response, tokens, tensor.shape[1]))


@dataclass(frozen=True)
class PositionWindow:
    """The positions an activation view shows: `start` to `end` (inclusive; None: the
    last), without position 0 when `exclude_first`. The default leaves out only the first
    token: its residual stream (an attention sink) is often a hundred times the norm of the
    others and would dominate every colour scale, cosine and principal component."""

    start: int = 0
    end: int | None = None
    exclude_first: bool = True

    def rows(self, count: int) -> list[int]:
        """The positions shown out of `count`; never empty (at least one position)."""
        end = count - 1 if self.end is None else min(self.end, count - 1)
        start = min(max(self.start, 1 if self.exclude_first else 0), end)
        return list(range(max(start, 0), end + 1))

    def describe(self, count: int) -> str:
        rows = self.rows(count)
        text = f"positions {rows[0]}–{rows[-1]}" if len(rows) > 1 else f"position {rows[0]}"
        return text + (" (first token excluded)" if self.exclude_first and rows[0] == 1 else "")


TYPICAL_NORM_DEFINITION = (
    "the median ‖h‖ over every position but the first of the reference prompts' captures "
    "at this layer"
)


def typical_norm(captures: list[np.ndarray]) -> tuple[float, int]:
    """A layer's typical residual norm from `[tokens, hidden]` captures of reference prompts
    at that layer: the median L2 norm over all their positions but the first (the first
    token's norm, an attention sink, is often a hundred times the others'), and how many
    positions that is. A capture of one token counts that token."""
    rows = [capture[1:] if capture.shape[0] > 1 else capture for capture in captures]
    norms = np.linalg.norm(np.concatenate(rows, axis=0), axis=-1)
    return float(np.median(norms)), int(norms.size)


# How the norm heatmap's colours follow ‖h‖: the first position's norm is often many times
# the others', which leaves everything else one colour on a linear scale.
NORM_COLOUR_SCALES = {
    "linear": "linear",
    "log": "log₁₀",
    "clip": "clipped at the 95th percentile",
}


def _position_axis(
    figure: go.Figure,
    capture: Capture,
    rows: list[int],
    axis="x",
    title="position (token)",
    **extra,
):
    update = figure.update_xaxes if axis == "x" else figure.update_yaxes
    labels = capture.labels
    # At most ~40 labelled ticks: every position's label would overlap on a long capture.
    step = max(1, math.ceil(len(rows) / 40))
    update(
        tickmode="array",
        tickvals=rows[::step],
        ticktext=[_text(labels[row]) for row in rows[::step]],
        title=title,
        **extra,
    )
    # The downloads name every position shown by its token's own text.
    export_labels(figure, axis, {row: capture.rows[row].text_label for row in rows})


def _prompt_end_line(figure: go.Figure, capture: Capture, rows: list[int], axes="x") -> None:
    """A dashed line between the prompt's last position and the first generated one, when
    both are shown."""
    boundary = capture.prompt_length - 0.5
    if not rows or not rows[0] < boundary < rows[-1]:
        return
    line = {"color": "#444444", "width": 1, "dash": "dash"}
    if "x" in axes:
        figure.add_vline(x=boundary, line=line)
    if "y" in axes:
        figure.add_hline(y=boundary, line=line)


def norm_colour_range(
    norms: np.ndarray, colour: str
) -> tuple[np.ndarray, float | None, float | None]:
    """The values a norm heatmap colours (‖h‖, or log₁₀ ‖h‖) and its colour range: None
    (automatic) except when clipped, where it runs from the smallest norm shown to the 95th
    percentile of the norms shown (plotly ignores a zmax given without a zmin)."""
    if colour == "log":
        return np.log10(np.maximum(norms, 1e-6)), None, None
    if colour == "clip":
        return norms, float(norms.min()), float(np.percentile(norms, 95))
    return norms, None, None


def activation_norm_heatmap(
    capture: Capture, window: PositionWindow = PositionWindow(), colour: str = "linear"
) -> go.Figure:
    """‖residual‖ by layer × position, coloured linearly, by log₁₀ or clipped (see
    NORM_COLOUR_SCALES); hover always shows the norm itself."""
    rows = window.rows(capture.tensor.shape[1])
    norms = np.linalg.norm(capture.tensor[:, rows, :], axis=-1)
    shown, zmin, zmax = norm_colour_range(norms, colour)
    titles = {"linear": "‖h‖", "log": "log₁₀ ‖h‖", "clip": "‖h‖ (clipped)"}
    figure = go.Figure(
        go.Heatmap(
            z=shown.tolist(),
            customdata=norms.tolist(),
            y=[str(layer) for layer in capture.layers],
            x=rows,
            zmin=zmin,
            zmax=zmax,
            colorscale="Viridis",
            hovertemplate="layer %{y}, position %{x}: ‖h‖=%{customdata:.2f}<extra></extra>",
            colorbar={"title": {"text": titles[colour]}},
        )
    )
    _position_axis(figure, capture, rows, tickangle=-45)
    _prompt_end_line(figure, capture, rows)
    figure.update_yaxes(title="layer", type="category")
    title = (
        f"Residual-stream norm ‖h‖ by layer × position ({NORM_COLOUR_SCALES[colour]}), "
        f"{window.describe(capture.tensor.shape[1])}"
    )
    return _layout(figure, title, height=460)


def activation_norm_by_layer(capture: Capture, position: int) -> go.Figure:
    """‖residual‖ at one position for each captured layer."""
    norms = np.linalg.norm(capture.tensor[:, position, :], axis=-1)
    figure = go.Figure(go.Scatter(x=capture.layers, y=norms.tolist(), mode="lines+markers"))
    figure.update_xaxes(title="layer", **_integer_ticks(capture.layers))
    figure.update_yaxes(title="‖h‖ (L2 norm)")
    return _layout(figure, f"Norm by layer at position {_text(capture.labels[position])}")


def cosine_similarity_matrix(rows: np.ndarray) -> np.ndarray:
    """Pairwise cosine similarity of `[n, d]` rows (a zero row has similarity 0)."""
    norms = np.linalg.norm(rows, axis=-1, keepdims=True)
    unit = rows / np.where(norms == 0, 1, norms)
    return unit @ unit.T


def activation_cosine_figure(
    capture: Capture, layer: int, window: PositionWindow = PositionWindow()
) -> go.Figure:
    """Cosine similarity between the positions shown, at one captured layer."""
    rows = window.rows(capture.tensor.shape[1])
    similarity = cosine_similarity_matrix(capture.tensor[capture.layers.index(layer)][rows])
    figure = go.Figure(
        go.Heatmap(
            z=similarity.tolist(),
            x=rows,
            y=rows,
            zmin=-1,
            zmax=1,
            colorscale="RdBu",
            colorbar={"title": {"text": "cos"}},
            hovertemplate="positions i %{y}, j %{x}: cos %{z:.3f}<extra></extra>",
        )
    )
    # A row position and a column position: both in the downloads, under their own names.
    _position_axis(figure, capture, rows, "y", title="position i (token)", autorange="reversed")
    _position_axis(figure, capture, rows, title="position j (token)", tickangle=-45)
    _prompt_end_line(figure, capture, rows, axes="xy")
    title = (
        f"Cosine similarity between positions, layer {layer}, "
        f"{window.describe(capture.tensor.shape[1])}"
    )
    return _layout(figure, title, height=460)


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
    capture: Capture, layer: int, window: PositionWindow = PositionWindow()
) -> go.Figure:
    """The positions shown, at one captured layer, projected on their first two principal
    components (of those positions only), each marked with its label."""
    rows = window.rows(capture.tensor.shape[1])
    coordinates, share = pca_projection(capture.tensor[capture.layers.index(layer)][rows])
    figure = go.Figure(
        go.Scatter(
            x=coordinates[:, 0].tolist(),
            y=coordinates[:, 1].tolist(),
            text=[_text(capture.labels[row]) for row in rows],
            meta={"text": [capture.rows[row].text_label for row in rows]},
            mode="markers+text",
            textposition="top center",
            marker={
                "color": rows,
                "colorscale": "Viridis",
                "size": 9,
                "colorbar": {"title": {"text": "position"}},
            },
            hovertemplate="position %{text}<extra></extra>",
        )
    )
    figure.update_xaxes(title=f"PC1 ({share[0]:.0%} of the variance)")
    figure.update_yaxes(title=f"PC2 ({share[1]:.0%})")
    title = f"PCA of positions, layer {layer}, {window.describe(capture.tensor.shape[1])}"
    return _layout(figure, title, height=420)


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


def _pair_label(position: int, base: str | None, steered: str | None, shown=_label) -> str:
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
            customdata=[[_label(token), b, s] for token, b, s in base_scores],
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
            customdata=[[_label(token), b, s] for token, b, s in own_scores],
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
    _layout(figure, f"Same tokens under both models, scale {_text(compared['label'])}", 480)
    # The title at the very top, the legend under it: on a narrow screen the legend wraps
    # to three lines, which the top margin leaves room for.
    figure.update_layout(title={"y": 0.99, "yanchor": "top", "yref": "container"})
    return figure.update_layout(
        margin={"r": 70 if base["kl"] is not None else 20, "t": 110, "b": 120}
    )


def _scored_target(response: dict, target: str) -> tuple[float | None, str]:
    """The target's logprob from the scored second prompt (prompt + target, see
    services.vectors.with_target_scored): the sum over the prompt logprobs after the first
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
                name=f"logprob of {_label(target)} (left)",
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
        note = f"No logprob of {_label(target)} at {where}: {_text(missing[0]['missing'])}."
    if note:
        figure.add_annotation(
            text=note, xref="paper", yref="paper", x=0, y=1.02, showarrow=False,
            xanchor="left", yanchor="bottom", font={"color": "#b30000"},
        )  # fmt: skip
    _layout(figure, "Scale sweep", height=420)
    # Room for the right-hand axis and for the note above the plot.
    return figure.update_layout(margin={"r": 60, "t": 70 if note else 40})


# ---------------------------------------------------------------------------------------
# Inside the model: the logit lens and direct logit attribution (numbers from playground.lens)


@dataclass
class LensCells:
    """What the logit-lens heatmap shows at `layers` × positions `rows`: the top tokens
    (strings [layers][positions][k], the most likely first) with their logprobs
    ([layers, positions, k], nats), and per position the target token (None: unknown) with
    its logprob at each layer ([layers, positions], NaN where unknown)."""

    layers: list[int]
    rows: list[int]
    top_tokens: list[list[list[str]]]
    top_logprobs: np.ndarray
    targets: list[str | None]
    target_logprobs: np.ndarray


def _lens_hover(cells: LensCells, layer: int, column: int, label: str) -> str:
    lines = [f"layer {cells.layers[layer]}, position {_text(label)}"]
    for token, logprob in zip(
        cells.top_tokens[layer][column], cells.top_logprobs[layer, column], strict=True
    ):
        lines.append(f"  {_label(token)}: p={math.exp(logprob):.3f} ({logprob:.3f} nats)")
    target, logprob = cells.targets[column], cells.target_logprobs[layer, column]
    if target is not None and not math.isnan(logprob):
        lines.append(f"target {_label(target)}: p={math.exp(logprob):.3g} ({logprob:.3f} nats)")
    return "<br>".join(lines)


def logit_lens_figure(capture: Capture, cells: LensCells, colour: str, target: str) -> go.Figure:
    """Each captured layer's output × position through the final norm and unembedding: the
    cell's text is its most likely token, its colour that token's probability (`colour`
    "top") or the target's logprob in nats ("target"; `target` names it for the title).
    Hover lists the top tokens and the target's logprob."""
    if colour == "top":
        values = np.exp(cells.top_logprobs[:, :, 0])
        scale = {"colorscale": PROBABILITY_COLOURS, "zmin": 0, "zmax": 1}
        bar, what = "p (top token)", "its probability"
    else:
        values = cells.target_logprobs
        scale = {"colorscale": "Viridis", "zmax": 0}
        bar, what = "log p target (nats)", f"logprob of {target}"
    labels = capture.labels
    figure = go.Figure(
        go.Heatmap(
            z=[[None if math.isnan(v) else float(v) for v in row] for row in values],
            x=cells.rows,
            y=[str(layer) for layer in cells.layers],
            text=[[_label(tokens[0]) for tokens in row] for row in cells.top_tokens],
            meta={"text": [[tokens[0] for tokens in row] for row in cells.top_tokens]},
            texttemplate="%{text}",
            textfont={**CELL_TEXT, "size": 10},
            customdata=[
                [
                    _lens_hover(cells, layer, column, labels[row])
                    for column, row in enumerate(cells.rows)
                ]
                for layer in range(len(cells.layers))
            ],
            hovertemplate="%{customdata}<extra></extra>",
            xgap=1,
            ygap=1,
            colorbar={"title": {"text": bar}},
            **scale,
        )
    )
    _position_axis(figure, capture, cells.rows, tickangle=-45)
    _prompt_end_line(figure, capture, cells.rows)
    figure.update_yaxes(title="layer", type="category")
    title = f"Logit lens: the top token at each layer × position (colour: {what})"
    return _layout(figure, title, height=max(320, 20 * len(cells.layers) + 180))


def lens_rank_figure(
    capture: Capture, position: int, target: str, ranks: np.ndarray, logprobs: np.ndarray,
    layers: list[int],
) -> go.Figure:  # fmt: skip
    """The target's rank (1: the most likely; log axis, 1 at the top) in the lens of each
    captured layer at one position; hover adds its logprob (nats)."""
    figure = go.Figure(
        go.Scatter(
            x=layers,
            y=[int(rank) for rank in ranks],
            customdata=[float(logprob) for logprob in logprobs],
            mode="lines+markers",
            hovertemplate="layer %{x}: rank %{y}, logprob %{customdata:.3f} nats<extra></extra>",
        )
    )
    figure.update_xaxes(title="layer", **_integer_ticks(layers))
    # Ranks are whole numbers: ticks at 1, 2, 5, 10, ... (plotly's own log ticks of a few
    # ranks fall on 1.5 and 2.5).
    ticks = list(itertools.takewhile(lambda tick: tick <= 2 * int(max(ranks)), _round_steps()))
    figure.update_yaxes(
        title="rank of the target (1 = most likely)",
        type="log",
        autorange="reversed",
        tickvals=ticks,
        ticktext=[f"{tick:,}" for tick in ticks],
    )
    download_meta(figure, customdata=["target logprob (nats)"])
    title = f"Rank of {target} by layer at position {_text(capture.labels[position])}"
    return _layout(figure, title)


def logit_attribution_figure(
    capture: Capture, position: int, contributions: np.ndarray, totals: dict, measure: str
) -> go.Figure:
    """Direct logit attribution at one position: each block's contribution (nats) to
    `measure` (e.g. "logit(·Paris) − logit(·London)"), block 0's with the embedding, then
    their sum, the measured value and the residue (measured − sum) from `totals`."""
    blocks = ["0 (+ embedding)", *(str(k) for k in range(1, len(contributions)))]
    figure = go.Figure(
        [
            go.Bar(
                x=blocks,
                y=[float(c) for c in contributions],
                marker_color=["#1f5fbf" if c >= 0 else "#c0392b" for c in contributions],
                name="blocks",
                hovertemplate="block %{x}: %{y:.3f} nats<extra></extra>",
            ),
            go.Bar(
                x=["Σ blocks", "measured", "residue"],
                y=[totals["sum"], totals["measured"], totals["residue"]],
                marker_color=["#555555", "#111111", "#e08214"],
                name="totals",
                hovertemplate="%{x}: %{y:.3f} nats<extra></extra>",
            ),
        ]
    )
    figure.update_xaxes(type="category", title="block (output − input)", tickangle=-45)
    figure.update_yaxes(title="contribution (nats)")
    figure.update_layout(showlegend=False)
    title = f"Direct logit attribution of {measure} at position {_text(capture.labels[position])}"
    return _layout(figure, title, height=380)
