"""Patchscopes: a hidden state of a capture run read out by the model itself.

One Patchscope is one group of runs through the workers, sent with the user's playground key
like every run (so budgets, quotas and admission apply):

1. one capture run (`RunKind.PATCHSCOPE_CAPTURE`): the inspection prompt, as token ids,
   capturing its own residual stream at the target layer(s);
2. once it has succeeded (`patchscope_runs_create`), one generation run per source layer
   (`RunKind.PATCHSCOPE`): the inspection prompt continued greedily, steered at the target
   layer and the inspection position alone with source state − the inspection prompt's own
   state there (scale 1, no norm_match). Capture layer L and steering at layer L are both the
   output of decoder block L, so that block's output at that position becomes the source
   state (up to the bfloat16 rounding of the sent vector), and the rest of the forward pass,
   and every generated token, follows from it.

Generation ignores the end-of-text token (`ignore_eos`): every generation produces exactly
`max_tokens` tokens, so the cost stated before submitting is the cost billed.
"""

import datetime as dt
import logging
import uuid

import numpy as np
from django.db import transaction
from django.db.models import Exists, OuterRef
from django.utils import timezone

from accounts.models import User
from acs_client.codec import decode, encode_vector
from acs_client.protocol import XARGS_CAPTURE, XARGS_STEERING
from api.tokenizer import PromptTokens
from infra.lifecycle import WorkStatus
from playground import captures
from playground.runs.services import group_runs_cancel, run_create, submitted_once

from ..models import Run, RunKind
from .models import Patchscope

logger = logging.getLogger(__name__)

# The generated tokens' top alternatives each generation asks for: the table shows how sure
# the model was, and a comparison with another computation tells a near tie from a defect.
TOP_LOGPROBS = 5
# The capture's worker queues the generations as soon as it succeeds; a Patchscope whose
# capture succeeded this long ago with no generation lost that worker.
STALLED_AFTER = dt.timedelta(seconds=60)
BUILD_FAILED_MESSAGE = (
    "The generations could not be built from the inspection prompt's capture, so the "
    "Patchscope stopped; submit it again."
)


def patchscope_cost(*, prompt_tokens: int, source_layers: int, max_tokens: int) -> dict:
    """What a Patchscope bills, as the gateway counts it: the capture (the prompt and its one
    generated token) and per source layer the prompt and `max_tokens` generated tokens (the
    end-of-text token does not stop them); each request is also an activation request."""
    capture = prompt_tokens + 1
    generations = source_layers * (prompt_tokens + max_tokens)
    return {
        "requests": 1 + source_layers,
        "prompt_tokens": prompt_tokens * (1 + source_layers),
        "completion_tokens": 1 + source_layers * max_tokens,
        "tokens": capture + generations,
    }


def _capture_request(patchscope: Patchscope) -> dict:
    return {
        "model": patchscope.model,
        "prompt": patchscope.inspection_ids,
        "max_tokens": 1,
        "temperature": 0,
        XARGS_CAPTURE: patchscope.target_layers,
    }


def _generation_request(patchscope: Patchscope, *, target_layer: int, vector) -> dict:
    return {
        "model": patchscope.model,
        "prompt": patchscope.inspection_ids,
        "max_tokens": patchscope.max_tokens,
        "temperature": 0,
        "logprobs": TOP_LOGPROBS,
        "ignore_eos": True,
        XARGS_STEERING: [
            {
                "activations": encode_vector(vector[None, :].astype(np.float32)),
                "layer_indices": [target_layer],
                "position_indices": [patchscope.inspection_position],
                "scale": 1.0,
                "norm_match": False,
            }
        ],
    }


def patchscope_create(
    *,
    user: User,
    source_run: Run,
    source_position: int,
    source_token: str,
    source_layers: list[int],
    source_states: np.ndarray,
    inspection_prompt: str,
    inspection: PromptTokens,
    inspection_position: int,
    target_layer: int | None,
    max_tokens: int,
    submit_token: uuid.UUID | None = None,
) -> uuid.UUID:
    """Store a Patchscope and queue the capture of its inspection prompt; its generations
    follow when the capture has succeeded (`patchscope_runs_create`). `source_states`: the
    source run's residual stream at `source_position`, `[len(source_layers), hidden]`.
    Returns its id (that of the first Patchscope, when `submit_token` was submitted
    before)."""

    def create() -> uuid.UUID:
        with transaction.atomic():
            patchscope = Patchscope.objects.create(
                user=user,
                source_run=source_run,
                model=source_run.body.model,
                source_position=source_position,
                source_token=source_token,
                source_layers=source_layers,
                source_states=encode_vector(source_states.astype(np.float32)),
                inspection_prompt=inspection_prompt,
                inspection_ids=inspection.ids,
                inspection_strings=inspection.strings,
                inspection_position=inspection_position,
                target_layer=target_layer,
                max_tokens=max_tokens,
            )
            run_create(
                user=user,
                kind=RunKind.PATCHSCOPE_CAPTURE,
                group=patchscope.id,
                request=_capture_request(patchscope),
                meta={"role": "capture", "prompt_text": inspection_prompt},
                submit_token=submit_token,
            )
        return patchscope.id

    return submitted_once(
        user=user, submit_token=submit_token, create=create, existing=lambda run: run.group
    )


