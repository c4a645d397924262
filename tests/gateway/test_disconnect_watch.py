"""The completions app's watch for a client that leaves (`_cancel_on_disconnect`): the
request's work is cancelled only when the client disconnects before its response is complete;
the server's own cancellation (a shutdown) still goes through."""

import asyncio

import pytest

from api.completions_app import _cancel_on_disconnect, _Reply


class Client:
    """uvicorn's `receive` for a request whose body was read: it waits, then answers
    http.disconnect once `leave()` is called (the client closed its connection, or uvicorn
    completed the response)."""

    def __init__(self):
        self.gone = asyncio.Event()

    def leave(self):
        self.gone.set()

    async def receive(self):
        await self.gone.wait()
        return {"type": "http.disconnect"}


async def no_send(message):
    pass


async def test_work_is_cancelled_when_the_client_leaves_first():
    client, reply, steps = Client(), _Reply(no_send, "req_1"), []

    async def work():
        try:
            client.leave()
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            steps.append("settled as 499")
            raise

    await asyncio.wait_for(_cancel_on_disconnect(work(), reply, client.receive), 5)
    assert steps == ["settled as 499"] and reply.client_gone
    assert asyncio.current_task().cancelling() == 0


async def test_work_after_a_complete_response_is_not_cancelled():
    client, reply, steps = Client(), _Reply(no_send, "req_2"), []

    async def work():
        reply.complete = True  # its last byte sent, as _Reply.result and _Reply.stream mark it
        client.leave()  # uvicorn answers http.disconnect once the response is complete
        await asyncio.sleep(0.05)  # e.g. a stream's generator closing
        steps.append("finished")

    await _cancel_on_disconnect(work(), reply, client.receive)
    assert steps == ["finished"] and not reply.client_gone


async def test_the_servers_cancellation_goes_through():
    client, reply = Client(), _Reply(no_send, "req_3")
    request = asyncio.ensure_future(_cancel_on_disconnect(asyncio.sleep(10), reply, client.receive))
    await asyncio.sleep(0.01)
    request.cancel()
    with pytest.raises(asyncio.CancelledError):
        await request
