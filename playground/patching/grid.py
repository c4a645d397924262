"""An activation patching grid as its page shows it (see `services` for how its runs are made
and `patching_metrics` for its numbers): the runs of one group read back, their values of the
chosen metric, the baselines and noise floor, the progress, and the export of every number."""

import uuid
from dataclasses import dataclass

from django.conf import settings

from accounts.models import User
from infra.lifecycle import WorkStatus
from playground import plots
from playground.models import Run, RunKind
from playground.patching import exports as patching_exports
from playground.patching.metrics import (
    METRIC_DEFINITIONS,
    METRICS,
    baseline,
    effect_colour,
    metric_value,
    noise_floor,
    normalised_effect,
    target_scores,
    within_floor,
)
from playground.patching.services import spec_targets
from playground.runs import selectors


def run_outcome(run: Run) -> str:
    """A grid's run's outcome: ran (succeeded), failed, cancelled (never sent) or pending
    (shared with `patchscopes`)."""
    if run.status == WorkStatus.SUCCEEDED:
        return "ran"
    if run.status == WorkStatus.FAILED:
        return "failed"
    if run.status == WorkStatus.CANCELLED:
        return "cancelled"
    return "pending"


def _counted(count: int, what: str) -> str:
    return f"{count} {what}{'' if count == 1 else 's'}"


