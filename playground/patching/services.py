"""Activation patching (causal tracing): which layer and position of a clean prompt carry what
makes the model predict a target, measured by patching them one at a time into a corrupted
prompt of the same token length.

A grid is one group of runs through the workers, sent with the user's playground key like
every run (so budgets apply and each cell is a run with its own page):

1. two capture runs (`RunKind.PATCHING_CAPTURE`): the clean and the corrupted prompt, each
   followed by the target's tokens (token ids, teacher-forced), capturing the residual
   stream at the chosen layers;
2. once both have succeeded (`patched_runs_create`), the scoring runs (`RunKind.PATCHED`),
   each sending the prompt followed by each target (the target, and the corrupted target for
   the logit difference) with `prompt_logprobs: 0` (see `patching_metrics`):
   - the clean prompt, unpatched: the clean baseline;
   - `PATCHING_REPEATS` copies of the corrupted prompt, unpatched, spread among the cells: the
     corrupted baseline (their mean) and the noise floor (their range);
   - one cell per layer × position: the corrupted prompt steered at that layer and position
     alone with clean row − corrupted row (scale 1, no norm_match). Capture layer L and
     steering at layer L are both the output of decoder block L, so the patched block's
     output there is the clean one (up to bfloat16 rounding of the sent vector), and
     everything after it follows.

The normalised effect of a cell is (patched − corrupted) / (clean − corrupted) of the chosen
metric: 1 where patching that one layer and position restores the clean value, 0 where it
changes nothing.
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
from acs_client.protocol import XARGS_CAPTURE, XARGS_STEERING
from api.tokenizer import PromptTokens
from infra.lifecycle import WorkStatus
from playground.captures import activations
from playground.models import Run, RunKind
from playground.runs.services import group_runs_cancel, run_create, submitted_once

logger = logging.getLogger(__name__)

# Unpatched corrupted requests sent among a grid's cells, for its baseline and noise floor.
PATCHING_REPEATS = 3
# A capture's worker queues the patched runs as soon as the second capture succeeds; a grid
# whose captures both succeeded this long ago with no patched run lost that worker.
STALLED_AFTER = dt.timedelta(seconds=60)
BUILD_FAILED_MESSAGE = (
    "The patched runs could not be built from the two captures, so the grid stopped; "
    "submit it again."
)


@dataclass(frozen=True)
class PatchingTarget:
    """A target continuation: its text as entered and its tokens (no special tokens)."""

    text: str
    tokens: PromptTokens


def spec_targets(spec: dict) -> list[list[int]]:
    """The token ids of the grid's targets: the target, then the corrupted target when the
    grid has one (grids made before targets of several tokens stored `target_id`)."""
    targets = [spec.get("target_ids") or [spec["target_id"]]]
    if spec.get("corrupted_target_ids"):
        targets.append(spec["corrupted_target_ids"])
    return targets


# ---------------------------------------------------------------------------------------
# Writes


def _capture_request(*, model: str, prompt_ids: list[int], target_ids: list[int], layers) -> dict:
    return {
        "model": model,
        "prompt": [*prompt_ids, *target_ids],
        "max_tokens": 1,
        "temperature": 0,
        "prompt_logprobs": 0,
        XARGS_CAPTURE: list(layers),
    }


def _score_request(*, model: str, prompt_ids: list[int], targets: list[list[int]]) -> dict:
    """The prompt followed by each target, as token ids, scored (see `patching_metrics`)."""
    return {
        "model": model,
        "prompt": [[*prompt_ids, *target] for target in targets],
        "max_tokens": 1,
        "temperature": 0,
        "prompt_logprobs": 0,
    }


def _prompt_text(prompt: str, targets: list[str]) -> str:
    """What a run's token-id prompts were made from, as the history lists prompts."""
    return " | ".join(prompt + target for target in targets)


