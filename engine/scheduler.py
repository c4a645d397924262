"""Step-level continuous batching on one dedicated thread, which alone touches the model.

Each loop iteration advances the prefill of the waiting prompts that fit (all prefilled
together, left-padded, PREFILL_CHUNK_TOKENS columns per iteration; when done, each prompt's KV
cache row is copied for its n samples and merged into the running batch), then runs one batched
decode step over every active sequence. Every batch is left-padded: each row's padding is
masked out and each row gets its own position ids, so a sequence's output does not depend on
its batch beyond floating-point noise.

Capacity is shared between tenants (the account a request is for, which the gateway names in
X-Acs-Tenant; requests without it share one tenant). Each tenant's prompts wait in a queue of
its own, and the queues are served round-robin, a prompt at a time, so a request of thousands
of sequences is taken in slices while other tenants' requests start beside it. A tenant with
sequences running never takes the batch's last `reserved` slots: they are kept for a tenant
with none, so long generations of one tenant cannot hold every slot either. The waiting limit
is per tenant: one tenant's queue, however long, never refuses another's request.
"""

import asyncio
import functools
import logging
import threading
import time
import uuid
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field

import torch

from acs_client.codec import encode_bfloat16_bits
from engine.decoder import KVCache
from engine.hooks import RowHooks, layer_hooks
from engine.loader import LoadedModel
from engine.outputs import (
    ChoiceDelta,
    ChoiceText,
    LogprobsChunk,
    NonFiniteOutput,
    RequestDone,
    RequestFailed,
    echo_logprobs,
    finite_rows,
    generated_entry,
    score_prompt,
    vllm_prompt_logprobs,
)
from engine.preparation import PreparedRequest
from engine.protocol import RequestError
from engine.sampling import make_generator, select_token

log = logging.getLogger(__name__)


class Overloaded(Exception):
    """The tenant already has as many waiting sequences as it may; retry later."""


@dataclass(eq=False)
class EngineRequest:
    """One HTTP request in the engine. Events (ChoiceDelta, then RequestDone or RequestFailed)
    arrive on `events` in the event loop `loop`; `cancel()` drops it at the next step."""

    prepared: PreparedRequest
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    tenant: str = ""
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

    @property
    def prompt_ids(self) -> list[int]:
        return self.request.prepared.prompts[self.prompt_index]


class TenantQueues:
    """The waiting prompt groups: one queue per tenant, each in arrival order, and the tenants
    in turn order. A tenant served goes to the back; a tenant that had nothing waiting joins
    at the front (it is the one served least recently). Not thread-safe: the scheduler holds
    its lock."""

    def __init__(self):
        self._queues: OrderedDict[str, deque[PromptGroup]] = OrderedDict()
        self._sequences: Counter[str] = Counter()

    def __len__(self) -> int:
        """Tenants with something waiting."""
        return len(self._queues)

    @property
    def sequences(self) -> int:
        return sum(self._sequences.values())

    def waiting(self, tenant: str) -> int:
        """Sequences of `tenant` waiting."""
        return self._sequences[tenant]

    def add(self, request: EngineRequest) -> None:
        queue = self._queues.get(request.tenant)
        if queue is None:
            queue = self._queues[request.tenant] = deque()
            self._queues.move_to_end(request.tenant, last=False)
        queue.extend(PromptGroup(request, index) for index in range(len(request.prepared.prompts)))
        self._sequences[request.tenant] += request.prepared.sequence_count

    def remove(self, request: EngineRequest) -> None:
        """Drop every waiting group of `request`."""
        queue = self._queues.get(request.tenant)
        if queue is None:
            return
        kept = deque(group for group in queue if group.request is not request)
        self._sequences[request.tenant] -= (len(queue) - len(kept)) * request.prepared.n
        self._queues[request.tenant] = kept
        self._forget_if_empty(request.tenant)

    def heads(self) -> list[PromptGroup]:
        """The first waiting group of each tenant, in turn order (cancelled groups dropped)."""
        heads = []
        for tenant in list(self._queues):
            queue = self._queues[tenant]
            while queue and queue[0].request.cancelled:
                self._sequences[tenant] -= queue.popleft().size
            if queue:
                heads.append(queue[0])
            else:
                self._forget_if_empty(tenant)
        return heads

    def pop(self, group: PromptGroup) -> None:
        """Dequeue `group` (one of `heads()`); its tenant goes to the back of the turn order."""
        tenant = group.request.tenant
        self._queues[tenant].popleft()
        self._sequences[tenant] -= group.size
        self._queues.move_to_end(tenant)
        self._forget_if_empty(tenant)

    def _forget_if_empty(self, tenant: str) -> None:
        if not self._queues[tenant]:
            del self._queues[tenant], self._sequences[tenant]


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

    def hooks(self, positions: list[int], offset: int = 0) -> RowHooks:
        return RowHooks(self.request.prepared.steering, self.capture, positions, offset)


