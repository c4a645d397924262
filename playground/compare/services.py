"""Two runs of one user compared: side by side text with a token-level diff, the logprob
difference of the same tokens under the two runs' request settings (teacher-forced, see
`scoring`), and the norm of the activation difference where both runs captured a layer.

Each run is read as one token sequence: its first prompt's tokens then its first choice's
generated tokens (`Run.tokens`). The diff matches the two sequences by token id (difflib's
matching blocks); a token is highlighted when it is in no block both sequences share.

Teacher forcing: a request under run X's settings (its model and its steering, as
`scoring.teacher_forced_request` builds it) with both sequences as its prompts and
`prompt_logprobs: 0` gives, at every position p ≥ 1 of each sequence, log p_X(token p | the
tokens before it). Δ logprob = log p under B's settings − log p under A's settings, in nats,
on the same tokens: negative where B's settings make the token less likely.

The activation difference at layer L and position p is ‖h_A[L, p] − h_B[L, p]‖ (L2 norm of
the residual-stream outputs of block L): positions are aligned by index, up to the shorter of
the two captures, whether or not the tokens there are the same.
"""

import difflib
import logging
from dataclasses import dataclass

import numpy as np
import plotly.graph_objects as go
from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from accounts.models import User
from accounts.services.playground_key import worker_secret
from acs_client.client import AcsClient
from infra.lifecycle import WorkStatus, work_claim
from infra.tasks import task_send_on_commit
from playground import captures, exports, plots, scoring
from playground.models import Run, RunComparison
from playground.steering.services import (
    ScoreUnavailable,
    run_token_ids,
    scoring_fail_unsent,
    scoring_outcome,
    scorings_fail_stuck,
)

logger = logging.getLogger(__name__)

COMPARISON_TASK = "playground.tasks.run_comparison_execute_task"
SIDES = ("a", "b")


# ---------------------------------------------------------------------------------------
# The two token sequences and their diff


@dataclass
class TokenSequence:
    """A run's first prompt then its first choice's generated tokens; an id is None where
    several tokens decode to the same string (see `run_tokens`)."""

    ids: list[int | None]
    strings: list[str]
    prompt_length: int


def run_sequence(run: Run) -> TokenSequence | None:
    """The run's token sequence, or None when its tokens are unknown (a run that failed, or
    whose tokenizer could not be reached)."""
    tokens = run.tokens or {}
    prompt = (tokens.get("prompts") or [None])[0]
    if run.status != WorkStatus.SUCCEEDED or not prompt:
        return None
    completion = (tokens.get("completions") or [None])[0] or {"ids": [], "strings": []}
    return TokenSequence(
        ids=list(prompt["ids"]) + list(completion["ids"]),
        strings=list(prompt["strings"]) + list(completion["strings"]),
        prompt_length=len(prompt["ids"]),
    )


def _diff_keys(sequence: TokenSequence) -> list:
    return [
        ("id", token_id) if token_id is not None else ("text", string)
        for token_id, string in zip(sequence.ids, sequence.strings, strict=True)
    ]


def token_diff(a: TokenSequence, b: TokenSequence) -> dict[str, list[dict]]:
    """Each side's tokens (`position`, `text`, `part`, `changed`): `changed` when the token is
    in no matching block of the two sequences (by token id)."""
    matcher = difflib.SequenceMatcher(None, _diff_keys(a), _diff_keys(b), autojunk=False)
    shared = {"a": set(), "b": set()}
    for block in matcher.get_matching_blocks():
        shared["a"].update(range(block.a, block.a + block.size))
        shared["b"].update(range(block.b, block.b + block.size))
    return {
        side: [
            {
                "position": position,
                "text": string,
                "part": "prompt" if position < sequence.prompt_length else "generated",
                "starts_completion": position == sequence.prompt_length > 0,
                "changed": position not in shared[side],
            }
            for position, string in enumerate(sequence.strings)
        ]
        for side, sequence in (("a", a), ("b", b))
    }


# ---------------------------------------------------------------------------------------
# Scoring on the same tokens (teacher-forced requests through /v1, billed like runs)


