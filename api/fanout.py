"""A steered request of several sequences (several prompts, or n > 1) is sent upstream as one
request per sequence, and the answers are merged into the one public answer (so is a stream
with echo, logprobs and n > 1, which vLLM fails: `needed`).

vLLM-Lens applies a request's steering to its first sequence only and answers 200 with the
others unsteered (measured: the second of two prompts, and both choices of n = 2, scored as
if no vector had been sent). A request of one sequence is steered alike on every upstream, so
the gateway never sends a steered request of more than one; the engine gets the same split,
so that both upstreams see the same requests. The merged answer is the one an upstream would
have given the request whole: choice `index` = prompt × n + sample, usage with each prompt's
tokens counted once (as for a request with n > 1), sample j of a seeded request drawn with
the upstream seed + j (vLLM's own rule for n > 1, `dialect.upstream_seed`).
"""

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

from . import upstream
from .errors import ApiError


async def send_completion(valid, body: dict, *, tenant: str) -> upstream.UpstreamReply:
    """The upstream's answer to `body` (the upstream body of `valid`, an
    `api.validation.ValidCompletion`): `upstream.send_completion`'s, or the merged answer of
    one request per sequence where `needed`."""
    if not needed(valid):
        return await upstream.send_completion(valid.urls, body, tenant=tenant)
    bodies = sequence_bodies(body, prompts=valid.request.prompts(), n=valid.request.n)
    return await _send_each(valid.urls, bodies, tenant=tenant, n=valid.request.n)


def open_stream(valid, body: dict, *, tenant: str):
    """`upstream.open_stream` of `body` (the upstream body of `valid`), or the merged stream
    of one request per sequence where `needed`."""
    if not needed(valid):
        return upstream.open_stream(valid.urls, body, tenant=tenant)
    bodies = sequence_bodies(body, prompts=valid.request.prompts(), n=valid.request.n)
    return _open_each(valid.urls, bodies, tenant=tenant, n=valid.request.n)


def needed(valid) -> bool:
    """Whether `valid` (an `api.validation.ValidCompletion`) is sent one sequence at a time:
    a steered request of several sequences, and a stream with echo, logprobs and n > 1,
    which vLLM 0.32 fails in most runs (an error frame whose message is the prompt's first
    token id, 4 of 6 times; with n = 1 never: tests/differential found it)."""
    request = valid.request
    if valid.completions == 1:
        return False
    echoed_samples = request.n > 1 and request.stream and request.echo
    return bool(request.apply_steering_vectors) or (echoed_samples and request.logprobs is not None)


def sequence_bodies(body: dict, *, prompts: list, n: int) -> list[dict]:
    """The upstream body `body` (of `prompts` × `n` sequences) as one body per sequence, in
    choice order."""
    seed = body.get("seed")
    return [
        {
            **body,
            "prompt": prompt,
            "n": 1,
            **({"seed": seed + sample} if seed is not None else {}),
        }
        for prompt in prompts
        for sample in range(n)
    ]


def _usage(usages: list[dict | None], *, n: int) -> dict:
    """The usage of the whole request from each sequence's (None: it reported none): every
    sequence's generated tokens, and each prompt's tokens once, as for a request with n > 1."""
    usages = [usage or {} for usage in usages]
    prompt_tokens = sum(
        max(int(usage.get("prompt_tokens") or 0) for usage in usages[first : first + n])
        for first in range(0, len(usages), n)
    )
    completion_tokens = sum(int(usage.get("completion_tokens") or 0) for usage in usages)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


async def _send_each(urls: list[str], bodies: list[dict], *, tenant: str, n: int):
    """Every body of `sequence_bodies` sent at once; the merged answer as an
    `upstream.UpstreamReply` (`content` None: it is not the upstream's bytes). Every sequence
    is waited for, so that a failure of one is billed with the others' usage; the first
    failure is raised, carrying that usage."""
    replies = await asyncio.gather(
        *(upstream.send_completion(urls, body, tenant=tenant) for body in bodies),
        return_exceptions=True,
    )
    failures = [reply for reply in replies if isinstance(reply, BaseException)]
    if failures:
        raise _billed(failures[0], replies, n=n)
    merged = {**replies[0].body, "choices": [], "usage": _usage(_usages(replies), n=n)}
    for index, reply in enumerate(replies):
        merged["choices"] += [{**choice, "index": index} for choice in reply.body["choices"]]
    upstream_ms = max(reply.upstream_ms for reply in replies)
    return upstream.UpstreamReply(None, merged, upstream_ms)


def _usages(replies: list) -> list[dict | None]:
    """Each sequence's usage: its answer's, or the one its failure carries."""
    return [
        (reply.usage if isinstance(reply, ApiError) else None)
        if isinstance(reply, BaseException)
        else reply.body.get("usage")
        for reply in replies
    ]


def _billed(failure: BaseException, replies: list, *, n: int) -> BaseException:
    """`failure`, where it is an ApiError, carrying the usage of every sequence (those that
    were answered, and what the failed ones reported)."""
    if isinstance(failure, ApiError):
        usage = _usage(_usages(replies), n=n)
        failure.usage = {field: usage[field] for field in ("prompt_tokens", "completion_tokens")}
    return failure


@asynccontextmanager
async def _open_each(urls: list[str], bodies: list[dict], *, tenant: str, n: int):
    """Every body of `sequence_bodies` streamed at once; yields one iterator of `data:`
    payloads as `upstream.open_stream`'s, each sequence's chunks as they arrive with their
    choice's index, one usage frame for the whole request (where the upstreams sent theirs)
    and one `[DONE]` after every sequence's."""
    async with AsyncExitStack() as stack:
        # Every open is waited for, so that none is entered after a failure closed the stack.
        streams = await asyncio.gather(
            *(
                stack.enter_async_context(upstream.open_stream(urls, body, tenant=tenant))
                for body in bodies
            ),
            return_exceptions=True,
        )
        for stream in streams:
            if isinstance(stream, BaseException):
                raise stream
        yield _merged(streams, n=n)


async def _merged(streams: list, *, n: int) -> AsyncIterator[bytes]:
    # Bounded: a sequence's upstream waits while the client reads slowly, as a single stream's.
    queue: asyncio.Queue = asyncio.Queue(maxsize=2 * len(streams))

    async def pump(index: int, stream) -> None:
        try:
            async for payload in stream:
                await queue.put((index, payload))
        except Exception as failure:  # handed to the consumer, which raises it
            await queue.put((index, failure))
        else:
            await queue.put((index, None))

    pumps = [asyncio.create_task(pump(index, stream)) for index, stream in enumerate(streams)]
    usages: list[dict | None] = [None] * len(streams)
    try:
        running = len(streams)
        while running:
            index, payload = await queue.get()
            if payload is None:
                running -= 1
            elif isinstance(payload, BaseException):
                raise payload
            elif payload != b"[DONE]":
                frame = json.loads(payload)
                if "error" in frame:
                    yield payload
                elif not frame.get("choices") and frame.get("usage"):
                    usages[index] = frame
                else:
                    for choice in frame.get("choices") or ():
                        choice["index"] = index
                    yield json.dumps(frame, separators=(",", ":")).encode()
        if all(usages):
            usage = _usage([frame["usage"] for frame in usages], n=n)
            yield json.dumps({**usages[0], "usage": usage}, separators=(",", ":")).encode()
        yield b"[DONE]"
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