def patching_grid_create(
    *,
    user: User,
    model: str,
    clean_prompt: str,
    corrupted_prompt: str,
    clean: PromptTokens,
    corrupted: PromptTokens,
    target: PatchingTarget,
    corrupted_target: PatchingTarget | None,
    metric: str,
    layers: list[int],
    positions: list[int],
    submit_token: uuid.UUID | None = None,
) -> uuid.UUID:
    """Queue the clean and corrupted captures of a patching grid; its scoring runs follow
    when both have succeeded (`patched_runs_create`). `metric` (see METRICS) is the one the
    grid shows first; the logit difference needs `corrupted_target`. Returns the grid's
    group id (that of the first grid, when `submit_token` was submitted before)."""
    spec = {
        "clean_prompt": clean_prompt,
        "corrupted_prompt": corrupted_prompt,
        "clean_ids": clean.ids,
        "clean_strings": clean.strings,
        "corrupted_ids": corrupted.ids,
        "corrupted_strings": corrupted.strings,
        "target": target.text,
        "target_ids": target.tokens.ids,
        "target_strings": target.tokens.strings,
        "corrupted_target": corrupted_target.text if corrupted_target else "",
        "corrupted_target_ids": corrupted_target.tokens.ids if corrupted_target else [],
        "corrupted_target_strings": corrupted_target.tokens.strings if corrupted_target else [],
        "metric": metric,
        "layers": layers,
        "positions": positions,
        "repeats": PATCHING_REPEATS,
    }

    def create() -> uuid.UUID:
        group = uuid.uuid4()
        with transaction.atomic():
            for role, prompt, tokens in (
                ("clean", clean_prompt, clean),
                ("corrupted", corrupted_prompt, corrupted),
            ):
                run_create(
                    user=user,
                    kind=RunKind.PATCHING_CAPTURE,
                    group=group,
                    request=_capture_request(
                        model=model,
                        prompt_ids=tokens.ids,
                        target_ids=target.tokens.ids,
                        layers=layers,
                    ),
                    meta={
                        "role": role,
                        "patching": spec,
                        "prompt_text": _prompt_text(prompt, [target.text]),
                    },
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
    return {run.meta["role"]: run for run in runs.order_by("created_at")}


def queue_order(cells: list, repeats: int) -> list[tuple[str, object]]:
    """The cells with the repeats spread evenly among them, the first repeat before every
    cell and the last after them, so that they share the cells' batches: ("cell", cell) and
    ("repeat", index) in the order the runs are sent."""
    slots = [round(index * len(cells) / max(repeats - 1, 1)) for index in range(repeats)]
    order = []
    for position in range(len(cells) + 1):
        order += [("repeat", index) for index, slot in enumerate(slots) if slot == position]
        if position < len(cells):
            order.append(("cell", cells[position]))
    return order


def patched_runs_create(*, group) -> int:
    """Queue the scoring runs (the clean baseline, the repeats and one run per layer ×
    position) once both captures of the grid have succeeded; idempotent (both captures'
    workers call it), and nothing for a cancelled grid. Returns how many runs it queued."""
    with transaction.atomic():
        captures = _captures_locked(group)
        clean, corrupted = captures.get("clean"), captures.get("corrupted")
        if clean is None or corrupted is None or clean.meta.get("cancelled"):
            return 0
        if clean.status != WorkStatus.SUCCEEDED or corrupted.status != WorkStatus.SUCCEEDED:
            return 0
        if Run.objects.filter(group=group, kind=RunKind.PATCHED).exists():
            return 0
        spec = clean.meta["patching"]
        model = corrupted.body.model
        targets = spec_targets(spec)
        target_texts = [spec["target"], spec["corrupted_target"]][: len(targets)]
        clean_rows = activations(clean.body, clean.response).tensor
        corrupted_rows = activations(corrupted.body, corrupted.response).tensor
        unpatched = _score_request(model=model, prompt_ids=spec["corrupted_ids"], targets=targets)
        corrupted_text = _prompt_text(spec["corrupted_prompt"], target_texts)

        def create(request: dict, meta: dict, prompt_text: str = corrupted_text) -> None:
            run_create(
                user=clean.user,
                kind=RunKind.PATCHED,
                group=group,
                request=request,
                meta={**meta, "prompt_text": prompt_text},
            )

        create(
            _score_request(model=model, prompt_ids=spec["clean_ids"], targets=targets),
            {"role": "clean"},
            _prompt_text(spec["clean_prompt"], target_texts),
        )
        cells = [(layer, position) for layer in spec["layers"] for position in spec["positions"]]
        for what, item in queue_order(cells, PATCHING_REPEATS):
            if what == "repeat":
                create(dict(unpatched), {"role": "repeat", "repeat": item})
                continue
            layer, position = item
            row = spec["layers"].index(layer)
            difference = clean_rows[row, position] - corrupted_rows[row, position]
            request = dict(unpatched)
            request[XARGS_STEERING] = [
                {
                    "activations": encode_vector(difference[None, :].astype(np.float32)),
                    "layer_indices": [layer],
                    "position_indices": [position],
                    "scale": 1.0,
                    "norm_match": False,
                }
            ]
            create(request, {"role": "cell", "layer": layer, "position": position})
    return 1 + PATCHING_REPEATS + len(cells)


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
            status=WorkStatus.SUCCEEDED,
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
    """Cancel a grid: its runs not yet taken by a worker are cancelled (never sent, so never
    billed), and no patched runs are created afterwards. Runs already being sent
    finish. Returns how many runs were cancelled."""
    now = timezone.now()
    with transaction.atomic():
        clean = _captures_locked(group).get("clean")
        if clean is None or clean.user_id != user.pk:
            return 0
        Run.objects.filter(pk=clean.pk).update(meta={**clean.meta, "cancelled": True})
        return group_runs_cancel(group=group, now=now)
