"""A large answer relayed as it arrives: the upstream's bytes made public without parsing.

A full-vocabulary answer (`prompt_logprobs: -1`: 49,152 entries per prompt position) on 256
prompt tokens is about 1 GB of JSON. Read whole, parsed, edited and compressed on the event
loop, one such answer stalled every other request of the web process for tens of seconds
and grew it by 800 MB. So the HTTP endpoint relays it chunk by chunk
(`upstream.open_completion`), holding a small multiple of a chunk at a time, and makes it
public at the byte level with `PublicBody`.

What `dialect.public_answer` does to such an answer comes down to byte edits, for the
requests `relayable` lets through (prompt_logprobs -1; no capture, steering or `logprobs`;
one upstream request): the engine's answer is already public but for the model's name; vLLM
adds members that are not the contract's (`EXTRA_FIELDS`, null unless a server option fills
them), which are dropped, and names the model by its upstream name, which is renamed. Every
other request (a capture's activations to check and reorder, text offsets to map, fan-out
answers to merge) still goes the parse path (`api.completions._run`).

Why byte patterns are enough here: in JSON a quote inside a string is escaped (`\\"`), so
the bytes `,"metrics":` can only be a member (the key itself); keys in this answer are field
names and, within prompt_logprobs, token ids, so such a member is the field it names. vLLM
and the engine write compact JSON (no blanks between tokens), and neither puts one of these
members first in its object, so each comes as `,"name":value`.
"""

import json
import logging
import re

from . import fanout
from .errors import ApiError

logger = logging.getLogger(__name__)

# vLLM's members that are not the contract's (dialect.ANSWER_FIELDS, CHOICE_FIELDS and
# USAGE_FIELDS), from vllm/entrypoints/openai/completion/protocol.py (CompletionResponse,
# CompletionResponseChoice) and serve/engine/protocol.py (UsageInfo) of the pinned vLLM:
# null unless the request or a server option asks for them; dropped whatever their value.
EXTRA_FIELDS = (
    "service_tier",
    "system_fingerprint",
    "kv_transfer_params",
    "ec_transfer_params",
    "metrics",
    "routed_experts",
    "prompt_tokens_details",
    "completion_tokens_details",
)
# Kept only where the request asks for them (`return_token_ids`).
TOKEN_ID_FIELDS = ("token_ids", "prompt_token_ids")
# The last bytes of the body kept to read its usage from (vLLM puts at most a few hundred
# bytes of members after it; the engine none).
TAIL_BYTES = 16 * 1024
# The most bytes held before the answer's `"choices":` (its id, object, created, model), and
# the largest value of a dropped member held whole before it is skipped.
HEAD_MAX_BYTES = 64 * 1024
EXTRA_MAX_BYTES = 1024 * 1024

# A logprob NaN or ±Infinity as Python's json writes it (vLLM refuses to write one, and the
# engine writes none; finite_json refuses them on the parse path). The only float members
# of a relayed answer are prompt_logprobs' "logprob".
_NON_FINITE = re.compile(rb'"logprob":-?(?:NaN|Infinity)')
_NON_FINITE_LONGEST = len(b'"logprob":-Infinity')
_MODEL = re.compile(rb'"model":"(?:[^"\\]|\\.)*"')


def relayable(valid) -> bool:
    """Whether the answer to `valid` (an `api.validation.ValidCompletion`) is relayed as it
    arrives rather than parsed: a non-streaming full-vocabulary request (prompt_logprobs -1)
    whose public answer is the upstream's with byte edits only (`PublicBody`): no capture
    (its activations are checked and may be reordered), no steering and no `logprobs` (text
    offsets are mapped), one upstream request (`fanout.needed`: answers are merged)."""
    request = valid.request
    return (
        request.prompt_logprobs == -1
        and not request.stream
        and valid.capture_layers is None
        and not request.apply_steering_vectors
        and request.logprobs is None
        and not fanout.needed(valid)
    )


