"""What a sequence reports: incremental text with stop strings, logprobs, and the events the
scheduler thread sends to the HTTP side."""

import functools
from dataclasses import dataclass, field

import torch

# Rows of prompt logits materialised at once when scoring a prompt (bounds memory on long prompts).
PROMPT_SCORING_CHUNK = 256


@dataclass
class LogprobsChunk:
    """Legacy completions logprobs (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`)."""

    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)

    def append(self, token: str, logprob, top: dict | None, offset: int) -> None:
        self.tokens.append(token)
        self.token_logprobs.append(logprob)
        self.top_logprobs.append(top)
        self.text_offset.append(offset)

    def extend(self, other: "LogprobsChunk") -> None:
        self.tokens += other.tokens
        self.token_logprobs += other.token_logprobs
        self.top_logprobs += other.top_logprobs
        self.text_offset += other.text_offset

    def to_json(self) -> dict:
        return {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }


@dataclass
class ChoiceDelta:
    """New output of one choice: text, logprobs of new tokens, and the finish when it ends;
    with `return_token_ids` the new tokens' ids (the first delta also the prompt's)."""

    index: int
    text: str
    logprobs: LogprobsChunk | None = None
    finish_reason: str | None = None
    stop_reason: str | None = None
    prompt_logprobs: list | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


@dataclass
class RequestDone:
    usage: dict
    activations: dict | None = None


@dataclass
class RequestFailed:
    """The request ended in an error: `status` and `error_type` as the HTTP answer says them
    (a 4xx type marks it as the request's own fault); `usage`, when set, is the work done
    before the failure, reported so the gateway bills it."""

    code: str
    message: str
    status: int = 500
    error_type: str = "server_error"
    usage: dict | None = None


class NonFiniteOutput(Exception):
    """The model's logits came out NaN or infinite (steering that overflows the residual stream
    does that): no token can be chosen or reported from them."""


def finite_rows(values: torch.Tensor) -> torch.Tensor:
    """Per row of `values` [rows, n], whether all its values are finite. A row whose sum is
    finite has only finite values; only the other rows are checked value by value (on a CPU,
    torch.isfinite over a [48, 49152] tensor costs 35 ms, a sum 0.5 ms)."""
    finite = torch.isfinite(values.sum(dim=-1))
    if not bool(finite.all()):
        suspect = (~finite).nonzero().flatten()
        finite[suspect] = torch.isfinite(values[suspect]).all(dim=-1)
    return finite


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, holding back incomplete characters."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return full[len(prefix) :]
        return ""

    def flush(self) -> str:
        """Whatever was held back (an incomplete character decodes as U+FFFD)."""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix) :]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""


class ChoiceText:
    """Generated text of one choice: stop strings, and how much of it may be streamed yet.

    While a stop string could still complete, up to len(longest stop) - 1 characters are held
    back, so that streamed text never has to be taken back and equals the non-streamed text.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...], echo_text: str):
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.echo_text = echo_text
        self.generated = ""
        self.sent = 0
        self.echo_sent = False

    def add_token(self, token_id: int) -> tuple[int, str | None]:
        """Add a token; return its offset in the returned text and the stop string it completed."""
        offset = len(self.echo_text) + len(self.generated)
        before = len(self.generated)
        self.generated += self.detokenizer.push(token_id)
        return offset, self._cut_at_stop(before)

    def finish(self) -> None:
        self.generated += self.detokenizer.flush()

    def take_sendable(self, finished: bool) -> str:
        """The text not yet handed out that is safe to hand out now (echo prefix first)."""
        end = (
            len(self.generated) if finished else max(self.sent, len(self.generated) - self.holdback)
        )
        text = self.generated[self.sent : end]
        self.sent = end
        if not self.echo_sent:
            self.echo_sent = True
            text = self.echo_text + text
        return text

    def _cut_at_stop(self, before: int) -> str | None:
        if not self.stop:
            return None
        search_from = max(0, before - self.holdback)
        hits = [(self.generated.find(s, search_from), s) for s in self.stop]
        hits = [(position, s) for position, s in hits if position >= 0]
        if not hits:
            return None
        position, stop = min(hits)
        self.generated = self.generated[:position]
        return stop


def top_entries(row_logprobs: torch.Tensor, k: int, token_strings: list[str]) -> dict[str, float]:
    """{decoded token: logprob} of the k most likely tokens of one row."""
    if k == 0:
        return {}
    values, ids = torch.topk(row_logprobs, k)
    return {token_strings[i]: v for i, v in zip(ids.tolist(), values.tolist(), strict=True)}


def generated_entry(row_logprobs, token_id: int, k: int, token_strings):
    """(logprob, top_logprobs dict) of a sampled token; the sampled token is always listed."""
    logprob = float(row_logprobs[token_id])
    top = top_entries(row_logprobs, k, token_strings)
    top[token_strings[token_id]] = logprob
    return logprob, top


@dataclass
class PromptScores:
    """Per prompt position 1..P-1: the actual token's logprob and rank, and the top tokens."""

    token_logprobs: list[float]
    ranks: list[int]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]
    full_vocab: list[torch.Tensor] | None  # log-probability rows, only for prompt_logprobs -1


