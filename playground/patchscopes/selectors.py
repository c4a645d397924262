"""A Patchscope as its page shows it (see `services` for how its runs are made): its capture
and generation runs read back, one row per source layer with what the model generated, the
progress, the cost stated and billed, and the export of every number."""

from dataclasses import dataclass

from accounts.models import User
from acs_client.protocol import XARGS_CAPTURE
from infra.lifecycle import WorkStatus
from playground.patching.grid import run_outcome
from playground.plots import visible_token

from ..models import Run, RunKind
from .models import Patchscope
from .services import patchscope_cost


def _generated(run: Run | None) -> dict | None:
    """A succeeded generation's text, its tokens (ids, their own text, each token's logprob
    and its top alternatives) and finish reason, from the stored /v1 answer and the run's
    tokens; None before it has succeeded."""
    if run is None or run.status != WorkStatus.SUCCEEDED:
        return None
    choice = (run.response.get("choices") or [{}])[0]
    logprobs = choice.get("logprobs") or {}
    completion = ((run.tokens or {}).get("completions") or [None])[0] or {}
    strings = completion.get("strings") or logprobs.get("tokens") or []
    ids = completion.get("ids") or choice.get("token_ids") or [None] * len(strings)
    return {
        "text": choice.get("text", ""),
        "tokens": strings,
        "token_ids": ids,
        "logprobs": logprobs.get("token_logprobs") or [],
        "top_logprobs": logprobs.get("top_logprobs") or [],
        "finish_reason": choice.get("finish_reason"),
    }