class Scheduler:
    """Owns the model: call `start()`, then `submit()` requests from any thread."""

    def __init__(self, loaded: LoadedModel, max_active: int, max_waiting: int, threads: int):
        self.loaded = loaded
        self.max_active = max_active
        self.max_waiting = max_waiting
        self.threads = threads
        # Slots a tenant with sequences running leaves to others: a quarter of the batch, at
        # most 16 (the largest n, so any other tenant's prompt can start at once).
        self.reserved = min(16, max_active // 4)
        self._condition = threading.Condition()
        self._waiting = TenantQueues()
        self._stopping = False
        self._active: list[Sequence] = []
        self._cache: KVCache | None = None
        self._mask: torch.Tensor | None = None
        self._prefill: Prefill | None = None
        self._thread = threading.Thread(target=self._run, name="engine-scheduler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._condition:
            self._stopping = True
            self._condition.notify()
        self._thread.join(timeout=10)

    def submit(self, request: EngineRequest) -> None:
        """Queue a request in its tenant's queue. Overloaded (busy: retry later) when the
        tenant already has sequences waiting and this request's would take them past
        `max_waiting`; a tenant with nothing waiting may queue a request of any size (its
        prompts are then admitted in turn with other tenants'), so no request is refused for
        its size alone, and no tenant's queue refuses another's requests. RequestError when
        its n samples of one prompt could never run together."""
        if request.prepared.n > self.max_active:
            raise RequestError(
                f"n = {request.prepared.n} samples of a prompt run together, and this engine "
                f"runs at most {self.max_active} sequences at once"
            )
        request.unfinished = request.prepared.sequence_count
        with self._condition:
            waiting = self._waiting.waiting(request.tenant)
            if waiting and waiting + request.unfinished > self.max_waiting:
                raise Overloaded(
                    f"this tenant's queue is full ({waiting} sequences waiting; at most "
                    f"{self.max_waiting} beyond a first request)"
                )
            self._waiting.add(request)
            self._condition.notify()

    def cancel(self, request: EngineRequest) -> None:
        """Drop a request: its waiting prompts at once, its running sequences at the next step."""
        with self._condition:
            request.cancel()
            self._waiting.remove(request)
            self._condition.notify()

    def stats(self) -> dict:
        with self._condition:
            active = sum(1 for sequence in self._active if not sequence.dropped)
            return {
                "active_sequences": active,
                "waiting_sequences": self._waiting.sequences,
                "waiting_tenants": len(self._waiting),
            }

    def _run(self) -> None:
        torch.set_num_threads(self.threads)
        with torch.inference_mode():
            while self._wait_for_work():
                try:
                    self.step()
                except Exception:
                    log.exception("model step failed")
                    self._fail_active()

    def step(self) -> None:
        """One iteration of the loop: start or advance a prefill, then one decode step of the
        running batch. Called by the scheduler's thread (tests call it themselves, on a
        scheduler never started, under torch.inference_mode)."""
        self._advance_prefill()
        self._drop_finished()
        if self._active:
            self._decode_step()
            self._drop_finished()

    def _wait_for_work(self) -> bool:
        with self._condition:
            while (
                not self._stopping
                and not self._waiting
                and not self._active
                and self._prefill is None
            ):
                self._condition.wait()
            return not self._stopping

    def _advance_prefill(self) -> None:
        """Start prefilling the waiting prompts that fit, or run the next chunk of the prefill
        in progress; when its last chunk is done, its sequences join the running batch."""
        if self._prefill is None:
            groups = self._take_admissible()
            if not groups:
                return
            self._prefill = self._prefill_start(groups)
        prefill = self._prefill
        if all(group.request.cancelled for group in prefill.groups):
            self._prefill = None
            return
        if self._prefill_chunk(prefill):
            self._prefill = None
            self._prefill_finish(prefill)

    def _take_admissible(self) -> list[PromptGroup]:
        """Dequeue waiting groups for one prefill batch, a group at a time from each tenant in
        turn (each tenant's in arrival order), while they fit: beside the active sequences (a
        tenant with sequences running leaves the last `reserved` slots to others) and in one
        batch (see `_padding_acceptable`). A tenant whose next group does not fit is passed
        over, keeping its turn."""
        room = self.max_active - len(self._active)
        running = Counter(sequence.request.tenant for sequence in self._active)
        admitted, longest, real_tokens = [], 0, 0

        def fits(group: PromptGroup) -> bool:
            length = len(group.prompt_ids)
            if group.size > room - (self.reserved if running[group.request.tenant] else 0):
                return False
            if not admitted:
                return True
            return _padding_acceptable(
                len(admitted) + 1, max(longest, length), real_tokens + length
            )

        with self._condition:
            while group := next(filter(fits, self._waiting.heads()), None):
                self._waiting.pop(group)
                admitted.append(group)
                room -= group.size
                running[group.request.tenant] += group.size
                longest = max(longest, len(group.prompt_ids))
                real_tokens += len(group.prompt_ids)
        return admitted

    def _prefill_start(self, groups: list[PromptGroup]) -> "Prefill":
        prompts = [group.prompt_ids for group in groups]
        input_ids, mask = _padded_prompts(prompts, self.device)
        return Prefill(
            groups=groups,
            samples=[[self._new_sequence(group, i) for i in range(group.size)] for group in groups],
            prompts=prompts,
            input_ids=input_ids,
            mask=mask,
            position_ids=(mask.cumsum(dim=1) - 1).clamp_min(0),
            cache=KVCache.empty(self.loaded.decoder, len(groups)),
        )

    def _prefill_chunk(self, prefill: "Prefill") -> bool:
        """Run the next PREFILL_CHUNK_TOKENS columns of the prefill's left-padded prompts
        through the model; True when every column is done."""
        start = prefill.done
        end = min(start + PREFILL_CHUNK_TOKENS, prefill.width)
        # Samples of one prompt share its steering and, as capture allows only n = 1, its
        # capture store: the first sample's hooks stand for the prompt's row.
        hooks = []
        for sequences, padding in zip(prefill.samples, prefill.padding, strict=True):
            first_real = max(start, padding)
            positions = list(range(first_real - padding, end - padding))
            hooks.append(sequences[0].hooks(positions, first_real - start))
        hidden = self._forward(
            prefill.input_ids[:, start:end],
            prefill.mask[:, :end],
            prefill.position_ids[:, start:end],
            prefill.cache,
            hooks,
        )
        prefill.hidden_chunks.append(hidden)
        prefill.done = end
        return end == prefill.width

    def _prefill_finish(self, prefill: "Prefill") -> None:
        """Add the prefilled sequences to the running batch and sample their first tokens."""
        groups, samples, prompts = prefill.groups, prefill.samples, prefill.prompts
        final_hidden = torch.cat(prefill.hidden_chunks, dim=1)
        logits = self._logits(final_hidden[:, -1])
        requests = [group.request for group in groups]
        logprobs = _reported_logprobs(logits, requests)
        sizes = torch.tensor([group.size for group in groups], device=self.device)
        if bool((sizes > 1).any()):
            prefill.cache.repeat_rows(sizes)
        new_rows = [sequence for sequences in samples for sequence in sequences]
        self._merge(prefill.cache, prefill.mask.repeat_interleave(sizes, dim=0), new_rows)
        self._fail_non_finite(logits, requests)
        for row, (group, sequences) in enumerate(zip(groups, samples, strict=True)):
            if group.request.cancelled:
                continue  # its rows leave the batch before the next step
            # One prompt at a time, so that at most one prompt's scores are held before they
            # are emitted (full-vocabulary prompt_logprobs are large).
            prompt_hidden = final_hidden[row, prefill.padding[row] :]
            try:
                first_delta = self._prompt_outputs(
                    group.request.prepared, prompts[row], prompt_hidden
                )
            except NonFiniteOutput:
                self._fail_request(group.request, _non_finite_failure(group.request))
                continue
            for sequence in sequences:
                sequence.cached_tokens = len(prompts[row])
                self._accept_token(sequence, logits[row], logprobs[row], first_delta)

    def _new_sequence(self, group: PromptGroup, sample: int) -> Sequence:
        prepared = group.request.prepared
        prompt_ids = group.prompt_ids
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
            self.loaded.decoder.lm_head,
            prompt_ids,
            top_k=max(prompt_k, echo_k),
            full_vocab=params.prompt_logprobs == -1,
        )
        names = self.loaded.token_names
        if params.prompt_logprobs is not None:
            delta.prompt_logprobs = vllm_prompt_logprobs(scores, prompt_ids, prompt_k, names)
        if params.echo and params.logprobs is not None:
            delta.logprobs = echo_logprobs(scores, prompt_ids, echo_k, names)
        return delta

    def _decode_step(self) -> None:
        rows = self._active
        device = self.device
        input_ids = torch.tensor([[sequence.output_ids[-1]] for sequence in rows], device=device)
        position_ids = torch.tensor([[sequence.cached_tokens] for sequence in rows], device=device)
        self._mask = torch.cat([self._mask, self._mask.new_ones(len(rows), 1)], dim=1)
        hooks = [sequence.hooks([sequence.cached_tokens]) for sequence in rows]
        final_hidden = self._forward(input_ids, self._mask, position_ids, self._cache, hooks)
        logits = self._logits(final_hidden[:, -1])
        requests = [sequence.request for sequence in rows]
        logprobs = _reported_logprobs(logits, requests)
        self._fail_non_finite(logits, requests)
        for row, sequence in enumerate(rows):
            sequence.cached_tokens += 1
            if not sequence.dropped:
                self._accept_token(sequence, logits[row], logprobs[row])

    def _forward(self, input_ids, mask, position_ids, cache, hooks: list[RowHooks]) -> torch.Tensor:
        """Run the model over left-padded `input_ids` [rows, tokens], appending to `cache`, with
        each row steered and captured as its RowHooks say; the final (normed) hidden states."""
        return self.loaded.decoder.forward(input_ids, mask, position_ids, cache, layer_hooks(hooks))

    def _logits(self, final_hidden: torch.Tensor) -> torch.Tensor:
        """Next-token logits [rows, vocab] as float32 on the CPU, where sampling runs (each
        sequence's generator is a CPU generator)."""
        return self.loaded.decoder.lm_head(final_hidden).float().cpu()

    @property
    def device(self) -> torch.device:
        return self.loaded.decoder.device

    def _accept_token(self, sequence: Sequence, logits, logprobs, first: ChoiceDelta | None = None):
        """Sample the sequence's next token, report it, and finish the sequence if it is done.
        `logprobs` (the row's log-softmax) may be None unless the request reports logprobs."""
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
            name, logprob, top = generated_entry(
                logprobs, sequence.output_ids, params.logprobs, self.loaded.token_names
            )
            delta.logprobs.append(name, logprob, top, offset)
        if params.return_token_ids:
            # As vLLM: the prompt's ids in the first delta (never with echo: check_field_pairs).
            delta.token_ids = [token]
            if first is not None:
                delta.prompt_token_ids = list(sequence.prompt_ids)
        if stop_hit is not None:
            delta.finish_reason, delta.stop_reason = "stop", stop_hit
        elif token in self.loaded.eos_token_ids and not params.ignore_eos:
            delta.finish_reason = "stop"
        elif len(sequence.output_ids) >= params.max_tokens:
            delta.finish_reason = "length"
        delta.text = sequence.text.take_sendable(finished=delta.finish_reason is not None)
        if (
            delta.text
            or delta.logprobs
            or delta.finish_reason
            or delta.prompt_logprobs
            or delta.token_ids
        ):
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
        bf16 = stacked.to(torch.bfloat16).cpu().contiguous()
        return encode_bfloat16_bits(bf16.view(torch.int16).numpy())

    def _merge(self, cache: KVCache, mask: torch.Tensor, sequences: list[Sequence]) -> None:
        """Append the new rows' cache and attention mask [rows, length] (0 on their padding) to
        the batch's, left-padding the shorter side."""
        if self._cache is None:
            self._cache, self._mask = cache, mask
        else:
            self._cache.append_rows(cache)
            length = self._cache.length
            self._mask = torch.cat([_pad_left(self._mask, length), _pad_left(mask, length)])
        self._active.extend(sequences)

    def _drop_finished(self) -> None:
        """Remove finished and cancelled rows, then cache columns that are padding in every row."""
        keep = [row for row, sequence in enumerate(self._active) if not sequence.dropped]
        if len(keep) == len(self._active):
            return
        if not keep:
            self._active, self._cache, self._mask = [], None, None
            return
        index = torch.tensor(keep, device=self.device)
        self._active = [self._active[row] for row in keep]
        self._mask = self._mask[index]
        first_used = int(self._mask.any(dim=0).long().argmax())
        self._mask = self._mask[:, first_used:]
        self._cache.keep_rows(index, first_used)

    def _fail_non_finite(self, logits: torch.Tensor, requests: list[EngineRequest]) -> None:
        """Fail the request of each row of `logits` [rows, vocab] that is not finite: a token
        chosen from NaN logits would be noise, and NaN cannot be reported in JSON."""
        finite = finite_rows(logits)
        if bool(finite.all()):
            return
        for row in (~finite).nonzero().flatten().tolist():
            self._fail_request(requests[row], _non_finite_failure(requests[row]))

    def _fail_request(self, request: EngineRequest, failure: RequestFailed) -> None:
        """End one request with `failure`, reporting the tokens computed for it so far; its
        rows leave the batch at the next step and its waiting prompts are dropped."""
        if request.cancelled:
            return
        running = sum(
            len(sequence.output_ids)
            for sequence in self._active
            if sequence.request is request and not sequence.finished
        )
        completion_tokens = request.completion_tokens + running
        failure.usage = {
            "prompt_tokens": request.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": request.prompt_tokens + completion_tokens,
        }
        request.emit(failure)
        request.cancel()

    def _fail_active(self) -> None:
        failed = {sequence.request for sequence in self._active}
        if self._prefill is not None:
            failed |= {group.request for group in self._prefill.groups}
            self._prefill = None
        for request in failed:
            request.emit(RequestFailed("internal_error", "the model step failed; see engine log"))
            request.cancel()
        self._active, self._cache, self._mask = [], None, None


def _non_finite_failure(request: EngineRequest) -> RequestFailed:
    """The error of a request whose logits came out NaN or infinite. Marked as the request's
    own fault (a 400): steering is what makes the residual stream overflow, and the gateway
    must not count it against the engine's health."""
    cause = (
        "this request's steering (its vectors' values times scale) overflows the residual "
        "stream; lower the scale or the values"
        if request.prepared.steering
        else "the model's forward pass overflowed"
    )
    return RequestFailed(
        "non_finite_output",
        f"the model's logits became NaN or infinite: {cause}",
        status=400,
        error_type="invalid_request_error",
    )


# A prefill runs this many columns of its prompts per scheduler step, with a decode step of
# the running sequences between chunks: a long prompt delays their next token by one chunk's
# time, not by its whole prefill.
PREFILL_CHUNK_TOKENS = 256


@dataclass(eq=False)
class Prefill:
    """Prompt groups being prefilled together: their left-padded prompts, the KV cache and
    final hidden states of the columns done so far."""

    groups: list[PromptGroup]
    samples: list[list[Sequence]]
    prompts: list[list[int]]
    input_ids: torch.Tensor
    mask: torch.Tensor
    position_ids: torch.Tensor
    cache: KVCache
    hidden_chunks: list[torch.Tensor] = field(default_factory=list)
    done: int = 0

    @property
    def width(self) -> int:
        return self.input_ids.shape[1]

    @functools.cached_property
    def padding(self) -> list[int]:
        """Each row's number of padding columns (all on the left)."""
        return [self.width - len(prompt_ids) for prompt_ids in self.prompts]


# Padding a prefill batch may add at most half its real tokens, plus this slack, which keeps
# short prompts together: a 10-token prompt padded to a 2,000-token one would cost almost a
# second prefill of the long one (measured: 2.9 s batched against 1.55 s one after the other).
PADDING_SLACK_TOKENS = 256


def _padding_acceptable(rows: int, longest: int, real_tokens: int) -> bool:
    return rows * longest <= 1.5 * real_tokens + PADDING_SLACK_TOKENS


def _padded_prompts(
    prompts: list[list[int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [prompts, longest] left-padded with id 0 (any id would do: the mask hides it),
    and the attention mask, 0 on padding, both on `device`."""
    length = max(len(prompt_ids) for prompt_ids in prompts)
    input_ids = torch.zeros(len(prompts), length, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for row, prompt_ids in enumerate(prompts):
        input_ids[row, length - len(prompt_ids) :] = torch.tensor(prompt_ids)
        mask[row, length - len(prompt_ids) :] = 1
    return input_ids.to(device), mask.to(device)


def _reported_logprobs(
    logits: torch.Tensor, requests: list[EngineRequest]
) -> list[torch.Tensor | None]:
    """Per row of `logits` [rows, vocab], its log-softmax, or None for every row when no row's
    request reports logprobs: the full-vocabulary pass is skipped in that common case."""
    if all(request.prepared.params.logprobs is None for request in requests):
        return [None] * len(logits)
    return list(torch.log_softmax(logits, dim=-1))


def _pad_left(mask: torch.Tensor, length: int) -> torch.Tensor:
    """Zero-pad an attention mask [rows, columns] on the left up to `length` columns."""
    missing = length - mask.shape[1]
    if missing == 0:
        return mask
    return torch.cat([mask.new_zeros(mask.shape[0], missing), mask], dim=1)
