"""Live run output through Redis: one Redis Stream per run, kept for `STREAM_TTL` seconds.

The worker appends events with `publish`; the web process reads them with `follow`, which
first replays everything already there and then blocks for the rest, so a page reloaded
mid-run resumes where it was. Events are small JSON objects with a `type`:
`status` ({"status"}), `token` ({"choice", "text"}), `end` ({"status", "error"?}).
"""

import json

import redis
import redis.asyncio as redis_async
from django.conf import settings

STREAM_TTL = 3600
# How long one blocking read waits before the caller sends a keepalive.
FOLLOW_BLOCK_MS = 15_000

_sync_client = None


def stream_key(run_id) -> str:
    return f"playground:run:{run_id}"


def _client() -> redis.Redis:
    global _sync_client
    if _sync_client is None:
        _sync_client = redis.Redis.from_url(settings.REDIS_URL)
    return _sync_client


def publish(run_id, event: dict) -> None:
    """Append one event to the run's stream and refresh its expiry."""
    key = stream_key(run_id)
    pipe = _client().pipeline(transaction=False)
    pipe.xadd(key, {"event": json.dumps(event)})
    pipe.expire(key, STREAM_TTL)
    pipe.execute()


def reset(run_id) -> None:
    """Drop what a failed attempt published, before a retry publishes again."""
    _client().delete(stream_key(run_id))


def replay(run_id) -> list[dict]:
    """Every event published so far (synchronous; for tests and the run page)."""
    return [json.loads(fields[b"event"]) for _, fields in _client().xrange(stream_key(run_id))]


async def exists(run_id) -> bool:
    """Whether the run's stream is still kept (it expires `STREAM_TTL` after the last event)."""
    client = redis_async.Redis.from_url(settings.REDIS_URL)
    try:
        return bool(await client.exists(stream_key(run_id)))
    finally:
        await client.aclose()


async def follow(run_id, *, after: str = "0", block_ms: int = FOLLOW_BLOCK_MS):
    """Yield `(entry_id, event)` from the start (or after `after`) until an `end` event;
    yield `(None, None)` whenever `block_ms` passes with nothing new."""
    client = redis_async.Redis.from_url(settings.REDIS_URL)
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