@dataclass
class PatchingGrid:
    group: uuid.UUID
    spec: dict
    clean: Run
    corrupted: Run
    clean_score: Run | None
    repeats: list[Run]
    cells: dict  # (layer, position) -> Run
    cancelled: bool
    metric: str

    @property
    def build_error(self) -> str | None:
        return self.clean.meta.get("build_error")

    @property
    def targets(self) -> list[list[int]]:
        return spec_targets(self.spec)

    @property
    def metrics(self) -> dict[str, str]:
        """The metrics this grid's requests scored, by name."""
        names = ["logprob"] + (["logit_diff"] if len(self.targets) > 1 else [])
        return {name: METRICS[name] for name in names}

    @property
    def metric_label(self) -> str:
        return METRICS[self.metric]

    @property
    def metric_definition(self) -> str:
        return METRIC_DEFINITIONS[self.metric]

    @property
    def target_shown(self) -> str:
        return plots.visible_token(self.spec["target"])

    @property
    def corrupted_target_shown(self) -> str:
        return plots.visible_token(self.spec.get("corrupted_target") or "")

    @property
    def labels(self) -> list[dict]:
        """Each patched position: its index and its clean and corrupted tokens."""
        spec = self.spec
        shown = []
        for position in spec["positions"]:
            clean, corrupted = (
                plots.visible_token(strings[position]) if strings else None
                for strings in (spec["clean_strings"], spec["corrupted_strings"])
            )
            shown.append(
                {
                    "position": position,
                    "clean": clean,
                    "corrupted": corrupted if corrupted != clean else None,
                }
            )
        return shown

    # The runs' numbers

    def scores(self, run: Run | None) -> list[float] | None:
        """The target scores of a succeeded run (see `patching_metrics.target_scores`)."""
        if run is None or run.status != WorkStatus.SUCCEEDED:
            return None
        return target_scores(run.response, len(self.spec["clean_ids"]), self.targets)

    def value(self, run: Run | None, metric: str | None = None) -> float | None:
        """The run's value of `metric` (the grid's shown one by default)."""
        scores = self.scores(run)
        return None if scores is None else metric_value(scores, metric or self.metric)

    def baselines(self, metric: str | None = None) -> dict:
        """The clean value, the corrupted baseline, the repeats' values and the noise floor
        of `metric`, and the floor as a share of clean − corrupted. Grids made before the
        repeats have the captures' values and no floor."""
        clean = self.value(self.clean_score or self.clean, metric)
        repeated = [self.value(run, metric) for run in self.repeats or [self.corrupted]]
        values = [value for value in repeated if value is not None]
        corrupted = baseline(values)
        floor = noise_floor(values) if self.repeats else None
        gap = None if clean is None or corrupted is None else abs(clean - corrupted)
        return {
            "clean": clean,
            "corrupted": corrupted,
            "repeats": values,
            "noise_floor": floor,
            "noise_floor_effect": floor / gap if floor is not None and gap else None,
        }

    def rows(self) -> list[dict]:
        """One row per layer, each with one cell per position: its run, the shown metric's
        value, the normalised effect, whether it is within the noise floor and the cell's
        colour."""
        numbers = self.baselines()
        rows = []
        for layer in self.spec["layers"]:
            cells = []
            for position in self.spec["positions"]:
                run = self.cells.get((layer, position))
                value = self.value(run)
                effect = normalised_effect(value, numbers["clean"], numbers["corrupted"])
                cells.append(
                    {
                        "position": position,
                        "run": run,
                        "value": value,
                        "effect": effect,
                        "within_floor": within_floor(
                            value, numbers["corrupted"], numbers["noise_floor"]
                        ),
                        "colour": effect_colour(effect),
                    }
                )
            rows.append({"layer": layer, "cells": cells})
        return rows

    # Progress

    @property
    def _score_runs(self) -> list[Run]:
        return [run for run in (self.clean_score, *self.repeats) if run is not None]

    @property
    def cell_count(self) -> int:
        return len(self.spec["layers"]) * len(self.spec["positions"])

    @property
    def total(self) -> int:
        # Grids made before the baseline requests had only the captures and the cells.
        baselines = 1 + self.spec["repeats"] if "repeats" in self.spec else 0
        return 2 + baselines + self.cell_count

    @property
    def done(self) -> int:
        runs = (self.clean, self.corrupted, *self._score_runs, *self.cells.values())
        return sum(run.is_finished for run in runs)

    def tally(self) -> dict[str, dict[str, int]]:
        """How many of the captures, the baseline requests (clean and repeats) and the cells
        ran, failed, were cancelled unsent or are still pending."""
        parts = {
            "captures": (self.clean, self.corrupted),
            "baselines": self._score_runs,
            "cells": self.cells.values(),
        }
        tally = {}
        for part, runs in parts.items():
            outcomes = [run_outcome(run) for run in runs]
            tally[part] = {
                outcome: outcomes.count(outcome)
                for outcome in ("ran", "failed", "cancelled", "pending")
            }
        return tally

    @property
    def cancelled_summary(self) -> str:
        """What a cancelled grid ran and what it never sent."""
        tally = self.tally()
        cells, baselines = tally["cells"], tally["baselines"]
        ran = [f"{tally['captures']['ran']} of 2 captures"]
        if self.cells:
            ran.append(f"{cells['ran']} of {self.cell_count} cells")
            ran.append(f"{baselines['ran']} of {len(self._score_runs)} baseline requests")
        text = "Ran: " + ", ".join(ran) + "."
        failed = tally["captures"]["failed"] + cells["failed"] + baselines["failed"]
        if failed:
            text += f" Failed: {_counted(failed, 'request')}."
        unsent = [
            _counted(part["cancelled"], what)
            for part, what in (
                (tally["captures"], "capture"), (cells, "cell"), (baselines, "baseline request"),
            )
            if part["cancelled"]
        ]  # fmt: skip
        if unsent:
            text += " Cancelled before they were sent (never billed): " + ", ".join(unsent) + "."
        if not self.cells:
            text += f" None of the {self.cell_count} cells was created."
        pending = sum(part["pending"] for part in tally.values())
        if pending:
            text += f" Still finishing: {_counted(pending, 'request')} already sent."
        return text

    @property
    def capture_failed(self) -> bool:
        return any(run.status == WorkStatus.FAILED for run in (self.clean, self.corrupted))

    @property
    def finished(self) -> bool:
        if self.build_error:
            return True
        if self.capture_failed or (self.cancelled and not self.cells):
            return self.clean.is_finished and self.corrupted.is_finished
        runs = (*self._score_runs, *self.cells.values())
        return bool(self.cells) and all(run.is_finished for run in runs)

    @property
    def cancellable(self) -> bool:
        return not self.finished and not self.cancelled

    # What the page embeds and the downloads hold

    def records(self) -> list[dict]:
        """One record per scoring run (the clean baseline, the repeats, the cells; the
        captures for grids made before the repeats): its role, layer and position, tokens,
        run, status, the corrupted target's logprob (with one), and per metric its value and,
        for cells, the normalised effect and whether it is within the noise floor."""
        numbers = {metric: self.baselines(metric) for metric in self.metrics}
        clean_strings, corrupted_strings = (
            self.spec[name] or [] for name in ("clean_strings", "corrupted_strings")
        )
        entries = [("clean", self.clean_score or self.clean, None, None)]
        entries += [("repeat", run, None, None) for run in self.repeats or [self.corrupted]]
        entries += [
            ("cell", self.cells.get((layer, position)), layer, position)
            for layer in self.spec["layers"]
            for position in self.spec["positions"]
        ]
        records = []
        for role, run, layer, position in entries:
            # The tokens' own text (the page's labels show their whitespace as · and ⏎).
            record = {
                "role": role,
                "layer": layer,
                "position": position,
                "clean_token": _string_at(clean_strings, position),
                "corrupted_token": _string_at(corrupted_strings, position),
                "run": str(run.pk) if run else None,
                "request_id": run.request_id if run else None,
                "status": run.status if run else None,
            }
            scores = self.scores(run) or []
            if len(self.targets) > 1:
                record["corrupted_target_logprob"] = scores[1] if len(scores) > 1 else None
            for metric, baseline_numbers in numbers.items():
                value = self.value(run, metric)
                record[metric] = value
                if role == "cell":
                    record[f"{metric}_effect"] = normalised_effect(
                        value, baseline_numbers["clean"], baseline_numbers["corrupted"]
                    )
                    record[f"{metric}_within_floor"] = within_floor(
                        value, baseline_numbers["corrupted"], baseline_numbers["noise_floor"]
                    )
            records.append(record)
        return records

    @property
    def notebook(self) -> str:
        """The acs_client code that runs this grid again (see `exports`)."""
        return patching_exports.patching_notebook(self, base_url=settings.SITE_URL)

    def export(self) -> dict:
        """The grid's numbers as the page embeds them and the JSON download holds them."""
        spec = self.spec
        targets = [
            {"text": spec["target"], "ids": self.targets[0],
             "tokens": spec.get("target_strings")},
        ]  # fmt: skip
        if len(self.targets) > 1:
            targets.append(
                {"text": spec["corrupted_target"], "ids": self.targets[1],
                 "tokens": spec.get("corrupted_target_strings")}
            )  # fmt: skip
        return {
            "group": str(self.group),
            "model": self.clean.body.model,
            "clean_prompt": spec.get("clean_prompt"),
            "corrupted_prompt": spec.get("corrupted_prompt"),
            "clean_ids": spec["clean_ids"],
            "clean_tokens": spec["clean_strings"],
            "corrupted_ids": spec["corrupted_ids"],
            "corrupted_tokens": spec["corrupted_strings"],
            "targets": targets,
            "layers": spec["layers"],
            "positions": spec["positions"],
            "captures": {
                role: {"run": str(run.pk), "request_id": run.request_id}
                for role, run in (("clean", self.clean), ("corrupted", self.corrupted))
            },
            "metric": self.metric,
            "metrics": {
                metric: {
                    "label": label,
                    "definition": METRIC_DEFINITIONS[metric],
                    **self.baselines(metric),
                }
                for metric, label in self.metrics.items()
            },
            "effect": "(patched − corrupted) / (clean − corrupted) of the metric",
            "noise_floor": (
                "the range (max − min) of the metric over the repeats: the same unpatched "
                "corrupted request sent among the cells"
            ),
            "runs": self.records(),
        }


