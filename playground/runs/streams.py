"""Live run output through Redis: one Redis Stream per run, kept for `STREAM_TTL` seconds.

The worker appends events with `publish`; the web process reads them with `follow`, which
first replays everything already there and then blocks for the rest, so a page reloaded
mid-run resumes where it was. Events are small JSON objects with a `type`: `status`
({"status", "label": the status as pages name it}), `token` ({"choice", "text"}), `end`
({"status", "error"?}).
"""

import json
import re

from django.conf import settings

from infra.redis import redis_async_dedicated, redis_sync

STREAM_TTL = 3600
# How much longer than a blocking read the socket waits for Redis's answer: below the block,
# redis-py's default (5 s) cuts every idle read with a TimeoutError.
SOCKET_TIMEOUT_MARGIN_S = 10
# A Redis stream entry id, `<milliseconds>-<sequence>`, both unsigned 64-bit.
_ENTRY_ID = re.compile(r"([0-9]{1,20})-([0-9]{1,20})")


def stream_key(run_id) -> str:
    return f"playground:run:{run_id}"


def publish(run_id, event: dict) -> None:
    """Append one event to the run's stream and refresh its expiry."""
    key = stream_key(run_id)
    pipe = redis_sync().pipeline(transaction=False)
    pipe.xadd(key, {"event": json.dumps(event)})
    pipe.expire(key, STREAM_TTL)
    pipe.execute()


def reset(run_id) -> None:
    """Drop what a failed attempt published, before a retry publishes again."""
    redis_sync().delete(stream_key(run_id))


def _follow_client():
    """A client for the web process's reads, whose socket outlasts `follow`'s blocking read."""
    return redis_async_dedicated(
        socket_timeout=settings.PLAYGROUND_SSE_KEEPALIVE_SECONDS + SOCKET_TIMEOUT_MARGIN_S
    )


def resume_after(last_event_id: str | None) -> str:
    """Where `follow` resumes for a `Last-Event-ID` header: after that entry when it is one
    of ours, else from the start (Redis refuses a malformed id, which would end the stream)."""
    match = _ENTRY_ID.fullmatch(last_event_id or "")
    if match is None or any(int(part) >= 2**64 for part in match.groups()):
        return "0"
    return last_event_id


async def exists(run_id) -> bool:
    """Whether the run's stream is still kept (it expires `STREAM_TTL` after the last event)."""
    client = _follow_client()
    try:
        return bool(await client.exists(stream_key(run_id)))
    finally:
        await client.aclose()


async def follow(run_id, *, after: str = "0"):
    """Yield `(entry_id, event)` from the start (or after `after`, an entry id) until an
    `end` event; yield `(None, None)` whenever PLAYGROUND_SSE_KEEPALIVE_SECONDS pass with
    nothing new, so that the caller can send a keepalive."""
    client = _follow_client()
    block_ms = max(int(settings.PLAYGROUND_SSE_KEEPALIVE_SECONDS * 1000), 1)
    key = stream_key(run_id)
    try:
        while True:
            answer = await client.xread({key: after}, block=block_ms, count=500)
            if not answer:
                yield None, None
                continue
            for entry_id, fields in answer[0][1]:
                after = entry_id.decode()
                event = json.loads(fields[b"event"])
                yield after, event
                if event.get("type") == "end":
                    return
    finally:
        await client.aclose()
