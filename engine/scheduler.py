"""Step-level continuous batching on one dedicated thread, which alone touches the model.

Each loop iteration admits waiting prompts (prefilled one prompt at a time, its KV cache copied
for its n samples and merged into the running batch), then runs one batched decode step over
every active sequence. The batch's KV cache is left-padded: each row's padding is masked out
and each row gets its own position ids, so a sequence's output does not depend on its batch
beyond floating-point noise.
"""

import asyncio
import logging
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from acs_client.codec import encode_bfloat16_bits
from engine.hooks import RowHooks, block_hooks
from engine.loader import LoadedModel
from engine.outputs import (
    ChoiceDelta,
    ChoiceText,
    LogprobsChunk,
    RequestDone,
    RequestFailed,
    echo_logprobs,
    generated_entry,
    score_prompt,
    vllm_prompt_logprobs,
)
from engine.preparation import PreparedRequest
from engine.sampling import make_generator, select_token

log = logging.getLogger(__name__)


class Overloaded(Exception):
    """The engine holds as many waiting sequences as it may; retry later."""


@dataclass(eq=False)
class EngineRequest:
    """One HTTP request in the engine. Events (ChoiceDelta, then RequestDone or RequestFailed)
    arrive on `events` in the event loop `loop`; `cancel()` drops it at the next step."""

    prepared: PreparedRequest
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))
    cancelled: bool = False
    unfinished: int = 0
    completion_tokens: int = 0
    activations: dict | None = None

    def emit(self, event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:
            self.cancelled = True  # the event loop is gone: nobody is listening any more

    def cancel(self) -> None:
        self.cancelled = True  # seen by the scheduler thread at its next step

    @property
    def prompt_tokens(self) -> int:
        return sum(len(ids) for ids in self.prepared.prompts)


@dataclass(eq=False)
class PromptGroup:
    """The n samples of one prompt of a request: admitted and prefilled together."""

    request: EngineRequest
    prompt_index: int

    @property
    def size(self) -> int:
        return self.request.prepared.n


@dataclass(eq=False)
class Sequence:
    request: EngineRequest
    choice_index: int
    prompt_ids: list[int]
    generator: torch.Generator
    text: ChoiceText
    capture: dict[int, list[torch.Tensor]] | None
    output_ids: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    finished: bool = False

    @property
    def dropped(self) -> bool:
        return self.finished or self.request.cancelled

    def hooks(self, positions: list[int]) -> RowHooks:
        return RowHooks(self.request.prepared.steering, self.capture, positions)


class Scheduler:
    """Owns the model: call `start()`, then `submit()` requests from any thread."""

    def __init__(self, loaded: LoadedModel, max_active: int, max_waiting: int, threads: int):
        self.loaded = loaded
        self.max_active = max_active
        self.max_waiting = max_waiting
        self.threads = threads
        self._condition = threading.Condition()
        self._waiting: deque[PromptGroup] = deque()
        self._waiting_sequences = 0
        self._stopping = False
        self._active: list[Sequence] = []
        self._cache: DynamicCache | None = None
        self._mask: torch.Tensor | None = None
        self._prefilling: EngineRequest | None = None
        self._thread = threading.Thread(target=self._run, name="engine-scheduler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._condition:
            self._stopping = True
            self._condition.notify()
        self._thread.join(timeout=10)

    def submit(self, request: EngineRequest) -> None:
        """Queue a request; Overloaded when the waiting queue cannot take its sequences."""
        request.unfinished = request.prepared.sequence_count
        with self._condition:
            if self._waiting_sequences + request.unfinished > self.max_waiting:
                raise Overloaded(f"engine queue is full ({self.max_waiting} waiting sequences)")
            for prompt_index in range(len(request.prepared.prompts)):
                self._waiting.append(PromptGroup(request, prompt_index))
            self._waiting_sequences += request.unfinished
            self._condition.notify()

    def cancel(self, request: EngineRequest) -> None:
        """Drop a request: its waiting prompts at once, its running sequences at the next step."""
        with self._condition:
            request.cancel()
            kept = [group for group in self._waiting if group.request is not request]
            self._waiting_sequences -= sum(group.size for group in self._waiting) - sum(
                group.size for group in kept
            )
            self._waiting = deque(kept)
            self._condition.notify()

    def stats(self) -> dict:
        with self._condition:
            active = sum(1 for sequence in self._active if not sequence.dropped)
            return {"active_sequences": active, "waiting_sequences": self._waiting_sequences}

    def _run(self) -> None:
        torch.set_num_threads(self.threads)
        with torch.inference_mode():
            while self._wait_for_work():
                try:
                    self._admit_waiting()
                    self._drop_finished()
                    if self._active:
                        self._decode_step()
                        self._drop_finished()
                except Exception:
                    log.exception("model step failed")
                    self._fail_active()

    def _wait_for_work(self) -> bool:
        with self._condition:
            while not self._stopping and not self._waiting and not self._active:
                self._condition.wait()
            return not self._stopping

    def _admit_waiting(self) -> None:
        while True:
            with self._condition:
                if not self._waiting:
                    return
                group = self._waiting[0]
                if not group.request.cancelled and len(self._active) + group.size > self.max_active:
                    return
                self._waiting.popleft()
                self._waiting_sequences -= group.size
            if not group.request.cancelled:
                self._prefilling = group.request
                self._prefill(group)
                self._prefilling = None

    def _prefill(self, group: PromptGroup) -> None:
        request = group.request
        prepared = request.prepared
        prompt_ids = prepared.prompts[group.prompt_index]
        sequences = [self._new_sequence(group, sample) for sample in range(group.size)]
        cache = DynamicCache(config=self.loaded.model.config)
        hooks = [sequences[0].hooks(list(range(len(prompt_ids))))]
        with block_hooks(self.loaded.model.model.layers, hooks):
            output = self.loaded.model.model(
                input_ids=torch.tensor([prompt_ids]), cache=cache, use_cache=True
            )
        final_hidden = output.last_hidden_state[0]
        logits = self.loaded.model.lm_head(final_hidden[-1]).float()
        logprobs = torch.log_softmax(logits, dim=-1)
        first_delta = self._prompt_outputs(prepared, prompt_ids, final_hidden)
        if group.size > 1:
            cache.batch_repeat_interleave(group.size)
        self._merge(cache, len(prompt_ids), sequences)
        for sequence in sequences:
            sequence.cached_tokens = len(prompt_ids)
            self._accept_token(sequence, logits, logprobs, first_delta)

    def _new_sequence(self, group: PromptGroup, sample: int) -> Sequence:
        prepared = group.request.prepared
        prompt_ids = prepared.prompts[group.prompt_index]
        params = prepared.params
        echo_text = self.loaded.tokenizer.decode(prompt_ids) if params.echo else ""
        capture = {layer: [] for layer in prepared.capture_layers or ()} or None
        return Sequence(
            request=group.request,
            choice_index=group.prompt_index * prepared.n + sample,
            prompt_ids=prompt_ids,
            generator=make_generator(prepared.seed, sample),
            text=ChoiceText(self.loaded.tokenizer, params.stop, echo_text),
            capture=capture,
        )

    def _prompt_outputs(self, prepared: PreparedRequest, prompt_ids, final_hidden) -> ChoiceDelta:
        """The prompt's part of each choice's first delta: prompt_logprobs and echo logprobs."""
        params = prepared.params
        delta = ChoiceDelta(index=-1, text="")
        if not params.needs_prompt_scores:
            return delta
        prompt_k = max(params.prompt_logprobs or 0, 0)
        echo_k = params.logprobs if params.echo and params.logprobs is not None else 0
        scores = score_prompt(
            final_hidden,
            self.loaded.model.lm_head,
            prompt_ids,
            top_k=max(prompt_k, echo_k),
            full_vocab=params.prompt_logprobs == -1,
        )
        strings = self.loaded.token_strings
        if params.prompt_logprobs is not None:
            delta.prompt_logprobs = vllm_prompt_logprobs(scores, prompt_ids, prompt_k, strings)
        if params.echo and params.logprobs is not None:
            delta.logprobs = echo_logprobs(
                scores, prompt_ids, echo_k, strings, self.loaded.tokenizer
            )
        return delta

    def _decode_step(self) -> None:
        rows = self._active
        input_ids = torch.tensor([[sequence.output_ids[-1]] for sequence in rows])
        position_ids = torch.tensor([[sequence.cached_tokens] for sequence in rows])
        self._mask = torch.cat([self._mask, torch.ones(len(rows), 1, dtype=torch.long)], dim=1)
        hooks = [sequence.hooks([sequence.cached_tokens]) for sequence in rows]
        with block_hooks(self.loaded.model.model.layers, hooks):
            output = self.loaded.model.model(
                input_ids=input_ids,
                attention_mask=self._mask,
                position_ids=position_ids,
                cache=self._cache,
                use_cache=True,
            )
        logits = self.loaded.model.lm_head(output.last_hidden_state[:, -1]).float()
        logprobs = torch.log_softmax(logits, dim=-1)
        for row, sequence in enumerate(rows):
            sequence.cached_tokens += 1
            if not sequence.dropped:
                self._accept_token(sequence, logits[row], logprobs[row])

    def _accept_token(self, sequence: Sequence, logits, logprobs, first: ChoiceDelta | None = None):
        """Sample the sequence's next token, report it, and finish the sequence if it is done."""
        params = sequence.request.prepared.params
        token = select_token(
            logits, params, sequence.generator, sequence.prompt_ids, sequence.output_ids
        )
        sequence.output_ids.append(token)
        offset, stop_hit = sequence.text.add_token(token)
        delta = ChoiceDelta(index=sequence.choice_index, text="")
        if first is not None:
            delta.prompt_logprobs = first.prompt_logprobs
        if params.logprobs is not None:
            delta.logprobs = LogprobsChunk()
            if first is not None and first.logprobs is not None:
                delta.logprobs.extend(first.logprobs)
            logprob, top = generated_entry(
                logprobs, token, params.logprobs, self.loaded.token_strings
            )
            delta.logprobs.append(self.loaded.token_strings[token], logprob, top, offset)
        if stop_hit is not None:
            delta.finish_reason, delta.stop_reason = "stop", stop_hit
        elif token in self.loaded.eos_token_ids and not params.ignore_eos:
            delta.finish_reason = "stop"
        elif len(sequence.output_ids) >= params.max_tokens:
            delta.finish_reason = "length"
        if delta.finish_reason is not None and stop_hit is None:
            sequence.text.finish()
        delta.text = sequence.text.take_sendable(finished=delta.finish_reason is not None)
        if delta.text or delta.logprobs or delta.finish_reason or delta.prompt_logprobs:
            sequence.request.emit(delta)
        if delta.finish_reason is not None:
            self._finish(sequence)

    def _finish(self, sequence: Sequence) -> None:
        sequence.finished = True
        request = sequence.request
        request.completion_tokens += len(sequence.output_ids)
        request.unfinished -= 1
        if sequence.capture is not None:
            request.activations = {"residual_stream": self._encode_capture(sequence)}
        if request.unfinished == 0:
            usage = {
                "prompt_tokens": request.prompt_tokens,
                "completion_tokens": request.completion_tokens,
                "total_tokens": request.prompt_tokens + request.completion_tokens,
            }
            request.emit(RequestDone(usage=usage, activations=request.activations))

    def _encode_capture(self, sequence: Sequence) -> dict:
        """[layers, tokens, hidden] bf16 in request layer order, sent as raw bit patterns."""
        layers = sequence.request.prepared.capture_layers
        stacked = torch.stack([torch.cat(sequence.capture[layer]) for layer in layers])
        bf16 = stacked.to(torch.bfloat16).contiguous()
        return encode_bfloat16_bits(bf16.view(torch.int16).numpy())

    def _merge(self, cache: DynamicCache, length: int, sequences: list[Sequence]) -> None:
        """Append the new rows' cache to the batch cache, left-padding the shorter side."""
        new_mask = torch.ones(len(sequences), length, dtype=torch.long)
        if self._cache is None:
            self._cache, self._mask = cache, new_mask
        else:
            batch_length = self._mask.shape[1]
            target = max(batch_length, length)
            for batch_layer, new_layer in zip(self._cache.layers, cache.layers, strict=True):
                batch_layer.keys = torch.cat(
                    [_pad_left(batch_layer.keys, target), _pad_left(new_layer.keys, target)]
                )
                batch_layer.values = torch.cat(
                    [_pad_left(batch_layer.values, target), _pad_left(new_layer.values, target)]
                )
            self._mask = torch.cat([_pad_left(self._mask, target), _pad_left(new_mask, target)])
        self._active.extend(sequences)

    def _drop_finished(self) -> None:
        """Remove finished and cancelled rows, then cache columns that are padding in every row."""
        keep = [row for row, sequence in enumerate(self._active) if not sequence.dropped]
        if len(keep) == len(self._active):
            return
        if not keep:
            self._active, self._cache, self._mask = [], None, None
            return
        index = torch.tensor(keep)
        self._active = [self._active[row] for row in keep]
        self._mask = self._mask[index]
        first_used = int(self._mask.any(dim=0).long().argmax())
        self._mask = self._mask[:, first_used:]
        for layer in self._cache.layers:
            layer.keys = layer.keys[index, :, first_used:]
            layer.values = layer.values[index, :, first_used:]

    def _fail_active(self) -> None:
        failed = {sequence.request for sequence in self._active}
        if self._prefilling is not None:
            failed.add(self._prefilling)
            self._prefilling = None
        for request in failed:
            request.emit(RequestFailed("internal_error", "the model step failed; see engine log"))
            request.cancel()
        self._active, self._cache, self._mask = [], None, None


def _pad_left(tensor: torch.Tensor, length: int) -> torch.Tensor:
    """Zero-pad dimension 2 (keys/values) or 1 (masks) on the left up to `length`."""
    dim = 2 if tensor.ndim == 4 else 1
    missing = length - tensor.shape[dim]
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)
