"""The run page's look inside the model: the logit lens of a capture run (the lens stored with
it, `Run.lens`, and the captured rows) and the direct logit attribution by layer, for what the
user picks (`LensForm`). The numbers come from `tables`, the drawing from `figures`."""

from collections.abc import Mapping

import numpy as np

from playground import captures, plots, token_positions
from playground.lens import figures as lens_figures
from playground.lens import tables as lens
from playground.lens.forms import LensForm, LensPicks
from playground.lens.run_lens import model_lens_weights
from playground.models import Run

NOT_COMPUTED = (
    "This run has no lens: it finished before the playground computed one. Re-run it to "
    "see the lens."
)


def lens_context(
    run: Run,
    capture: captures.Capture,
    window: captures.PositionWindow,
    query: Mapping | None = None,
) -> dict:
    """The lens section for the positions of `window` the lens covers, with the picks of
    `query` (a bound LensForm when it has any `lens-` field). Without a lens, `note` says
    why."""
    document = run.lens
    if document is None:
        return {"note": NOT_COMPUTED}
    if "unavailable" in document:
        return {"note": document["unavailable"]}
    table = lens.LensTable.from_json(document)
    try:
        weights = model_lens_weights(run.body.model, hidden=capture.tensor.shape[-1])
    except lens.LensUnavailable as error:
        return {"note": str(error)}
    if table.top_ids.max() >= weights.unembedding.shape[0]:
        return {"note": "The model's weights directory holds another vocabulary than this lens's."}
    covered = [(row, capture.labels[row]) for row in table.positions]
    bound = query is not None and any(name.startswith("lens-") for name in query)
    form = LensForm(query if bound else None, weights=weights, positions=covered)
    picks = form.picks()
    section = _Section(capture, table, weights, next_tokens(run, capture))
    rows = [row for row in window.rows(capture.tensor.shape[1]) if row >= table.first]
    position = table.positions[-1] if picks.position is None else picks.position
    context = {
        "form": form,
        "covered": f"{covered[0][1]} – {covered[-1][1]}",
        "partial": table.first > 0,
        "figures": {"lens": section.heatmap(rows or table.positions, picks)},
        "steered": run.body.steering is not None,
        "residue_bound": lens.RESIDUE_BOUND,
    }
    target = section.target(position, picks)
    if target is None:
        context["target_note"] = (
            f"The token after position {capture.labels[position]} is unknown: type a target."
        )
        return context
    context["target"] = section.described(target, picks.target is None)
    context["figures"]["lens_rank"] = section.rank_line(position, target)
    if capture.layers != list(range(weights.n_layers)):
        context["dla_note"] = (
            "Direct logit attribution needs every layer captured (output_residual_stream: "
            f"true); this run captured layer{'s' if len(capture.layers) > 1 else ''} "
            f"{', '.join(map(str, capture.layers))} of {weights.n_layers}."
        )
        return context
    attribution = section.attribution(run, position, target, picks)
    context["dla"] = attribution
    context["figures"]["dla"] = attribution.pop("figure")
    return context


def next_tokens(run: Run, capture: captures.Capture) -> list[captures.CapturedRow]:
    """The token that comes next at each captured position (the next prompt token, or the
    generated one): the run's tokens one position on."""
    count = capture.tensor.shape[1]
    return captures.capture_rows(run.body, run.response, run.tokens, count + 1)[1:]


def reported_logprobs(run: Run, capture: captures.Capture, position: int) -> dict[str, float]:
    """The logprobs the run itself reported for the token after `position` (prompt_logprobs
    or logprobs, with their alternatives), by token string; empty when it reported none or
    its positions do not line up with the capture's."""
    positions = token_positions.token_positions(run.body, run.response, 0, run.tokens)
    prompt = sum(1 for p in positions if p["source"] == "prompt")
    if prompt != capture.prompt_length or position + 1 >= len(positions):
        return {}
    entry = positions[position + 1]
    reported = {item["token"]: item["logprob"] for item in entry["top"]}
    if entry["logprob"] is not None:
        reported[entry["token"]] = entry["logprob"]
    return reported