def scoring_unavailable_reason(run_a: Run, run_b: Run) -> str:
    """Why the two runs cannot be scored on each other's tokens ("" when they can)."""
    for side, run in (("A", run_a), ("B", run_b)):
        if run_sequence(run) is None:
            return f"Run {side} has no known tokens (it failed, or its tokenizer was unreachable)."
    if run_a.request_model != run_b.request_model:
        return (
            f"The runs used different models ({run_a.request_model}, {run_b.request_model}): "
            "one model's tokens mean nothing to the other."
        )
    return ""


def comparison_for_runs(*, run_a: Run, run_b: Run) -> RunComparison | None:
    return RunComparison.objects.filter(run_a=run_a, run_b=run_b).first()


def comparison_queue(*, user: User, run_a: Run, run_b: Run) -> RunComparison:
    """Queue the same-token scoring of two of the user's runs; asked again, the existing one
    (queued again if it failed). The (run_a, run_b) pair is unique, so a double click queues
    it once."""
    comparison = comparison_for_runs(run_a=run_a, run_b=run_b)
    if comparison is None:
        try:
            with transaction.atomic():
                comparison = RunComparison.objects.create(user=user, run_a=run_a, run_b=run_b)
                _comparison_send_on_commit(comparison)
        except IntegrityError:
            comparison = comparison_for_runs(run_a=run_a, run_b=run_b)
        return comparison
    with transaction.atomic():
        requeued = RunComparison.objects.filter(pk=comparison.pk, status=WorkStatus.FAILED).update(
            status=WorkStatus.QUEUED, error_code="", error_message="", finished_at=None
        )
        if requeued:
            _comparison_send_on_commit(comparison)
    comparison.refresh_from_db()
    return comparison


def _comparison_send_on_commit(comparison: RunComparison) -> None:
    task_send_on_commit(
        COMPARISON_TASK,
        str(comparison.pk),
        unsent=lambda error: scoring_fail_unsent(scoring=comparison, error=error),
    )


def comparison_execute(*, comparison_id) -> RunComparison | None:
    """Claim a queued comparison, send its two teacher-forced requests (both sequences under
    A's settings, then under B's) with the user's playground key, and keep the ids sent and
    the raw answers; an error fails it with a message a person can read. None if it could
    not be claimed."""
    attempt = work_claim(RunComparison, pk=comparison_id, now=timezone.now())
    if attempt is None:
        return None
    comparison = RunComparison.objects.select_related("user", "run_a", "run_b").get(
        pk=comparison_id
    )
    client = AcsClient(base_url=settings.GATEWAY_URL, api_key=worker_secret(comparison.user))
    fields = scoring_outcome(
        lambda: _compare(client, comparison.run_a, comparison.run_b),
        what=f"run comparison {comparison.pk}",
    )
    attempt.write(**fields)  # nothing once the sweep failed it
    comparison.refresh_from_db()
    return comparison


def _compare(client: AcsClient, run_a: Run, run_b: Run) -> dict:
    reason = scoring_unavailable_reason(run_a, run_b)
    if reason:
        raise ScoreUnavailable(reason)
    requests = []

    def send(purpose: str, body: dict) -> dict:
        completion = client.completions(body)
        requests.append({"purpose": purpose, "request_id": completion.request_id})
        return completion.body

    sequences = {}
    for side, run in (("a", run_a), ("b", run_b)):
        prompt_ids, completion_ids, _ = run_token_ids(run, send)
        sequences[side] = {"ids": prompt_ids + completion_ids, "prompt_length": len(prompt_ids)}
    answers = {}
    for side, run in (("a", run_a), ("b", run_b)):
        body = scoring.teacher_forced_request(
            run.request, sequences["a"]["ids"], full_vocabulary=False, steered=True
        )
        body["prompt"] = [sequences["a"]["ids"], sequences["b"]["ids"]]
        answers[side] = send(f"both runs' tokens under run {side.upper()}'s settings", body)
    return {**sequences, "answers": answers, "requests": requests}


def comparisons_fail_stuck(*, now=None) -> int:
    """Fail comparisons whose worker died (see `scorings_fail_stuck`)."""
    return scorings_fail_stuck(
        RunComparison, message="The scoring did not finish; score again.", now=now
    )


