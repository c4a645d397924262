"""Activation patching (causal tracing): which layer and position of a clean prompt carry what
makes the model predict a target token, measured by patching them one at a time into a
corrupted prompt of the same token length.

A grid is one group of runs through the workers, sent with the user's playground key like
every run (so budgets apply and each cell is a run with its own page):

1. two capture runs (`RunKind.PATCHING_CAPTURE`): the clean and the corrupted prompt, each
   followed by the target token (token ids, teacher-forced), capturing the residual stream at
   the chosen layers; `prompt_logprobs: 0` gives the target's logprob after the prompt from
   the full distribution, however unlikely the target is;
2. once both have succeeded (`patched_runs_create`), one run per layer × position
   (`RunKind.PATCHED`): the corrupted prompt + target, steered at that layer and position
   alone with clean row − corrupted row (scale 1, no norm_match). Capture layer L and steering
   at layer L are both the output of decoder block L, so the patched block's output there is
   the clean one (up to bfloat16 rounding of the sent vector), and everything after it follows.

The normalised effect of a cell is (patched − corrupted) / (clean − corrupted) of the target's
logprob: 1 where patching that one layer and position restores the clean prediction, 0 where
it changes nothing.
"""

import datetime as dt
import logging
import uuid
from dataclasses import dataclass

import numpy as np
from django.db import transaction
from django.db.models import Exists, OuterRef
from django.utils import timezone

from accounts.models import User
from acs_client.codec import encode_vector
from api.tokenizer import PromptTokens

from . import figures, selectors
from .models import Run, RunKind, RunStatus
from .services.runs import run_create, submitted_once

logger = logging.getLogger(__name__)

# |clean − corrupted| below this many nats leaves nothing to restore: no normalised effect.
MIN_LOGPROB_GAP = 1e-3
CANCELLED_CODE = "cancelled"
# A capture's worker queues the patched runs as soon as the second capture succeeds; a grid
# whose captures both succeeded this long ago with no patched run lost that worker.
STALLED_AFTER = dt.timedelta(seconds=60)
BUILD_FAILED_MESSAGE = (
    "The patched runs could not be built from the two captures, so the grid stopped; "
    "submit it again."
)


# ---------------------------------------------------------------------------------------
# Writes


def _capture_request(*, model: str, prompt_ids: list[int], target_id: int, layers) -> dict:
    return {
        "model": model,
        "prompt": [*prompt_ids, target_id],
        "max_tokens": 1,
        "temperature": 0,
        "prompt_logprobs": 0,
        "output_residual_stream": list(layers),
    }


def patching_grid_create(
    *,
    user: User,
    model: str,
    clean: PromptTokens,
    corrupted: PromptTokens,
    target: str,
    target_id: int,
    layers: list[int],
    positions: list[int],
    submit_token: uuid.UUID | None = None,
) -> uuid.UUID:
    """Queue the clean and corrupted captures of a patching grid; its patched runs follow
    when both have succeeded (`patched_runs_create`). Returns the grid's group id (that of
    the first grid, when `submit_token` was submitted before)."""
    spec = {
        "clean_ids": clean.ids,
        "clean_strings": clean.strings,
        "corrupted_ids": corrupted.ids,
        "corrupted_strings": corrupted.strings,
        "target": target,
        "target_id": target_id,
        "layers": layers,
        "positions": positions,
    }

    def create() -> uuid.UUID:
        group = uuid.uuid4()
        with transaction.atomic():
            for role, tokens in (("clean", clean), ("corrupted", corrupted)):
                run_create(
                    user=user,
                    kind=RunKind.PATCHING_CAPTURE,
                    group=group,
                    request=_capture_request(
                        model=model, prompt_ids=tokens.ids, target_id=target_id, layers=layers
                    ),
                    meta={"role": role, "patching": spec},
                    submit_token=submit_token if role == "clean" else None,
                )
        return group

    return submitted_once(
        user=user, submit_token=submit_token, create=create, existing=lambda run: run.group
    )


def _captures_locked(group) -> dict[str, Run]:
    """The grid's two capture runs by role, their rows locked so that creating the patched
    runs and cancelling the grid happen one after the other."""
    runs = Run.objects.select_for_update().filter(group=group, kind=RunKind.PATCHING_CAPTURE)
    return {run.meta["role"]: run for run in runs.order_by("queued_at")}