class _Section:
    """The numbers and figures of one run's lens section."""

    def __init__(self, capture, table: lens.LensTable, weights, following):
        self.capture, self.table, self.weights, self.following = capture, table, weights, following

    def token(self, token_id: int) -> str:
        return self.weights.token_string(token_id)

    def target(self, position: int, picks: LensPicks) -> int | None:
        """The picked target, else the token that comes next at `position` (None: unknown)."""
        return picks.target if picks.target is not None else self.following[position].token_id

    def described(self, token_id: int, is_next: bool) -> str:
        what = " (the token that comes next there)" if is_next else ""
        return f"{plots.visible_token(self.token(token_id))} (id {token_id}){what}"

    def heatmap(self, rows: list[int], picks: LensPicks):
        columns = [row - self.table.first for row in rows]
        if picks.target is not None:
            ids = np.full(len(rows), picks.target)
            name = plots.visible_token(self.token(picks.target))
        else:
            following = [self.following[row].token_id for row in rows]
            ids = np.array([-1 if token_id is None else token_id for token_id in following])
            name = "the next token"
        logprobs = lens.token_logprobs(
            self.capture.tensor[:, rows], self.table.log_normaliser[:, columns], self.weights, ids
        )
        cells = lens_figures.LensCells(
            layers=self.table.layers,
            rows=rows,
            top_tokens=[
                [[self.token(i) for i in self.table.top_ids[layer, column]] for column in columns]
                for layer in range(len(self.table.layers))
            ],
            top_logprobs=self.table.top_logprobs[:, columns],
            targets=[self.token(i) if i >= 0 else None for i in ids],
            target_logprobs=logprobs,
        )
        return lens_figures.logit_lens_figure(self.capture, cells, picks.colour, name)

    def rank_line(self, position: int, target: int):
        rows = self.capture.tensor[:, position]
        column = position - self.table.first
        ranks = lens.token_ranks(rows, self.weights, target)
        logprobs = lens.token_logprobs(
            rows[:, None], self.table.log_normaliser[:, [column]], self.weights, np.array([target])
        )[:, 0]
        label = plots.visible_token(self.token(target))
        return lens_figures.lens_rank_figure(
            self.capture, position, label, ranks, logprobs, self.table.layers
        )

    def attribution(self, run: Run, position: int, target: int, picks: LensPicks) -> dict:
        """The attribution's figure, what it explains and its totals (nats)."""
        foil = None
        if picks.attributed == "difference":
            foil = picks.foil if picks.foil is not None else self._runner_up(position, target)
        rows = self.capture.tensor[:, position]
        contributions = lens.direct_logit_attribution(rows, self.weights, target, foil)
        total = float(contributions.sum())
        measured, source = self._measured(run, position, target, foil)
        totals = {"sum": total, "measured": measured, "residue": measured - total}
        names = [plots.visible_token(self.token(t)) for t in (target, foil) if t is not None]
        measure = " − ".join(f"logit({name})" for name in names)
        figure = lens_figures.logit_attribution_figure(
            self.capture, position, contributions, totals, measure
        )
        return {
            **totals,
            "measure": measure,
            "source": source,
            "foil": None if foil is None else self.described(foil, False),
            "figure": figure,
        }

    def _runner_up(self, position: int, target: int) -> int:
        """The likeliest token other than `target` at the last layer."""
        top = self.table.top_ids[-1, position - self.table.first]
        return int(next(token for token in top if token != target))

    def _measured(self, run, position: int, target: int, foil: int | None) -> tuple[float, str]:
        """The measured logit difference, from the logprobs the run reported when it reported
        both tokens, else (and for a logit alone, which no logprob gives) the lens at the
        last layer; and where it came from."""
        if foil is not None:
            reported = reported_logprobs(run, self.capture, position)
            target_text, foil_text = self.token(target), self.token(foil)
            if target_text in reported and foil_text in reported:
                return reported[target_text] - reported[foil_text], "reported"
        logits = self.weights.logits(self.capture.tensor[-1, position]).astype(np.float64)
        return float(logits[target] - (0.0 if foil is None else logits[foil])), "lens"