def patchscope_runs_create(*, patchscope_id) -> int:
    """Queue one generation per source layer once the capture has succeeded; idempotent,
    and nothing for a cancelled Patchscope. Returns how many runs it queued."""
    with transaction.atomic():
        # Locked: creating the generations and cancelling happen one after the other.
        patchscope = Patchscope.objects.select_for_update().filter(pk=patchscope_id).first()
        if patchscope is None or patchscope.cancelled or patchscope.build_error:
            return 0
        runs = Run.objects.filter(group=patchscope.id)
        capture = runs.filter(kind=RunKind.PATCHSCOPE_CAPTURE).first()
        if capture is None or capture.status != WorkStatus.SUCCEEDED:
            return 0
        if runs.filter(kind=RunKind.PATCHSCOPE).exists():
            return 0
        own = captures.activations(capture.body, capture.response).tensor
        targets = patchscope.target_layers
        sources = decode(patchscope.source_states)
        position = patchscope.inspection_position
        for row, source_layer in enumerate(patchscope.source_layers):
            target_layer = patchscope.target_layer_of(source_layer)
            vector = sources[row] - own[targets.index(target_layer), position]
            run_create(
                user=patchscope.user,
                kind=RunKind.PATCHSCOPE,
                group=patchscope.id,
                request=_generation_request(patchscope, target_layer=target_layer, vector=vector),
                meta={
                    "role": "generation",
                    "source_layer": source_layer,
                    "target_layer": target_layer,
                    "prompt_text": patchscope.inspection_prompt,
                },
            )
    return len(patchscope.source_layers)


def patchscope_runs_create_or_fail(*, patchscope_id) -> int:
    """`patchscope_runs_create`, except that a Patchscope whose generations cannot be built
    (a capture answer without the rows asked for, say) is marked stopped, so that its page
    stops following it, instead of raising. Returns how many runs it queued."""
    try:
        return patchscope_runs_create(patchscope_id=patchscope_id)
    except Exception:
        logger.exception("patchscope %s: generations not built", patchscope_id)
        Patchscope.objects.filter(pk=patchscope_id).update(build_error=BUILD_FAILED_MESSAGE)
        return 0


def patchscopes_resume_stalled(*, now=None) -> int:
    """Queue the generations of Patchscopes whose capture succeeded over `STALLED_AFTER` ago
    with none queued (their worker stopped in between), or mark them stopped where they
    cannot be built. Run by the runs sweep. Returns how many runs it queued."""
    cutoff = (now or timezone.now()) - STALLED_AFTER
    captured = Run.objects.filter(
        group=OuterRef("pk"),
        kind=RunKind.PATCHSCOPE_CAPTURE,
        status=WorkStatus.SUCCEEDED,
        finished_at__lt=cutoff,
    )
    generated = Run.objects.filter(group=OuterRef("pk"), kind=RunKind.PATCHSCOPE)
    stalled = Patchscope.objects.filter(
        Exists(captured), ~Exists(generated), cancelled=False, build_error=""
    )
    return sum(
        patchscope_runs_create_or_fail(patchscope_id=pk)
        for pk in stalled.values_list("pk", flat=True)
    )


def patchscope_cancel(*, user: User, patchscope_id) -> int:
    """Cancel a Patchscope: its runs not yet taken by a worker are cancelled (never sent,
    so never billed), and no generation is created afterwards. Runs already being sent
    finish. Returns how many runs were cancelled."""
    with transaction.atomic():
        patchscope = (
            Patchscope.objects.select_for_update().filter(pk=patchscope_id, user=user).first()
        )
        if patchscope is None:
            return 0
        Patchscope.objects.filter(pk=patchscope.pk).update(cancelled=True)
        return group_runs_cancel(group=patchscope.id, now=timezone.now())