def patching_grid_for_user(*, user: User, group, metric: str = "") -> PatchingGrid | None:
    """The user's grid `group` showing `metric` (its own choice when empty), or None when
    there is none (another user's included). The caller checks `metric` is one of the
    grid's `metrics`."""
    runs = list(
        Run.objects.filter(user=user, group=group, kind__in=selectors.PATCHING_KINDS).order_by(
            "created_at", "id"
        )
    )
    captures = {run.meta["role"]: run for run in runs if run.kind == RunKind.PATCHING_CAPTURE}
    if set(captures) != {"clean", "corrupted"}:
        return None
    clean = captures["clean"]
    scored = [run for run in runs if run.kind == RunKind.PATCHED]
    return PatchingGrid(
        group=clean.group,
        spec=clean.meta["patching"],
        clean=clean,
        corrupted=captures["corrupted"],
        clean_score=next((run for run in scored if run.meta.get("role") == "clean"), None),
        repeats=[run for run in scored if run.meta.get("role") == "repeat"],
        cells={
            (run.meta["layer"], run.meta["position"]): run for run in scored if "layer" in run.meta
        },
        cancelled=bool(clean.meta.get("cancelled")),
        metric=metric or clean.meta["patching"].get("metric", "logprob"),
    )


def _string_at(strings: list[str], position: int | None) -> str | None:
    """The token at `position` of a prompt's token strings (None: no position, or the
    grid's tokens are unknown)."""
    return strings[position] if position is not None and position < len(strings) else None


def latest_patching_group(*, user: User):
    """The group of the user's latest patching grid, if any."""
    return (
        Run.objects.filter(user=user, kind=RunKind.PATCHING_CAPTURE)
        .values_list("group", flat=True)
        .first()
    )
