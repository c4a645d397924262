"""infra.redis.CommandBatcher: the commands of one turn of the event loop go to Redis as
one pipeline, and each caller gets its own reply or error."""

import asyncio

import hiredis
import pytest
import redis.asyncio as aioredis
from django.conf import settings
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import DataError, RedisError, ResponseError

from infra import background
from infra.redis import CommandBatcher, redis_async

SCRIPT = "return redis.call('INCR', KEYS[1])"


@pytest.fixture
async def client(redis_client):
    client = aioredis.Redis.from_url(settings.REDIS_URL)
    yield client
    await client.aclose()


@pytest.fixture
def exchanges(client, monkeypatch):
    """The exchanges with Redis: ("alone", command) or ("pipeline", number of commands)."""
    seen = []
    execute_command, pipeline = client.execute_command, client.pipeline

    async def alone(*args, **options):
        seen.append(("alone", args[0]))
        return await execute_command(*args, **options)

    def counted_pipeline(**options):
        made = pipeline(**options)
        execute = made.execute

        async def counted(**execute_options):
            seen.append(("pipeline", len(made.command_stack)))
            return await execute(**execute_options)

        made.execute = counted
        return made

    monkeypatch.setattr(client, "execute_command", alone)
    monkeypatch.setattr(client, "pipeline", counted_pipeline)
    return seen


async def test_commands_of_one_turn_go_as_one_pipeline_and_each_gets_its_reply(client, exchanges):
    batcher = CommandBatcher(client)
    await client.set("greeting", "hello")
    replies = await asyncio.gather(
        *(batcher.execute("INCR", "counter") for _ in range(20)),
        batcher.execute("GET", "greeting"),
    )
    assert replies == [*range(1, 21), b"hello"]
    assert exchanges == [("alone", "SET"), ("pipeline", 21)]


async def test_a_command_alone_in_its_turn_is_sent_alone(client, exchanges):
    batcher = CommandBatcher(client)
    assert await batcher.execute("INCR", "counter") == 1
    assert await batcher.execute("INCR", "counter") == 2
    assert exchanges == [("alone", "INCR"), ("alone", "INCR")]


async def test_a_reply_error_fails_only_its_own_command(client):
    batcher = CommandBatcher(client)
    await client.set("text", "not a number")
    replies = await asyncio.gather(
        batcher.execute("INCR", "text"), batcher.execute("INCR", "counter"), return_exceptions=True
    )
    assert isinstance(replies[0], ResponseError)
    assert replies[1] == 1


async def test_a_script_redis_does_not_know_is_loaded(client):
    await client.script_flush()
    script = client.register_script(SCRIPT)
    batcher = CommandBatcher(client)
    assert await batcher.script(script, ["counter"], []) == 1
    assert await batcher.script(script, ["counter"], []) == 2
    assert await client.script_exists(script.sha) == [True]


async def test_an_unreachable_redis_fails_every_command_of_the_turn():
    unreachable = aioredis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=1)
    batcher = CommandBatcher(unreachable)
    replies = await asyncio.gather(
        batcher.execute("GET", "a"), batcher.execute("GET", "b"), return_exceptions=True
    )
    assert all(isinstance(reply, RedisConnectionError) for reply in replies)
    assert all(isinstance(reply, RedisError) for reply in replies)
    await unreachable.aclose()


async def test_a_caller_that_leaves_does_not_take_the_others_replies(client):
    batcher = CommandBatcher(client)
    leaving = asyncio.ensure_future(batcher.execute("INCR", "counter"))
    staying = asyncio.ensure_future(batcher.execute("INCR", "counter"))
    leaving.cancel()
    assert await staying == 2  # the cancelled caller's command still ran


async def test_a_script_runs_whether_or_not_its_reply_is_awaited(client):
    script = client.register_script(SCRIPT)
    batcher = CommandBatcher(client)
    batcher.script(script, ["counter"], [])  # as a request's admission release
    while background.pending():
        await asyncio.sleep(0.01)
    assert await client.get("counter") == b"1"


@pytest.mark.parametrize(
    "args",
    [
        ("EVALSHA", "a" * 40, 2, "acs:adm:{7}:run", "acs:adm:{7}:wait", "token", 16, 30_000),
        ("ZADD", "scores", 0.1 + 0.2, "élan", -3, b"\xff\x00"),
        ("SET", "big", 10**20),
        ("CLIENT SETNAME", "gateway"),
    ],
)
async def test_commands_are_packed_by_hiredis_as_redis_py_packs_them(args, monkeypatch):
    packed_by_hiredis = []
    pack_command = hiredis.pack_command
    monkeypatch.setattr(
        hiredis, "pack_command", lambda a: packed_by_hiredis.append(a[0]) or pack_command(a)
    )
    packing = redis_async().connection_pool.connection_class()
    plain = aioredis.Connection()
    assert b"".join(packing.pack_command(*args)) == b"".join(plain.pack_command(*args))
    assert packing.pack_commands([args, args]) == [b"".join(plain.pack_commands([args, args]))]
    assert packed_by_hiredis == ([] if " " in args[0] else [args[0]] * 3)


async def test_a_bad_argument_is_refused_as_redis_py_refuses_it():
    with pytest.raises(DataError, match="NoneType"):
        redis_async().connection_pool.connection_class().pack_command("SET", "key", None)