def score_prompt(final_hidden, lm_head, prompt_ids: list[int], top_k: int, full_vocab: bool):
    """Raw-distribution scores of the prompt's own tokens from the final (normed) hidden states.

    `final_hidden` is [P, hidden] (on the model's device); position t is predicted from row
    t - 1. The scores are computed on the CPU, chunk by chunk. NonFiniteOutput when a
    position's scores are NaN or infinite.
    """
    targets = torch.tensor(prompt_ids[1:], dtype=torch.long)
    scores = PromptScores([], [], [], [], [] if full_vocab else None)
    for start in range(0, len(targets), PROMPT_SCORING_CHUNK):
        rows = final_hidden[start : start + PROMPT_SCORING_CHUNK][: len(targets) - start]
        logprobs = torch.log_softmax(lm_head(rows).float(), dim=-1).cpu()
        if not bool(finite_rows(logprobs).all()):
            raise NonFiniteOutput
        chunk_targets = targets[start : start + len(rows)]
        actual = logprobs.gather(1, chunk_targets[:, None])
        scores.token_logprobs += actual[:, 0].tolist()
        scores.ranks += ((logprobs > actual).sum(dim=-1) + 1).tolist()
        if top_k:
            values, ids = torch.topk(logprobs, top_k, dim=-1)
            scores.top_ids += ids.tolist()
            scores.top_logprobs += values.tolist()
        else:
            scores.top_ids += [[] for _ in range(len(rows))]
            scores.top_logprobs += [[] for _ in range(len(rows))]
        if full_vocab:
            scores.full_vocab += list(logprobs)
    return scores


def vllm_prompt_logprobs(scores: PromptScores, prompt_ids, k: int, token_strings) -> list:
    """vLLM's prompt_logprobs: None, then per position {token id: {logprob, rank, decoded_token}}
    (the top k, plus the actual token)."""
    result: list = [None]
    for position, token_id in enumerate(prompt_ids[1:]):
        if scores.full_vocab is not None:
            entry = _full_vocab_entry(scores.full_vocab[position], token_strings)
        else:
            entry = {}
            ids = scores.top_ids[position][:k]
            values = scores.top_logprobs[position][:k]
            for rank, (other_id, logprob) in enumerate(zip(ids, values, strict=True), start=1):
                entry[str(other_id)] = _entry(logprob, rank, token_strings[other_id])
        entry[str(token_id)] = _entry(
            scores.token_logprobs[position], scores.ranks[position], token_strings[token_id]
        )
        result.append(entry)
    return result


def echo_logprobs(scores: PromptScores, prompt_ids, k: int, token_strings, tokenizer):
    """Legacy logprobs of the echoed prompt tokens (the first one has none, as in vLLM)."""
    chunk = LogprobsChunk()
    offsets = prompt_text_offsets(prompt_ids, tokenizer)
    chunk.append(token_strings[prompt_ids[0]], None, None, offsets[0])
    for position, token_id in enumerate(prompt_ids[1:]):
        top = {
            token_strings[i]: v
            for i, v in zip(
                scores.top_ids[position][:k], scores.top_logprobs[position][:k], strict=True
            )
        }
        top[token_strings[token_id]] = scores.token_logprobs[position]
        chunk.append(
            token_strings[token_id], scores.token_logprobs[position], top, offsets[position + 1]
        )
    return chunk


def prompt_text_offsets(prompt_ids, tokenizer) -> list[int]:
    """Character offset of each prompt token in the decoded prompt text."""
    detokenizer = IncrementalDetokenizer(tokenizer)
    offsets, length = [], 0
    for token_id in prompt_ids:
        offsets.append(length)
        length += len(detokenizer.push(token_id))
    return offsets


def _full_vocab_entry(row_logprobs: torch.Tensor, token_strings) -> dict:
    order = torch.argsort(row_logprobs, descending=True)
    ranks = torch.empty_like(order)
    ranks[order] = torch.arange(1, len(order) + 1)
    # Written out rather than through `_entry`: a call per vocabulary entry doubled the time.
    return {
        key: {"logprob": logprob, "rank": rank, "decoded_token": decoded}
        for key, logprob, rank, decoded in zip(
            _token_id_keys(len(order)),
            row_logprobs.tolist(),
            ranks.tolist(),
            token_strings,
            strict=True,
        )
    }


@functools.cache
def _token_id_keys(vocabulary_size: int) -> list[str]:
    return [str(token_id) for token_id in range(vocabulary_size)]


def _entry(logprob: float, rank: int, decoded: str) -> dict:
    return {"logprob": logprob, "rank": rank, "decoded_token": decoded}
