"""The run page's figures, declared once: each one's name (its slot on the page, its URL under
`views.run_figure`, the id of its data), its section, when a run shows it, how it is drawn,
the picker that redraws it (a query parameter, its label and options) and how it takes the
page's width. The page (`views.run_context`), `views.run_figure` and the template read this
table; a new figure is one entry. The numbers are the figures modules' and `lens.section`'s."""

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

import plotly.graph_objects as go

from playground import captures, plots, token_positions
from playground.lens.section import lens_context
from playground.models import Run
from playground.runs import activation_figures, figures

TOKENS, ACTIVATIONS, LENS = "tokens", "activations", "lens"
# How a figure takes the page's width (static/js/playground.js reads it): "fit" draws it at
# the width it has; "strip" re-wraps the token strip's cells to it; "scroll" keeps its cells
# readable and scrolls inside its own box when the page is narrower.
FIT, STRIP, SCROLL = "fit", "strip", "scroll"


@dataclass(frozen=True)
class ActivationPicks:
    """What the activation figures show: the positions (`window`), the heatmap's colours, the
    position of the norm-by-layer plot (None: the last) and the rows (index into the captured
    layers) of the cosine and PCA plots. `window_error` says why the window cannot be drawn
    (its end before its start): the figures over it are then left out."""

    window: captures.PositionWindow = field(default_factory=captures.PositionWindow)
    colour: str = "linear"
    norm_position: int | None = None
    cosine_row: int = 0
    pca_row: int = 0
    window_error: str = ""


class Drawing:
    """One run's figures for the picks of a query: what the figures are drawn from, each part
    computed once, when a figure first needs it."""

    def __init__(self, run: Run, *, choice: int = 0, picks=None, query=None):
        self.run, self.choice, self.query = run, choice, query or {}
        self.picks = picks or ActivationPicks()

    @cached_property
    def positions(self) -> list[dict]:
        response = self.run.response
        return token_positions.token_positions(
            self.run.body, response, self.choice, self.run.tokens
        )

    @cached_property
    def prompt_logprobs(self) -> list:
        if self.run.body.prompt_logprobs != -1:
            return []
        return self.run.response["choices"][self.choice].get("prompt_logprobs") or []

    @cached_property
    def capture(self) -> captures.Capture | None:
        if not (self.run.response.get("activations") or {}).get("residual_stream"):
            return None
        return captures.activations(self.run.body, self.run.response, self.run.tokens)

    @cached_property
    def lens(self) -> dict:
        return lens_context(self.run, self.capture, self.picks.window, self.query)

    def picked(self, parameter: str, default):
        """The query's value of a picker's `parameter` (`run_figure` checked it is one of the
        picker's options), else `default`."""
        value = self.query.get(parameter)
        return default if value is None else int(value)


@dataclass(frozen=True)
class Picker:
    """The select that redraws a figure: its query `parameter`, its `label`, its options
    (value, label) for a drawing and the value it shows picked."""

    parameter: str
    label: str
    options: Callable[[Drawing], list[tuple]]
    picked: Callable[[Drawing], object]


@dataclass(frozen=True)
class RunFigure:
    """One figure of the run page (see the module's docstring). `over_window`: drawn over the
    activation window's positions, and left out while the window is wrong."""

    name: str
    section: str
    shown: Callable[[Drawing], bool]
    draw: Callable[[Drawing], go.Figure]
    picker: Picker | None = None
    width: str = FIT
    over_window: bool = False

    def entry(self, drawing: Drawing) -> dict:
        """The figure as the template and `_figure.html` take it, with its picker's options and
        picked value."""
        picker = None
        if self.picker is not None:
            picker = {
                "parameter": self.picker.parameter,
                "label": self.picker.label,
                "options": self.picker.options(drawing),
                "picked": self.picker.picked(drawing),
            }
        return {
            **plots.figure_entry(self.name, self.draw(drawing)),
            "width": self.width,
            "picker": picker,
        }


def _scored(drawing: Drawing) -> list[dict]:
    """The positions the top-k picker offers: those with a top-k."""
    return [p for p in drawing.positions if p["top"]]


def _scored_options(drawing: Drawing) -> list[tuple]:
    return [(p["position"], f"{p['position']} {p['label']}") for p in _scored(drawing)]


def _top_k(drawing: Drawing) -> go.Figure:
    default = _scored(drawing)[-1]["position"]
    position = drawing.picked("position", default)
    return figures.top_k_figure(next(p for p in drawing.positions if p["position"] == position))


def _prompt(drawing: Drawing) -> list[dict]:
    return [p for p in drawing.positions if p["source"] == "prompt"]


