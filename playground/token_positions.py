"""A run's tokens by position, read from its response's logprobs and prompt_logprobs: each
position's token, probability, rank and top-k, the prompt's and the completion's. Pure
functions of a run's request and response (no database)."""

import math

from acs_client.protocol import CompletionFields
from playground.plots import visible_token


def _actual_prompt_entry(entry: dict, remaining: str, k: int) -> tuple[str, dict]:
    """Which `{token id: {logprob, rank, decoded_token}}` item is the prompt's own token.

    The contract lists the top-`k` plus the actual token, so with `k + 1` items the actual
    one is the item ranked last; otherwise (or with the full vocabulary) it is the longest
    decoded token that ends the prompt text not yet accounted for.
    """
    items = list(entry.items())
    if k >= 0 and len(items) == k + 1:
        return max(items, key=lambda pair: pair[1]["rank"])
    suffixes = [
        pair
        for pair in items
        if pair[1]["decoded_token"] and remaining.endswith(pair[1]["decoded_token"])
    ]
    if suffixes:
        return max(suffixes, key=lambda pair: (len(pair[1]["decoded_token"]), -pair[1]["rank"]))
    return min(items, key=lambda pair: pair[1]["rank"])


# The alternatives shown per prompt position when the whole vocabulary came back.
FULL_VOCAB_TOP_SHOWN = 20


def _top_list(pairs, actual: str, limit: int | None = None) -> list[dict]:
    """The alternatives `(token, logprob)` from the most likely down (the first `limit`),
    equally likely ones by token text: bfloat16 logprobs tie often, and the stored answer
    (jsonb) does not keep the order the API sent them in. Give `pairs` in rank order where
    the API states ranks: ties then keep it."""
    ordered = sorted(pairs, key=lambda pair: -pair[1])[:limit]
    return [
        {"token": token, "logprob": logprob, "is_actual": token == actual}
        for token, logprob in ordered
    ]


def prompt_positions(
    prompt: str, prompt_logprobs: list | None, k: int, prompt_tokens: dict | None = None
) -> list[dict]:
    """Per prompt token: {source, token, token_id, logprob, rank, top, top_k}, from
    prompt_logprobs requested with `k` alternatives (−1: the full vocabulary, of which the
    first FULL_VOCAB_TOP_SHOWN are kept). The actual token of each entry is the run's own
    prompt token where its ids are known (`prompt_tokens`, see run_tokens), else found from
    the prompt text. The first token has no logprob."""
    if not prompt_logprobs:
        return []
    ids = (prompt_tokens or {}).get("ids")
    strings = (prompt_tokens or {}).get("strings")
    if ids is not None and len(ids) != len(prompt_logprobs):
        ids = strings = None
    top_k = FULL_VOCAB_TOP_SHOWN if k < 0 else k
    remaining = prompt
    reversed_positions = []
    for offset, entry in enumerate(reversed(prompt_logprobs[1:])):
        index = len(prompt_logprobs) - 1 - offset
        if ids is not None and str(ids[index]) in entry:
            token_id, actual = str(ids[index]), entry[str(ids[index])]
        else:
            token_id, actual = _actual_prompt_entry(entry, remaining, k)
        token = actual["decoded_token"]
        if remaining.endswith(token):
            remaining = remaining[: len(remaining) - len(token)]
        # Among equal ranks the position's own token comes last: when the API added it to
        # the k asked for, it is that extra one.
        by_rank = sorted(
            entry.items(),
            key=lambda pair: (pair[1]["rank"], pair[0] == token_id, pair[1]["decoded_token"]),
        )
        pairs = [(item["decoded_token"], item["logprob"]) for _, item in by_rank]
        reversed_positions.append(
            {
                "source": "prompt",
                "token": token,
                "token_id": int(token_id),
                "logprob": actual["logprob"],
                "rank": actual["rank"],
                "top": _top_list(pairs, token, FULL_VOCAB_TOP_SHOWN if k < 0 else None),
                "top_k": top_k,
                "full_vocabulary": k < 0,
            }
        )
    first = {
        "source": "prompt",
        "token": strings[0] if strings else remaining,
        "token_id": ids[0] if ids else None,
        "logprob": None,
        "rank": None,
        "top": [],
        "top_k": top_k,
    }
    return [first, *reversed(reversed_positions)]


