"""What a sequence reports: incremental text with stop strings, logprobs, and the events the
scheduler thread sends to the HTTP side."""

import functools
from dataclasses import dataclass, field

import torch

# Rows of prompt logits materialised at once when scoring a prompt (bounds memory on long prompts).
PROMPT_SCORING_CHUNK = 256

# What a decode shows for bytes that are not (yet) a whole UTF-8 character.
REPLACEMENT = "\ufffd"

# Tokens before a position that vLLM decodes with a byte token to name it: enough for the
# longest UTF-8 character (4 bytes).
MAX_CONTEXT = 4

# Contexts whose names of the whole vocabulary's byte tokens are kept (a few kB each).
VOCABULARY_CONTEXTS_CACHED = 1024


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
    """Turns a growing list of token ids into text deltas, holding back incomplete characters
    (as vLLM's detokenizer, tokenizers' DecodeStream, does: text only ever gets whole
    characters, and the bytes of one left unfinished at the end never reach it)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith(REPLACEMENT):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return full[len(prefix) :]
        return ""

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
        """Add a token; return its offset in the returned text and the stop string it completed.

        The offset is where the token's text starts: a token that leaves a character
        unfinished adds no text, and the one that completes it carries the whole character
        from there, as its name in logprobs does (`TokenNames`). So each offset is the previous
        one plus the length of the previous token's name, as vLLM counts them, but where the
        text differs from the names: a special token it leaves out takes no room, and bytes
        that never form a character take the room of the U+FFFD they show as."""
        offset = len(self.echo_text) + len(self.generated)
        before = len(self.generated)
        self.generated += self.detokenizer.push(token_id)
        return offset, self._cut_at_stop(before)

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


class TokenNames:
    """The names of tokens in logprobs (`tokens`, `top_logprobs` keys, `decoded_token`), as
    vLLM 0.32 gives them (vllm/v1/engine/logprobs.py, `LogprobsProcessor._verify_tokens` and
    `_correct_decoded_token`).

    A token is named as it decodes alone (`alone`, the loader's `token_strings`), unless that
    ends in U+FFFD: then it is a byte token (of byte-fallback or byte-level BPE) whose
    character its context, the up to MAX_CONTEXT tokens chosen before its position, may
    complete. Its name is then what it adds to the shortest tail of the context it decodes
    with to something not ending in U+FFFD, beyond the text of that tail's tokens before
    their own trailing byte tokens (the completing token carries the whole character), or ""
    when no tail completes it. Names at one position are those of alternatives after the
    same context, never after each other.
    """

    def __init__(self, tokenizer, token_strings: list[str]):
        self.tokenizer = tokenizer
        self.alone = token_strings
        # 314 of SmolLM2's 49,152 ids: the only ones a context can rename.
        self.byte_tokens = tuple(i for i, s in enumerate(token_strings) if s.endswith(REPLACEMENT))
        # Per context: a full-vocabulary position names every byte token, and a prompt scored
        # again (or a repeated phrase) meets the same contexts again.
        self._byte_token_names = functools.lru_cache(VOCABULARY_CONTEXTS_CACHED)(
            functools.partial(self._names, self.byte_tokens)
        )

    def at(self, token_ids: list[int], context: list[int]) -> list[str]:
        """The names of `token_ids`, alternatives at one position after `context` (the chosen
        tokens before it, oldest first; only the last MAX_CONTEXT count)."""
        names = [self.alone[token_id] for token_id in token_ids]
        renamed = [j for j, name in enumerate(names) if name.endswith(REPLACEMENT)]
        if renamed:
            ids = tuple(token_ids[j] for j in renamed)
            for j, name in zip(
                renamed, self._names(ids, tuple(context[-MAX_CONTEXT:])), strict=True
            ):
                names[j] = name
        return names

    def vocabulary(self, context: list[int]) -> list[str]:
        """The name of every token (indexed by id) at a position after `context`; the byte
        tokens' names are computed once per context (up to ~4 decodes each)."""
        names = list(self.alone)
        byte_names = self._byte_token_names(tuple(context[-MAX_CONTEXT:]))
        for token_id, name in zip(self.byte_tokens, byte_names, strict=True):
            names[token_id] = name
        return names

    def _names(self, token_ids: tuple[int, ...], context: tuple[int, ...]) -> list[str]:
        """The names of byte tokens `token_ids` after `context` (at most MAX_CONTEXT tokens):
        vLLM's `_correct_decoded_token` of each, which tries the context's tails from the
        shortest."""
        names = [""] * len(token_ids)  # for a token no tail completes
        pending = list(range(len(token_ids)))
        for length in range(1, len(context) + 1):
            if not pending:
                break
            tail = list(context[-length:])
            prefix = self._clean_prefix(tail)
            unfinished = []
            for j in pending:
                full = self.tokenizer.decode([*tail, token_ids[j]])
                if full.endswith(REPLACEMENT):
                    unfinished.append(j)
                else:
                    names[j] = full[_common_prefix_length(prefix, full) :]
            pending = unfinished
        return names

    def _clean_prefix(self, tail: list[int]) -> str:
        """The text of `tail` before its trailing byte tokens: those were named "" (or only a
        part of what they decode to), so their text belongs to the token that completes it."""
        end = len(tail)
        while end and self.alone[tail[end - 1]].endswith(REPLACEMENT):
            end -= 1
        return self.tokenizer.decode(tail[:end]) if end else ""


def _common_prefix_length(prefix: str, text: str) -> int:
    """How many leading characters `text` shares with `prefix`: all of `prefix` normally;
    fewer where a tokenizer's normalisation makes a decode of more tokens differ earlier
    (vLLM then names the token from the first difference on)."""
    for length, (a, b) in enumerate(zip(prefix, text, strict=False)):
        if a != b:
            return length
    return min(len(prefix), len(text))


def generated_entry(row_logprobs, output_ids: list[int], k: int, names: TokenNames):
    """(name, logprob, top_logprobs dict) of the sampled token, the last of `output_ids` (the
    sequence's generated tokens so far, whose earlier ones name its byte tokens); the sampled
    token is always listed, first."""
    token_id = output_ids[-1]
    logprob = float(row_logprobs[token_id])
    top_ids, top_values = [], []
    if k:
        values, ids = torch.topk(row_logprobs, k)
        top_ids, top_values = ids.tolist(), values.tolist()
    ids = [token_id, *top_ids]
    strings = names.at(ids, output_ids[-1 - MAX_CONTEXT : -1])
    return strings[0], logprob, legacy_top(ids, [logprob, *top_values], strings)


def legacy_top(ids: list[int], logprobs: list[float], strings: list[str]) -> dict[str, float]:
    """A legacy `top_logprobs` entry {name: logprob} of one position, from its chosen token
    and then its top tokens (`ids`), built as vLLM builds it: from a dict keyed by token id (a
    top token that is the chosen one keeps the chosen one's place), then keyed by name, where
    of tokens with the same name (byte tokens named "") the later one's logprob wins."""
    top: dict[str, float] = {}
    seen = set()
    for token_id, logprob, string in zip(ids, logprobs, strings, strict=True):
        if token_id not in seen:
            seen.add(token_id)
            top[string] = logprob
    return top


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


def vllm_prompt_logprobs(scores: PromptScores, prompt_ids, k: int, names: TokenNames) -> list:
    """vLLM's prompt_logprobs: None, then per position {token id: {logprob, rank, decoded_token}}
    (the top k, plus the actual token; every token with prompt_logprobs -1)."""
    result: list = [None]
    for position, token_id in enumerate(prompt_ids[1:]):
        context = prompt_context(prompt_ids, position + 1)
        if scores.full_vocab is not None:
            entry = _full_vocab_entry(scores.full_vocab[position], names.vocabulary(context))
        else:
            entry = {}
            ids = scores.top_ids[position][:k]
            values = scores.top_logprobs[position][:k]
            strings = names.at(ids, context)
            for rank, (other_id, logprob, string) in enumerate(
                zip(ids, values, strings, strict=True), start=1
            ):
                entry[str(other_id)] = _entry(logprob, rank, string)
        entry[str(token_id)] = _entry(
            scores.token_logprobs[position],
            scores.ranks[position],
            names.at([token_id], context)[0],
        )
        result.append(entry)
    return result


def echo_logprobs(scores: PromptScores, prompt_ids, k: int, names: TokenNames) -> LogprobsChunk:
    """Legacy logprobs of the echoed prompt tokens, as vLLM makes them of its prompt_logprobs:
    the first token has none and is named as decoded alone; each offset is the previous one
    plus the length of the previous token's name."""
    chunk = LogprobsChunk()
    chunk.append(names.alone[prompt_ids[0]], None, None, 0)
    for position, token_id in enumerate(prompt_ids[1:]):
        ids = [token_id, *scores.top_ids[position][:k]]
        logprobs = [scores.token_logprobs[position], *scores.top_logprobs[position][:k]]
        strings = names.at(ids, prompt_context(prompt_ids, position + 1))
        offset = chunk.text_offset[-1] + len(chunk.tokens[-1])
        chunk.append(strings[0], logprobs[0], legacy_top(ids, logprobs, strings), offset)
    return chunk


def prompt_context(prompt_ids: list[int], position: int) -> list[int]:
    """The tokens that name the byte tokens at prompt position `position` (>= 1): the prompt
    tokens before it that have prompt logprobs, so never the first one (vLLM takes them from
    its prompt_logprobs list, whose first entry is None)."""
    return prompt_ids[max(1, position - MAX_CONTEXT) : position]


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