@dataclass
class PatchscopeView:
    patchscope: Patchscope
    capture: Run | None
    generations: dict  # source layer -> Run

    @property
    def id(self):
        return self.patchscope.id

    @property
    def source_label(self) -> str:
        """The source position as "index token" (whitespace made visible)."""
        scope = self.patchscope
        token = f" {visible_token(scope.source_token)}" if scope.source_token else ""
        return f"{scope.source_position}{token}"

    @property
    def inspection_label(self) -> str:
        scope = self.patchscope
        strings = scope.inspection_strings or []
        position = scope.inspection_position
        token = f" {visible_token(strings[position])}" if position < len(strings) else ""
        return f"{position}{token}"

    @property
    def inspection_tokens(self) -> list[str]:
        return [visible_token(string) for string in self.patchscope.inspection_strings or []]

    def rows(self) -> list[dict]:
        """One row per source layer: the layers, its run and outcome, and what it generated
        (`_generated`), its tokens also as shown (whitespace made visible)."""
        rows = []
        for layer in self.patchscope.source_layers:
            run = self.generations.get(layer)
            generated = _generated(run)
            rows.append(
                {
                    "source_layer": layer,
                    "target_layer": self.patchscope.target_layer_of(layer),
                    "run": run,
                    "outcome": run_outcome(run) if run else "pending",
                    "generated": generated,
                    "shown_tokens": [visible_token(token) for token in generated["tokens"]]
                    if generated
                    else None,
                }
            )
        return rows

    # Cost and progress

    @property
    def cost(self) -> dict:
        scope = self.patchscope
        return patchscope_cost(
            prompt_tokens=len(scope.inspection_ids),
            source_layers=len(scope.source_layers),
            max_tokens=scope.max_tokens,
        )

    @property
    def _runs(self) -> list[Run]:
        return [run for run in (self.capture, *self.generations.values()) if run is not None]

    @property
    def billed_tokens(self) -> int:
        """The tokens the API reported for the runs that succeeded (its usage)."""
        return sum((run.usage or {}).get("total_tokens", 0) for run in self._runs)

    @property
    def total(self) -> int:
        return 1 + len(self.patchscope.source_layers)

    @property
    def done(self) -> int:
        return sum(run.is_finished for run in self._runs)

    def tally(self) -> dict[str, int]:
        outcomes = [run_outcome(run) for run in self._runs]
        return {
            outcome: outcomes.count(outcome)
            for outcome in ("ran", "failed", "cancelled", "pending")
        }

    @property
    def cancelled_summary(self) -> str:
        """What a cancelled Patchscope ran and what it never sent."""
        tally = self.tally()
        text = f"Ran: {tally['ran']} of {self.total} requests."
        if tally["failed"]:
            text += f" Failed: {tally['failed']}."
        never = tally["cancelled"] + self.total - len(self._runs)
        if never:
            text += f" Never sent (never billed): {never}."
        if tally["pending"]:
            text += f" Still finishing: {tally['pending']} already sent."
        return text

    @property
    def capture_failed(self) -> bool:
        return self.capture is not None and self.capture.status == WorkStatus.FAILED

    @property
    def finished(self) -> bool:
        if self.patchscope.build_error or self.capture_failed:
            return True
        if self.patchscope.cancelled and not self.generations:
            return self.capture is None or self.capture.is_finished
        runs = self.generations.values()
        return bool(self.generations) and all(run.is_finished for run in runs)

    @property
    def cancellable(self) -> bool:
        return not self.finished and not self.patchscope.cancelled

    # What the page embeds and the downloads hold

    def records(self) -> list[dict]:
        """One record per source layer, the tokens' own text (not the page's visible
        whitespace), joined with " | " in the CSV."""
        records = []
        for row in self.rows():
            generated, run = row["generated"] or {}, row["run"]
            records.append(
                {
                    "source_layer": row["source_layer"],
                    "target_layer": row["target_layer"],
                    "run": str(run.pk) if run else None,
                    "request_id": run.request_id if run else None,
                    "status": row["outcome"],
                    "text": generated.get("text"),
                    "tokens": generated.get("tokens"),
                    "token_ids": generated.get("token_ids"),
                    "token_logprobs": generated.get("logprobs"),
                    "top_logprobs": generated.get("top_logprobs"),
                }
            )
        return records

    def export(self) -> dict:
        scope = self.patchscope
        return {
            "patchscope": str(scope.id),
            "model": scope.model,
            "source_run": str(scope.source_run_id) if scope.source_run_id else None,
            "source_position": scope.source_position,
            "source_token": scope.source_token,
            "source_layers": scope.source_layers,
            "source_states": scope.source_states,
            "inspection_prompt": scope.inspection_prompt,
            "inspection_ids": scope.inspection_ids,
            "inspection_tokens": scope.inspection_strings,
            "inspection_position": scope.inspection_position,
            "target_layer": "same as the source layer"
            if scope.target_layer is None
            else scope.target_layer,
            "max_tokens": scope.max_tokens,
            "greedy": True,
            "cost": self.cost,
            "billed_tokens": self.billed_tokens,
            "capture": {
                "run": str(self.capture.pk) if self.capture else None,
                "request_id": self.capture.request_id if self.capture else None,
                "status": run_outcome(self.capture) if self.capture else None,
            },
            "injection": (
                "steering at the target layer and the inspection position alone with source "
                "state − the inspection prompt's own state there (scale 1, no norm_match), "
                "sent as bfloat16: the block's output there becomes the source state up to "
                "that rounding"
            ),
            "rows": self.records(),
        }


def patchscope_for_user(*, user: User, patchscope_id) -> PatchscopeView | None:
    """The user's Patchscope with its runs, or None (another user's included)."""
    patchscope = Patchscope.objects.filter(pk=patchscope_id, user=user).first()
    if patchscope is None:
        return None
    runs = Run.objects.filter(group=patchscope.id, user=user).order_by("created_at", "id")
    capture = next((run for run in runs if run.kind == RunKind.PATCHSCOPE_CAPTURE), None)
    generations = {run.meta["source_layer"]: run for run in runs if run.kind == RunKind.PATCHSCOPE}
    return PatchscopeView(patchscope=patchscope, capture=capture, generations=generations)


def latest_patchscope_id(*, user: User):
    return Patchscope.objects.filter(user=user).values_list("pk", flat=True).first()


def capture_runs(*, user: User, limit: int = 50):
    """The user's latest succeeded runs with a residual-stream capture (a Patchscope's
    sources), without their responses."""
    return (
        Run.objects.filter(user=user, status=WorkStatus.SUCCEEDED, request__has_key=XARGS_CAPTURE)
        .exclude(kind=RunKind.PATCHSCOPE_CAPTURE)
        .defer("response")[:limit]
    )
