"""Two runs of one user compared, in numbers: side by side text with a token-level diff, the logprob
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
from dataclasses import dataclass

import numpy as np

from infra.lifecycle import WorkStatus
from playground import captures, plots, scoring
from playground.models import Run

SIDES = ("a", "b")


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
    a, b = (captures.activations(run.body, run.response, run.tokens) for run in (run_a, run_b))
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