class PublicBody:
    """The public answer made of an upstream's answer fed chunk by chunk (`feed`, then `end`),
    as `dialect.public_answer` and the model's rename make it of the parsed answer: its
    members in `EXTRA_FIELDS` (and `TOKEN_ID_FIELDS` unless `keep_token_ids`) dropped, its
    `"model"` named `model_name`. Holds at most the bytes of an unfinished head
    (HEAD_MAX_BYTES), of a dropped member (EXTRA_MAX_BYTES, in practice a few bytes), or of
    the longest pattern (a few dozen bytes), plus TAIL_BYTES of the upstream's last bytes,
    whose `"usage"` `usage()` reads. Raises ApiError where the answer cannot be made public:
    an upstream the caller should then treat as failing mid-body."""

    def __init__(self, *, model_name: str, keep_token_ids: bool):
        names = EXTRA_FIELDS + (() if keep_token_ids else TOKEN_ID_FIELDS)
        self._extra = re.compile(
            rb',"(?:' + b"|".join(re.escape(name.encode()) for name in names) + rb')":'
        )
        longest = max(len(name) for name in names) + len(b',"":')
        # Bytes held back at a chunk's end: a pattern begun there is matched whole next time.
        self._hold = max(longest, _NON_FINITE_LONGEST) - 1
        self._model = b'"model":' + json.dumps(model_name).encode()
        self._pending = b""
        self._head_done = False
        self.tail = b""
        self.upstream_bytes = 0

    def feed(self, chunk: bytes) -> bytes:
        """The public bytes that `chunk` (the next bytes of the upstream's answer) completes."""
        self.upstream_bytes += len(chunk)
        self.tail = (self.tail + chunk)[-TAIL_BYTES:]
        buffer = self._pending + chunk if self._pending else chunk
        if not self._head_done:
            choices = buffer.find(b'"choices":')
            if choices < 0:
                if len(buffer) > HEAD_MAX_BYTES:
                    raise _not_an_answer("no choices in its first 64 KiB")
                self._pending = buffer
                return b""
            buffer = self._named(buffer, choices)
            self._head_done = True
        return self._filtered(buffer, final=False)

    def end(self) -> bytes:
        """The answer's last public bytes, once the upstream's body has ended."""
        if not self._head_done:
            raise _not_an_answer("it has no choices")
        return self._filtered(self._pending, final=True)

    def usage(self) -> dict | None:
        """The answer's `usage` object read from its last TAIL_BYTES, or None where they hold
        none (the body was not read to its end, or the upstream reported none). The last
        `"usage":` is the answer's own: no other member has that name."""
        at = self.tail.rfind(b'"usage":')
        if at < 0:
            return None
        text = self.tail[at + len(b'"usage":') :].decode("utf-8", "replace")
        try:
            usage, _ = json.JSONDecoder().raw_decode(text)
        except ValueError:
            return None
        return usage if isinstance(usage, dict) else None

    def _named(self, buffer: bytes, choices: int) -> bytes:
        """`buffer` with the head's model named as the registry does (added where the
        upstream named none, as the parse path sets it)."""
        head = buffer[:choices]
        model = _MODEL.search(head)
        if model is not None:
            return head[: model.start()] + self._model + head[model.end() :] + buffer[choices:]
        opening = buffer.index(b"{") + 1 if b"{" in head else None
        if opening is None:
            raise _not_an_answer("it is not a JSON object")
        return buffer[:opening] + self._model + b"," + buffer[opening:]

    def _filtered(self, buffer: bytes, *, final: bool) -> bytes:
        if (b"NaN" in buffer or b"Infinity" in buffer) and _NON_FINITE.search(buffer):
            raise ApiError(
                "non_finite_output",
                "The model's output holds NaN or infinite values, which JSON cannot carry: "
                "the upstream failed to compute this request.",
            )
        pieces, at = [], 0
        limit = len(buffer) if final else len(buffer) - self._hold
        while (member := self._extra.search(buffer, at)) is not None and member.start() < limit:
            end = _value_end(buffer, member.end())
            if end is None:
                if final or len(buffer) - member.start() > EXTRA_MAX_BYTES:
                    raise _not_an_answer("a member is cut off or too large")
                pieces.append(buffer[at : member.start()])
                self._pending = buffer[member.start() :]
                return b"".join(pieces)
            pieces.append(buffer[at : member.start()])
            at = end
        cut = max(at, limit)
        pieces.append(buffer[at:cut])
        self._pending = buffer[cut:]
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)


_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_OPENING, _CLOSING = frozenset(b"{["), frozenset(b"}]")
_SCALAR_END = re.compile(rb"[,}\]]")


def _value_end(buffer: bytes, start: int) -> int | None:
    """The index just past the compact JSON value starting at `buffer[start]`, or None where
    `buffer` ends before it does. Values of dropped members are small: a byte loop."""
    if buffer.startswith(b"null", start):
        return start + 4
    if start >= len(buffer):
        return None
    first = buffer[start]
    if first != _QUOTE and first not in _OPENING:
        end = _SCALAR_END.search(buffer, start)
        return end.start() if end is not None else None
    depth, in_string, escaped = 0, False, False
    for index in range(start, len(buffer)):
        byte = buffer[index]
        if in_string:
            if escaped:
                escaped = False
            elif byte == _BACKSLASH:
                escaped = True
            elif byte == _QUOTE:
                in_string = False
                if depth == 0:
                    return index + 1
        elif byte == _QUOTE:
            in_string = True
        elif byte in _OPENING:
            depth += 1
        elif byte in _CLOSING:
            depth -= 1
            if depth == 0:
                return index + 1
    return None


def _not_an_answer(why: str) -> ApiError:
    return ApiError("upstream_server_error", f"The upstream's answer could not be relayed: {why}.")
