"""A steering evaluation as its page and downloads show it (see `services` for its runs and
`metrics` for its numbers): its runs read back, per prompt and scale the scores and changes,
per scale the means with their intervals, the noise floor and the flips, and the progress;
and what the user's playground key has left for a new one."""

from dataclasses import dataclass, field
from functools import cached_property

from accounts.models import ApiKey, User
from infra.lifecycle import WorkStatus
from metering import windows
from metering.selectors import budget_windows
from playground.patching.grid import run_outcome
from playground.patching.metrics import target_scores
from playground.plots import visible_token

from ..models import Run, RunKind
from . import metrics
from .models import SteeringEvaluation

# The fields of a run that the numbers and the progress need (not the request body).
RUN_FIELDS = (
    "id", "status", "error_code", "error_message", "request_id", "meta", "response", "scale",
)  # fmt: skip


@dataclass
class Scored:
    """One succeeded run's numbers: the completion's score (nats) and the top token after
    the prompt."""

    run: str
    request_id: str
    logprob: float
    top_id: int
    top_text: str


@dataclass
class EvaluationReport:
    evaluation: SteeringEvaluation
    runs: list[Run]
    # (row, "repeat" | scale, repeat index or None, completion) → Scored
    scored: dict = field(default_factory=dict)

    def __post_init__(self):
        for run in self.runs:
            if run.status != WorkStatus.SUCCEEDED:
                continue
            meta = run.meta
            row = self.evaluation.rows[meta["row"]]
            prompt_length = len(row["prompt_ids"])
            top_id, top_text = metrics.top_token(run.response, prompt_length)
            condition = "repeat" if meta["role"] == "repeat" else run.scale
            key = (meta["row"], condition, meta.get("repeat"), meta["completion"])
            self.scored[key] = Scored(
                run=str(run.id),
                request_id=run.request_id,
                # One choice: the prompt then the completion, teacher-forced.
                logprob=target_scores(
                    run.response, prompt_length, [row[f"{meta['completion']}_ids"]]
                )[0],
                top_id=top_id,
                top_text=top_text,
            )

    @property
    def id(self):
        return self.evaluation.id

    @property
    def scales(self) -> list[float]:
        return self.evaluation.scales

    @property
    def scales_label(self) -> str:
        return ", ".join(f"{scale:g}" for scale in self.scales)

    # The numbers

    def _pair(self, row: int, condition, repeat=None) -> tuple[Scored, Scored] | None:
        target = self.scored.get((row, condition, repeat, "target"))
        foil = self.scored.get((row, condition, repeat, "foil"))
        return (target, foil) if target and foil else None

    @cached_property
    def baselines(self) -> list[dict]:
        """Per prompt: its unsteered repeats' logit differences, target logprobs and top
        tokens, their means (the unsteered values) and ranges."""
        result = []
        for index in range(len(self.evaluation.rows)):
            pairs = [self._pair(index, "repeat", r) for r in range(self.evaluation.repeats)]
            pairs = [pair for pair in pairs if pair]
            differences = [target.logprob - foil.logprob for target, foil in pairs]
            logprobs = [target.logprob for target, _ in pairs]
            result.append(
                {
                    "row": index,
                    "repeat_logit_diffs": differences,
                    "repeat_target_logprobs": logprobs,
                    "repeat_top_tokens": [target.top_text for target, _ in pairs],
                    "repeat_top_ids": [target.top_id for target, _ in pairs],
                    "logit_diff": sum(differences) / len(differences) if pairs else None,
                    "target_logprob": sum(logprobs) / len(logprobs) if pairs else None,
                    "logit_diff_range": metrics.value_range(differences),
                    "target_logprob_range": metrics.value_range(logprobs),
                    "runs": [run.run for pair in pairs for run in pair],
                }
            )
        return result

    @cached_property
    def records(self) -> list[dict]:
        """One record per prompt and scale (row order, then scale order): the texts, the
        steered scores and top token, the unsteered values, the changes and whether the top
        token flipped; None where a run has not succeeded."""
        baselines = self.baselines
        records = []
        for index, row in enumerate(self.evaluation.rows):
            unsteered = baselines[index]
            for scale in self.scales:
                pair = self._pair(index, scale)
                record = {
                    "row": index,
                    "prompt": row["prompt"],
                    "target": row["target"],
                    "foil": row["foil"],
                    "scale": scale,
                    "target_logprob": None,
                    "foil_logprob": None,
                    "logit_diff": None,
                    "unsteered_logit_diff": unsteered["logit_diff"],
                    "unsteered_target_logprob": unsteered["target_logprob"],
                    "delta_logit_diff": None,
                    "delta_target_logprob": None,
                    "top_token": None,
                    "unsteered_top_tokens": unsteered["repeat_top_tokens"],
                    "flipped": None,
                    "target_run": None,
                    "foil_run": None,
                    "request_ids": None,
                }
                if pair:
                    target, foil = pair
                    difference = target.logprob - foil.logprob
                    record.update(
                        target_logprob=target.logprob,
                        foil_logprob=foil.logprob,
                        logit_diff=difference,
                        top_token=target.top_text,
                        target_run=target.run,
                        foil_run=foil.run,
                        request_ids=[target.request_id, foil.request_id],
                    )
                    if unsteered["logit_diff"] is not None:
                        record.update(
                            delta_logit_diff=difference - unsteered["logit_diff"],
                            delta_target_logprob=target.logprob - unsteered["target_logprob"],
                            flipped=target.top_id not in unsteered["repeat_top_ids"],
                        )
                records.append(record)
        return records

    @cached_property
    def noise_floors(self) -> dict:
        baselines = self.baselines
        return {
            metric: metrics.noise_floor([entry[f"{metric}_range"] for entry in baselines])
            for metric in ("logit_diff", "target_logprob")
        }

    @cached_property
    def summary(self) -> list[dict]:
        """Per scale: the mean change of each metric with its interval and the number of
        prompts it is over, whether the mean is within the noise floor, and the share of
        prompts whose top token flipped."""
        records = self.records
        floors = self.noise_floors
        result = []
        for scale in self.scales:
            known = [r for r in records if r["scale"] == scale and r["flipped"] is not None]
            entry = {"scale": scale, "scale_label": f"{scale:g}", "prompts": len(known)}
            for metric in ("logit_diff", "target_logprob"):
                numbers = metrics.mean_with_interval([r[f"delta_{metric}"] for r in known])
                entry.update({f"{metric}_{name}": value for name, value in numbers.items()})
                entry[f"{metric}_within_floor"] = metrics.within_floor(
                    numbers["mean"], floors[metric]
                )
            flips = sum(r["flipped"] for r in known)
            entry["flipped"] = flips
            entry["flipped_share"] = flips / len(known) if known else None
            result.append(entry)
        return result

    # Progress

    def tally(self) -> dict[str, int]:
        """How many runs ran, failed, were cancelled unsent, or are pending."""
        counts = dict.fromkeys(("ran", "failed", "cancelled", "pending"), 0)
        for run in self.runs:
            counts[run_outcome(run)] += 1
        return counts

    @cached_property
    def refusals(self) -> list[dict]:
        """The API's refusals among the failed runs (not the cancelled ones), by code: the
        count and one message, so the page can say a budget or quota is spent."""
        found = {}
        for run in self.runs:
            if run_outcome(run) == "failed":
                entry = found.setdefault(
                    run.error_code, {"code": run.error_code, "count": 0,
                                     "message": run.error_message},
                )  # fmt: skip
                entry["count"] += 1
        return list(found.values())

    @property
    def budget_spent(self) -> bool:
        return any(entry["code"] in BUDGET_CODES for entry in self.refusals)

    @property
    def total(self) -> int:
        return len(self.runs)

    @property
    def done(self) -> int:
        return sum(run.is_finished for run in self.runs)

    @property
    def finished(self) -> bool:
        return self.done == self.total

    @property
    def cancelled(self) -> bool:
        return self.evaluation.cancelled_at is not None

    @property
    def cancellable(self) -> bool:
        return not self.finished and not self.cancelled

    def prompt_labels(self) -> list[str]:
        """Each prompt as the page names it: its number, the prompt's end and the target
        and foil with their whitespace shown."""
        return [
            f"{index}: …{row['prompt'][-40:]} → {visible_token(row['target'])} vs "
            f"{visible_token(row['foil'])}"
            for index, row in enumerate(self.evaluation.rows)
        ]

    @cached_property
    def export(self) -> dict:
        """Every number: the definitions, the evaluation's settings, the per-scale summary,
        the per-prompt records and the unsteered repeats (the JSON download; the page embeds
        it)."""
        evaluation = self.evaluation
        return {
            "evaluation": str(evaluation.id),
            "model": evaluation.model,
            "vector": {
                "id": evaluation.vector_id,
                "name": evaluation.vector_name,
                "layer": evaluation.vector_layer,
            },
            "scales": self.scales,
            "steer_at": evaluation.steer_at,
            "repeats": evaluation.repeats,
            "bootstrap": {
                "resamples": metrics.BOOTSTRAP_RESAMPLES,
                "seed": metrics.BOOTSTRAP_SEED,
                "confidence": metrics.CONFIDENCE,
            },
            "definitions": metrics.DEFINITIONS,
            "cost": evaluation.cost,
            # Each text with its token ids and the tokens' own strings (the gateway's tokenizer).
            "rows": [
                {
                    f"{text}{part}": row[f"{text}{part}"]
                    for text in ("prompt", "target", "foil")
                    for part in ("", "_ids", "_strings")
                }
                for row in evaluation.rows
            ],
            "noise_floor": self.noise_floors,
            "summary": self.summary,
            "unsteered": self.baselines,
            "per_prompt": self.records,
        }


