"""A run's captured residual stream, decoded: its rows with the token and position each
stands for, windows of positions, and the typical norm of a layer. Pure functions of a run's
request and response (no database)."""

import math
from dataclasses import dataclass

import numpy as np
import plotly.graph_objects as go

from acs_client.codec import decode
from acs_client.protocol import CompletionFields
from playground.plots import export_labels, plot_text, visible_token
from playground.token_positions import token_positions


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


def _known_prompt_tokens(request: CompletionFields, response: dict) -> list[str] | None:
    """The prompt's token strings from the response itself (prompt_logprobs or echo)."""
    positions = token_positions(request, response)
    prompt = [p["token"] for p in positions if p["source"] == "prompt"]
    return prompt or None


def capture_rows(request: CompletionFields, response: dict, tokens: dict | None, count: int):
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


def activations(request: CompletionFields, response: dict, tokens: dict | None = None) -> Capture:
    """The run's capture, its positions named by `capture_rows`."""
    tensor = decode(response["activations"]["residual_stream"])
    layers = request.capture_layers(tensor.shape[0]) or list(range(tensor.shape[0]))
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


# The window an activation view shows unless asked otherwise: every position but the first.
DEFAULT_WINDOW = PositionWindow()


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


def position_axis(
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
        ticktext=[plot_text(labels[row]) for row in rows[::step]],
        title=title,
        **extra,
    )
    # The downloads name every position shown by its token's own text.
    export_labels(figure, axis, {row: capture.rows[row].text_label for row in rows})


def prompt_end_line(figure: go.Figure, capture: Capture, rows: list[int], axes="x") -> None:
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