def patched_runs_create(*, group) -> int:
    """Queue one patched run per layer × position once both captures of the grid have
    succeeded; idempotent (both captures' workers call it), and nothing for a cancelled grid.
    Returns how many runs it queued."""
    with transaction.atomic():
        captures = _captures_locked(group)
        clean, corrupted = captures.get("clean"), captures.get("corrupted")
        if clean is None or corrupted is None or clean.meta.get("cancelled"):
            return 0
        if clean.status != RunStatus.SUCCEEDED or corrupted.status != RunStatus.SUCCEEDED:
            return 0
        if Run.objects.filter(group=group, kind=RunKind.PATCHED).exists():
            return 0
        spec = clean.meta["patching"]
        clean_rows = figures.activations(clean.request, clean.response).tensor
        corrupted_rows = figures.activations(corrupted.request, corrupted.response).tensor
        base = {
            key: value
            for key, value in corrupted.request.items()
            if key != "output_residual_stream"
        }
        for row, layer in enumerate(spec["layers"]):
            for position in spec["positions"]:
                difference = clean_rows[row, position] - corrupted_rows[row, position]
                request = dict(base)
                request["apply_steering_vectors"] = [
                    {
                        "activations": encode_vector(difference[None, :].astype(np.float32)),
                        "layer_indices": [layer],
                        "position_indices": [position],
                        "scale": 1.0,
                        "norm_match": False,
                    }
                ]
                run_create(
                    user=clean.user,
                    kind=RunKind.PATCHED,
                    group=group,
                    scale=1.0,
                    request=request,
                    meta={"layer": layer, "position": position},
                )
    return len(spec["layers"]) * len(spec["positions"])


def patched_runs_create_or_fail(*, group) -> int:
    """`patched_runs_create`, except that a grid whose patched runs cannot be built (an
    answer without the captured rows, say) is marked failed, so that its page stops
    following it, instead of raising. Returns how many runs it queued."""
    try:
        return patched_runs_create(group=group)
    except Exception:
        logger.exception("patching grid %s: patched runs not built", group)
        with transaction.atomic():
            clean = _captures_locked(group)["clean"]
            Run.objects.filter(pk=clean.pk).update(
                meta={**clean.meta, "build_error": BUILD_FAILED_MESSAGE}
            )
        return 0


def patching_grids_resume_stalled(*, now=None) -> int:
    """Queue the patched runs of grids whose captures both succeeded over `STALLED_AFTER`
    ago with none queued (their worker stopped in between), or mark them failed where the
    runs cannot be built. Run by beat with the other sweeps. Returns how many runs it queued."""
    cutoff = (now or timezone.now()) - STALLED_AFTER
    stalled = (
        Run.objects.filter(
            kind=RunKind.PATCHING_CAPTURE,
            meta__role="clean",
            status=RunStatus.SUCCEEDED,
            finished_at__lt=cutoff,
        )
        .exclude(meta__has_key="cancelled")
        .exclude(meta__has_key="build_error")
        .exclude(Exists(Run.objects.filter(group=OuterRef("group"), kind=RunKind.PATCHED)))
    )
    return sum(
        patched_runs_create_or_fail(group=group)
        for group in stalled.values_list("group", flat=True)
    )


def patching_grid_cancel(*, user: User, group) -> int:
    """Cancel a grid: its runs not yet taken by a worker fail as cancelled (never sent, so
    never billed), and no patched runs are created afterwards. Runs already being sent
    finish. Returns how many runs were cancelled."""
    now = timezone.now()
    with transaction.atomic():
        clean = _captures_locked(group).get("clean")
        if clean is None or clean.user_id != user.pk:
            return 0
        Run.objects.filter(pk=clean.pk).update(meta={**clean.meta, "cancelled": True})
        return Run.objects.filter(group=group, status=RunStatus.QUEUED).update(
            status=RunStatus.FAILED,
            error_code=CANCELLED_CODE,
            error_message="Cancelled with its patching grid before it was sent.",
            finished_at=now,
        )


# ---------------------------------------------------------------------------------------
# Reads: the grid as the page shows it


def target_logprob(run: Run, target_id: int) -> float | None:
    """The target's logprob after the prompt in a finished run (the last prompt_logprobs
    entry: the target is the prompt's last token), None unless the run succeeded."""
    if run.status != RunStatus.SUCCEEDED:
        return None
    entry = run.response["choices"][0]["prompt_logprobs"][-1]
    return entry[str(target_id)]["logprob"]


def normalised_effect(patched: float | None, clean: float | None, corrupted: float | None):
    """(patched − corrupted) / (clean − corrupted), None where a value is missing or clean and
    corrupted are too close for the ratio to mean anything."""
    if patched is None or clean is None or corrupted is None:
        return None
    if abs(clean - corrupted) < MIN_LOGPROB_GAP:
        return None
    return (patched - corrupted) / (clean - corrupted)


# Diverging colours, light at the ends so the dark number on every cell stays readable:
# blue for −1 (patching moves the logprob further from the clean one), white for 0, red for 1.
EFFECT_COLOURS = ((-1.0, (103, 169, 207)), (0.0, (255, 255, 255)), (1.0, (239, 138, 98)))