def logprob_differences(results: dict) -> dict[str, dict]:
    """Per side (the tokens of run A, of run B): the positions scored (1.. the last; the
    first token has no context), each token's logprob under A's and B's settings and
    Δ = under B − under A, in nats."""
    differences = {}
    for index, side in enumerate(SIDES):
        ids = results[side]["ids"]
        under = {
            settings_of: scoring.scored_logprobs(
                results["answers"][settings_of]["choices"][index]["prompt_logprobs"], ids[1:], 1
            )
            for settings_of in SIDES
        }
        differences[side] = {
            "positions": list(range(1, len(ids))),
            "under_a": under["a"].tolist(),
            "under_b": under["b"].tolist(),
            "delta": scoring.delta_logprobs(under["b"], under["a"]).tolist(),
        }
    return differences


# ---------------------------------------------------------------------------------------
# The activation difference


def _captured(run: Run) -> bool:
    return run.status == WorkStatus.SUCCEEDED and bool(
        ((run.response or {}).get("activations") or {}).get("residual_stream")
    )


def activation_difference(run_a: Run, run_b: Run) -> tuple[dict | None, str]:
    """‖h_A − h_B‖ per shared layer × aligned position (see the module's docstring), with the
    layers, the positions' labels and each capture's length; or None and the reason."""
    missing = [side for side, run in (("A", run_a), ("B", run_b)) if not _captured(run)]
    if missing:
        return None, (
            f"Run {' and run '.join(missing)} captured no activations, so there is no "
            "activation difference to show."
        )
    a, b = (captures.activations(run.request, run.response, run.tokens) for run in (run_a, run_b))
    layers = sorted(set(a.layers) & set(b.layers))
    if not layers:
        return None, (
            f"The runs captured no layer in common (A: {', '.join(map(str, a.layers))}; "
            f"B: {', '.join(map(str, b.layers))})."
        )
    count = min(a.tensor.shape[1], b.tensor.shape[1])
    rows_a = a.tensor[[a.layers.index(layer) for layer in layers], :count]
    rows_b = b.tensor[[b.layers.index(layer) for layer in layers], :count]
    labels, texts = [], []
    for position in range(count):
        token_a, token_b = a.rows[position].token, b.rows[position].token
        if token_a == token_b:
            labels.append(a.rows[position].label)
            texts.append(a.rows[position].text_label)
        else:
            shown = [plots.visible_token(t) if t is not None else "?" for t in (token_a, token_b)]
            labels.append(f"{position} {shown[0]}/{shown[1]}")
            own = ["?" if t is None else t for t in (token_a, token_b)]
            texts.append(f"{position} {own[0]}/{own[1]}")
    return {
        "layers": layers,
        "norms": np.linalg.norm(rows_a - rows_b, axis=-1),
        "labels": labels,
        # The labels with the tokens' own text, for the figure's downloads.
        "texts": texts,
        "lengths": (a.tensor.shape[1], b.tensor.shape[1]),
    }, ""


# ---------------------------------------------------------------------------------------
# Figures


DELTA_AXIS = "Δ logprob, B's settings − A's (nats)"