BUDGET_CODES = {"budget_exceeded", "activation_quota_exceeded", "spend_cap"}


def evaluation_for_user(*, user: User, evaluation_id) -> EvaluationReport | None:
    """The user's evaluation with its runs read back; None for another user's or none."""
    evaluation = SteeringEvaluation.objects.filter(pk=evaluation_id, user=user).first()
    if evaluation is None:
        return None
    runs = list(
        Run.objects.filter(group=evaluation.id, kind=RunKind.STEERING_EVAL)
        .only(*RUN_FIELDS)
        .order_by("created_at", "id")
    )
    return EvaluationReport(evaluation=evaluation, runs=runs)


def steering_sent(evaluation: SteeringEvaluation) -> dict | None:
    """The vector as the evaluation's steered requests sent it (the codec's dict), None
    when it has none."""
    run = Run.objects.filter(group=evaluation.id, meta__role="steered").only("request").first()
    return run.body.steering.activations if run else None


def latest_evaluation_id(*, user: User):
    return SteeringEvaluation.objects.filter(user=user).values_list("id", flat=True).first()


def budget_shortfall(*, user: User, cost: dict) -> str:
    """Why the user's playground key cannot afford `cost` (`services.evaluation_cost`) in
    one of its windows, naming the window, what is left and when it resets; "" when it
    can (or has no key yet: a new key starts with its full budgets)."""
    key = ApiKey.objects.filter(user=user, is_playground=True).select_related("user").first()
    if key is None:
        return ""
    needs = {
        windows.TOKENS: cost["total_tokens"],
        windows.INPUT: cost["prompt_tokens"],
        windows.OUTPUT: cost["completion_tokens"],
        windows.ACTIVATION_REQUESTS: cost["activation_requests"],
    }
    for window in budget_windows(key=key):
        need = needs.get(windows.named(window["name"]).counter)
        if need and window["remaining"] is not None and need > window["remaining"]:
            counter = windows.named(window["name"]).counter
            unit = "activation requests" if counter is windows.ACTIVATION_REQUESTS else "tokens"
            return (
                f"Your Playground key's budget is too small for this evaluation: it needs "
                f"{need:,} {unit} and “{window['label']}” has {window['remaining']:,} left "
                f"(it resets {window['resets_at']:%Y-%m-%d %H:%M} UTC). Use fewer prompts or "
                f"scales, or raise the key's budget on the API keys page."
            )
    return ""