def _norm_position(drawing: Drawing) -> int:
    """The position of the norm-by-layer plot: the picked one, else the last."""
    picked = drawing.picks.norm_position
    return drawing.capture.tensor.shape[1] - 1 if picked is None else picked


def _layer_options(drawing: Drawing) -> list[tuple]:
    return list(enumerate(drawing.capture.layers))


def _activations_shown(drawing: Drawing) -> bool:
    return drawing.capture is not None


def _over_window(drawing: Drawing) -> bool:
    return drawing.capture is not None and not drawing.picks.window_error


def _lens_figure(name: str, width: str) -> RunFigure:
    """A figure of the lens section: drawn when the section's context drew it."""
    return RunFigure(
        name=name,
        section=LENS,
        shown=lambda d: name in d.lens.get("figures", {}),
        draw=lambda d: d.lens["figures"][name],
        width=width,
    )


FIGURES = [
    RunFigure(
        name="tokens",
        section=TOKENS,
        shown=lambda d: any(p["logprob"] is not None for p in d.positions),
        draw=lambda d: figures.token_strip_figure(d.positions),
        width=STRIP,
    ),
    RunFigure(
        name="topk",
        section=TOKENS,
        shown=lambda d: any(p["logprob"] is not None for p in d.positions) and bool(_scored(d)),
        draw=_top_k,
        picker=Picker(
            "position",
            "Position",
            options=_scored_options,
            picked=lambda d: d.picked("position", _scored(d)[-1]["position"]),
        ),
    ),
    RunFigure(
        name="surprisal",
        section=TOKENS,
        shown=lambda d: any(p["logprob"] is not None for p in _prompt(d)),
        draw=lambda d: figures.prompt_surprisal_figure(d.positions),
    ),
    RunFigure(
        name="distribution",
        section=TOKENS,
        shown=lambda d: len(d.prompt_logprobs) > 1,
        draw=lambda d: figures.prompt_distribution_figure(
            d.prompt_logprobs, max(d.picked("position", 1), 1)
        ),
        picker=Picker(
            "position",
            "Prompt position",
            options=lambda d: [(p, p) for p in range(1, len(d.prompt_logprobs))],
            picked=lambda d: d.picked("position", 1),
        ),
    ),
    RunFigure(
        name="heatmap",
        section=ACTIVATIONS,
        shown=_over_window,
        draw=lambda d: activation_figures.activation_norm_heatmap(
            d.capture, d.picks.window, d.picks.colour
        ),
        picker=Picker(
            "colour",
            "Colour",
            options=lambda d: list(activation_figures.NORM_COLOUR_SCALES.items()),
            picked=lambda d: d.picks.colour,
        ),
        width=SCROLL,
        over_window=True,
    ),
    RunFigure(
        name="norm_by_layer",
        section=ACTIVATIONS,
        shown=_activations_shown,
        draw=lambda d: activation_figures.activation_norm_by_layer(d.capture, _norm_position(d)),
        picker=Picker(
            "norm_position",
            "Position",
            options=lambda d: list(enumerate(d.capture.labels)),
            picked=lambda d: _norm_position(d),
        ),
    ),
    RunFigure(
        name="cosine",
        section=ACTIVATIONS,
        shown=_over_window,
        draw=lambda d: activation_figures.activation_cosine_figure(
            d.capture, d.capture.layers[d.picks.cosine_row], d.picks.window
        ),
        picker=Picker(
            "cosine_row", "Layer", options=_layer_options, picked=lambda d: d.picks.cosine_row
        ),
        width=SCROLL,
        over_window=True,
    ),
    RunFigure(
        name="pca",
        section=ACTIVATIONS,
        shown=_over_window,
        draw=lambda d: activation_figures.activation_pca_figure(
            d.capture, d.capture.layers[d.picks.pca_row], d.picks.window
        ),
        picker=Picker("pca_row", "Layer", options=_layer_options, picked=lambda d: d.picks.pca_row),
        over_window=True,
    ),
    # The lens section's figures share one form of picks (lens_forms.LensForm).
    *(
        _lens_figure(name, width)
        for name, width in (("lens", SCROLL), ("lens_rank", FIT), ("dla", FIT))
    ),
]
BY_NAME = {figure.name: figure for figure in FIGURES}


def section_entries(drawing: Drawing, section: str) -> dict[str, dict]:
    """The figures of `section` that `drawing`'s run shows, by name, in the table's order."""
    return {
        figure.name: figure.entry(drawing)
        for figure in FIGURES
        if figure.section == section and figure.shown(drawing)
    }