def logprob_difference_figure(side: str, sequence: TokenSequence, difference: dict) -> go.Figure:
    """Bars of Δ logprob at each scored position of one run's tokens, ticks naming the
    tokens, a dashed line where the prompt ends."""
    positions = difference["positions"]
    labels = [plots.token_label(sequence.strings[p]) for p in positions]
    scores = [
        [sequence.strings[p], under_a, under_b]
        for p, under_a, under_b in zip(
            positions, difference["under_a"], difference["under_b"], strict=True
        )
    ]
    figure = go.Figure(
        go.Bar(
            x=positions,
            y=difference["delta"],
            marker_color="#1f5fbf" if side == "a" else "#e08214",
            customdata=[[label, *rest] for label, (_, *rest) in zip(labels, scores, strict=True)],
            # The downloads hold the tokens' own text (static/js/exports.js).
            meta={"customdata": scores},
            hovertemplate=(
                "position %{x} %{customdata[0]}: log p under A %{customdata[1]:.3f}, "
                "under B %{customdata[2]:.3f}, Δ %{y:.3f} nats<extra></extra>"
            ),
        )
    )
    step = max(1, -(-len(positions) // 40))
    figure.update_xaxes(
        title="position (token)",
        tickmode="array",
        tickvals=positions[::step],
        ticktext=[f"{p} {label}" for p, label in zip(positions, labels, strict=True)][::step],
        tickangle=-45,
    )
    plots.export_labels(figure, "x", {p: f"{p} {sequence.strings[p]}" for p in positions})
    plots.download_meta(figure, customdata=["token", "log p under A", "log p under B"])
    if 1 < sequence.prompt_length < len(sequence.ids):
        figure.add_vline(
            x=sequence.prompt_length - 0.5, line={"color": "#444444", "width": 1, "dash": "dash"}
        )
    figure.update_yaxes(title=DELTA_AXIS, zeroline=True, zerolinecolor="#888888")
    title = f"Run {side.upper()}'s tokens under both runs' settings"
    return plots.figure_layout(figure, title, height=380).update_layout(margin={"b": 110})


def activation_difference_figure(difference: dict) -> go.Figure:
    norms = difference["norms"]
    positions = list(range(norms.shape[1]))
    figure = go.Figure(
        go.Heatmap(
            z=norms.tolist(),
            x=positions,
            y=[str(layer) for layer in difference["layers"]],
            colorscale="Viridis",
            hovertemplate="layer %{y}, position %{x}: ‖h_A − h_B‖=%{z:.2f}<extra></extra>",
            colorbar={"title": {"text": "‖h_A − h_B‖"}},
        )
    )
    step = max(1, -(-len(positions) // 40))
    figure.update_xaxes(
        title="position (A's token/B's token where they differ)",
        tickmode="array",
        tickvals=positions[::step],
        ticktext=[plots.plot_text(label) for label in difference["labels"]][::step],
        tickangle=-45,
    )
    plots.export_labels(figure, "x", dict(enumerate(difference["texts"])))
    figure.update_yaxes(title="layer", type="category")
    return plots.figure_layout(
        figure, "Activation difference ‖h_A − h_B‖ by layer × position", height=460
    )


# ---------------------------------------------------------------------------------------
# The page


def comparison_context(run_a: Run, run_b: Run) -> dict:
    """Everything the comparison page shows about two runs (which must be the same user's)."""
    sequences = {"a": run_sequence(run_a), "b": run_sequence(run_b)}
    context = {
        "run_a": run_a,
        "run_b": run_b,
        "mean_delta_definition": scoring.MEAN_DELTA_DEFINITION,
        "sides": [("A", run_a), ("B", run_b)],
        "figures": {},
        "comparison": comparison_for_runs(run_a=run_a, run_b=run_b),
        "scoring_unavailable": scoring_unavailable_reason(run_a, run_b),
        "same_settings": run_a.request_model == run_b.request_model
        and run_a.request.get("apply_steering_vectors")
        == run_b.request.get("apply_steering_vectors"),
    }
    if sequences["a"] and sequences["b"]:
        diff = token_diff(sequences["a"], sequences["b"])
        context["diff"] = [
            {"label": side.upper(), "run": run, "tokens": diff[side]}
            for side, run in (("a", run_a), ("b", run_b))
        ]
        # Each of the two requests scores both sequences, one token generated per prompt.
        context["scoring_tokens"] = 2 * (len(sequences["a"].ids) + len(sequences["b"].ids) + 2)
    comparison = context["comparison"]
    if comparison is not None and comparison.status == WorkStatus.SUCCEEDED:
        context["notebook"] = exports.compare_notebook(
            run_a, run_b, comparison.results, base_url=settings.SITE_URL
        )
        differences = logprob_differences(comparison.results)
        context["means"] = {
            side: scoring.mean_generated_delta(
                d["delta"], d["positions"], sequences[side].prompt_length
            )
            for side, d in differences.items()
        }
        for side in SIDES:
            figure = logprob_difference_figure(side, sequences[side], differences[side])
            context["figures"][f"logprob_{side}"] = plots.figure_entry(f"logprob-{side}", figure)
    activations, context["activations_missing"] = activation_difference(run_a, run_b)
    if activations is not None:
        context["activation_lengths"] = activations["lengths"]
        context["activation_positions"] = activations["norms"].shape[1]
        context["figures"]["activations"] = plots.figure_entry(
            "activation-difference", activation_difference_figure(activations)
        )
    return context