def completion_positions(logprobs: dict | None, *, skip: int = 0, k: int = 0) -> list[dict]:
    """Per generated token from the legacy `logprobs` object (positions after `skip`),
    requested with `k` alternatives (the API adds the sampled token when it is not among
    them)."""
    if not logprobs:
        return []
    positions = []
    tops = logprobs.get("top_logprobs") or []
    for index, token in enumerate(logprobs["tokens"]):
        if index < skip:
            continue
        logprob = logprobs["token_logprobs"][index]
        alternatives = tops[index] if index < len(tops) and tops[index] else {}
        top = _top_list(sorted(alternatives.items()), token)
        higher = [item for item in top if logprob is not None and item["logprob"] > logprob]
        # Its rank is known only within the k asked for; beyond them, tokens that were not
        # returned may come between.
        known = logprob is not None and len(higher) < k
        positions.append(
            {
                "source": "completion",
                "token": token,
                "logprob": logprob,
                "rank": len(higher) + 1 if known else None,
                "top": top,
                "top_k": k,
            }
        )
    return positions


def _prompt_text(request: CompletionFields, prompt_index: int) -> str:
    prompt = request.prompt if isinstance(request.prompt, str) else request.prompt[prompt_index]
    return prompt if isinstance(prompt, str) else ""


def token_positions(
    request: CompletionFields, response: dict, choice_index: int = 0, tokens: dict | None = None
) -> list[dict]:
    """Prompt then completion tokens of one choice, each with `position`, `probability` and
    `label` (the token as every figure and list shows it).

    With `echo` the legacy logprobs start with the prompt tokens; those are taken as the
    prompt part unless prompt_logprobs is present. `tokens` are the run's stored tokens
    (`Run.tokens`), which name each prompt_logprobs entry's actual token exactly.
    """
    choice = response["choices"][choice_index]
    n = request.n
    prompt = _prompt_text(request, choice_index // n)
    prompt_tokens = None
    if tokens and len(tokens.get("prompts") or []) > choice_index // n:
        prompt_tokens = tokens["prompts"][choice_index // n]
    prompt_part = prompt_positions(
        prompt,
        choice.get("prompt_logprobs"),
        request.prompt_logprobs or 0,
        prompt_tokens,
    )
    logprobs = choice.get("logprobs")
    k = request.logprobs or 0
    echoed = 0
    if request.echo and logprobs:
        offsets = logprobs.get("text_offset") or []
        echoed = sum(1 for offset in offsets if offset < len(prompt))
        if not prompt_part:
            prompt_part = [
                {**position, "source": "prompt"}
                for position in completion_positions(logprobs, k=k)[:echoed]
            ]
    if not prompt_part and prompt_tokens and prompt_tokens.get("strings"):
        # No logprobs for the prompt, but its tokens are known: show them (unscored), so
        # that positions count from the prompt's first token everywhere on the page.
        prompt_part = [
            {"source": "prompt", "token": token, "token_id": token_id, "logprob": None,
             "rank": None, "top": [], "top_k": 0}
            for token, token_id in zip(prompt_tokens["strings"], prompt_tokens["ids"], strict=True)
        ]  # fmt: skip
    positions = prompt_part + completion_positions(logprobs, skip=echoed, k=k)
    for index, position in enumerate(positions):
        position["position"] = index
        position["label"] = visible_token(position["token"])
        logprob = position["logprob"]
        position["probability"] = None if logprob is None else math.exp(logprob)
    return positions