def effect_colour(effect: float | None) -> str:
    """The cell's background: the effect clipped to [−1, 1] on EFFECT_COLOURS; grey when
    there is none."""
    if effect is None:
        return "#e5e5e5"
    value = max(-1.0, min(1.0, effect))
    (low, low_rgb), (high, high_rgb) = EFFECT_COLOURS[:2] if value < 0 else EFFECT_COLOURS[1:]
    share = (value - low) / (high - low)
    rgb = [round(a + (b - a) * share) for a, b in zip(low_rgb, high_rgb, strict=True)]
    return "#" + "".join(f"{channel:02x}" for channel in rgb)


@dataclass
class PatchingGrid:
    group: uuid.UUID
    spec: dict
    clean: Run
    corrupted: Run
    cells: dict  # (layer, position) -> Run
    clean_logprob: float | None
    corrupted_logprob: float | None
    cancelled: bool

    @property
    def build_error(self) -> str | None:
        return self.clean.meta.get("build_error")

    @property
    def target_shown(self) -> str:
        return figures.visible_token(self.spec["target"])

    @property
    def labels(self) -> list[dict]:
        """Each patched position: its index and its clean and corrupted tokens."""
        spec = self.spec
        shown = []
        for position in spec["positions"]:
            clean, corrupted = (
                figures.visible_token(strings[position]) if strings else None
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

    @property
    def total(self) -> int:
        return 2 + len(self.spec["layers"]) * len(self.spec["positions"])

    @property
    def done(self) -> int:
        captures = sum(run.is_finished for run in (self.clean, self.corrupted))
        return captures + sum(run.is_finished for run in self.cells.values())

    @property
    def capture_failed(self) -> bool:
        return any(run.status == RunStatus.FAILED for run in (self.clean, self.corrupted))

    @property
    def finished(self) -> bool:
        if self.build_error:
            return True
        if self.capture_failed or (self.cancelled and not self.cells):
            return self.clean.is_finished and self.corrupted.is_finished
        return bool(self.cells) and all(run.is_finished for run in self.cells.values())

    @property
    def cancellable(self) -> bool:
        return not self.finished and not self.cancelled

    def rows(self) -> list[dict]:
        """One row per layer, each with one cell per position: its run, the target's
        logprob, the normalised effect and the cell's colour."""
        target_id = self.spec["target_id"]
        rows = []
        for layer in self.spec["layers"]:
            cells = []
            for position in self.spec["positions"]:
                run = self.cells.get((layer, position))
                logprob = target_logprob(run, target_id) if run else None
                effect = normalised_effect(logprob, self.clean_logprob, self.corrupted_logprob)
                cells.append(
                    {
                        "position": position,
                        "run": run,
                        "logprob": logprob,
                        "effect": effect,
                        "colour": effect_colour(effect),
                    }
                )
            rows.append({"layer": layer, "cells": cells})
        return rows

    def numbers(self) -> dict:
        """What the page shows, as JSON: the logprobs and effects of every cell."""
        return {
            "target": self.spec["target"],
            "target_id": self.spec["target_id"],
            "clean_ids": self.spec["clean_ids"],
            "corrupted_ids": self.spec["corrupted_ids"],
            "layers": self.spec["layers"],
            "positions": self.spec["positions"],
            "clean_logprob": self.clean_logprob,
            "corrupted_logprob": self.corrupted_logprob,
            "cells": [
                {
                    "layer": row["layer"],
                    "position": cell["position"],
                    "run": str(cell["run"].pk) if cell["run"] else None,
                    "logprob": cell["logprob"],
                    "effect": cell["effect"],
                }
                for row in self.rows()
                for cell in row["cells"]
            ],
        }


def patching_grid_for_user(*, user: User, group) -> PatchingGrid | None:
    """The user's grid `group`, or None when there is none (another user's included)."""
    runs = list(Run.objects.filter(user=user, group=group, kind__in=selectors.PATCHING_KINDS))
    captures = {run.meta["role"]: run for run in runs if run.kind == RunKind.PATCHING_CAPTURE}
    if set(captures) != {"clean", "corrupted"}:
        return None
    clean, corrupted = captures["clean"], captures["corrupted"]
    target_id = clean.meta["patching"]["target_id"]
    return PatchingGrid(
        group=clean.group,
        spec=clean.meta["patching"],
        clean=clean,
        corrupted=corrupted,
        cells={
            (run.meta["layer"], run.meta["position"]): run
            for run in runs
            if run.kind == RunKind.PATCHED
        },
        clean_logprob=target_logprob(clean, target_id),
        corrupted_logprob=target_logprob(corrupted, target_id),
        cancelled=bool(clean.meta.get("cancelled")),
    )


def latest_patching_group(*, user: User):
    """The group of the user's latest patching grid, if any."""
    return (
        Run.objects.filter(user=user, kind=RunKind.PATCHING_CAPTURE)
        .values_list("group", flat=True)
        .first()
    )
