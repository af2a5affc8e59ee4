"""A cancelled DiT call gives back what its session holds: cancelled while the session is still opening (e.g.
waiting for a cancelled predecessor to release its KV), while grpc.aio writes one of its responses, or while it
cleans up after its request stream ended.

grpc.aio iterates a response-streaming handler that is an async generator and writes each response itself; a
cancel that lands in that write leaves the generator suspended at its `yield`, and its cleanup (`finally`) runs
only when the generator is garbage-collected (grpc/grpc#42295). The stage handlers write their responses
themselves (`context.write`), so the cancel is raised inside them.
"""

import asyncio
import inspect
import threading
import types

import pytest
import torch

from services.tensors.transport import tensor_to_parts
from services.dit.api import HoldConfig
from services.dit.grpc_server import DiTServicer
from vitascope.dit.v1 import dit_pb2

pytestmark = pytest.mark.cpu


class SlowOpenService:
    """`DiTService.open` that blocks until released, as it does while a cancelled predecessor drains."""

    def __init__(self):
        self.entered, self.release = threading.Event(), threading.Event()
        self.sessions = []

    def hold_config(self, enabled, max_seconds):
        return HoldConfig()

    def open(self, config, prompt, fallback):
        self.entered.set()
        self.release.wait(10)
        session = types.SimpleNamespace(cancelled=False)
        session.cancel = lambda: setattr(session, "cancelled", True)
        self.sessions.append(session)
        return session


class OpenService:
    """`DiTService` whose `open` returns a session that records its cancel."""

    def __init__(self):
        self.sessions = []

    def hold_config(self, enabled, max_seconds):
        return HoldConfig()

    def open(self, config, prompt, fallback):
        session = types.SimpleNamespace(cancelled=False, kv=None, canvas=types.SimpleNamespace(width=64, height=64))
        session.cancel = lambda: setattr(session, "cancelled", True)
        session.submit_prompt = session.close_prompts = lambda *args: None
        self.sessions.append(session)
        return session


async def requests():
    yield dit_pb2.StreamRequest(start=dit_pb2.SessionStart(session_id="s", seed=1, width=64, height=64))
    for part in tensor_to_parts(torch.zeros(3, 8)):
        yield dit_pb2.StreamRequest(prompt=dit_pb2.PromptPart(event_id="e0", embedding=part))
    await asyncio.Event().wait()  # the client keeps its request stream open


def test_cancel_during_open_releases_the_session_it_opened():
    service = SlowOpenService()
    servicer = DiTServicer(service, max_phases_ahead=2)
    context = types.SimpleNamespace(invocation_metadata=lambda: ())

    async def main():
        first = asyncio.ensure_future(servicer.Stream(requests(), context))
        await asyncio.to_thread(service.entered.wait, 10)
        first.cancel()  # the client goes away while the open is still waiting
        with pytest.raises(asyncio.CancelledError):
            await first
        service.release.set()
        for _ in range(200):
            if service.sessions and service.sessions[0].cancelled:
                break
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert len(service.sessions) == 1
    assert service.sessions[0].cancelled  # the orphaned session gave its slot back


async def serve_like_grpc_aio(handler_result, context, kept: list) -> None:
    """Run a response-streaming handler as grpc.aio's server does: an async generator is iterated and its responses
    written by the server (and not closed when the call is cancelled meanwhile); a coroutine writes its own."""
    if inspect.isasyncgen(handler_result):
        kept.append(handler_result)  # the server's frames keep it alive
        async for response in handler_result:
            await context.write(response)
    else:
        await handler_result


def test_a_call_cancelled_while_its_first_response_is_written_cancels_its_session():
    service = OpenService()
    servicer = DiTServicer(service, max_phases_ahead=2)
    writing = asyncio.Event()

    async def write(_response):
        writing.set()
        await asyncio.Event().wait()  # the client reads nothing: the write never completes

    context = types.SimpleNamespace(invocation_metadata=lambda: (), write=write)

    async def main():
        kept = []
        call = asyncio.ensure_future(serve_like_grpc_aio(servicer.Stream(requests(), context), context, kept))
        await asyncio.wait_for(writing.wait(), 10)
        call.cancel()  # the client leaves while `started` is being written
        with pytest.raises(asyncio.CancelledError):
            await call
        for _ in range(200):
            if service.sessions[0].cancelled:
                break
            await asyncio.sleep(0.01)
        # checked before asyncio.run's shutdown, which closes the async generators still alive
        assert service.sessions[0].cancelled  # the group's one session slot is free for the next call

    asyncio.run(main())


def test_a_cancel_during_the_end_of_a_stream_still_takes_back_the_session_s_slots():
    # A client's cancel ends its request stream first (the call ends its loop and cleans up), then cancels the
    # call: the cleanup then waits for the session's cancel, and the leases must not be skipped.
    service = OpenService()
    cancelling, release = threading.Event(), threading.Event()

    def slow_cancel(session):
        cancelling.set()
        release.wait(10)
        session.cancelled = True

    ended = []
    leases = types.SimpleNamespace(close=lambda: ended.append(1) or 0, send=None)
    exporter = types.SimpleNamespace(session=lambda consumer: leases)
    servicer = DiTServicer(service, max_phases_ahead=2, exporter=exporter)

    async def ending_requests():
        yield dit_pb2.StreamRequest(start=dit_pb2.SessionStart(session_id="s", seed=1, width=64, height=64))
        for part in tensor_to_parts(torch.zeros(3, 8)):
            yield dit_pb2.StreamRequest(prompt=dit_pb2.PromptPart(event_id="e0", embedding=part))

    async def write(_response):
        pass

    context = types.SimpleNamespace(invocation_metadata=lambda: (), write=write)

    async def main():
        original_open = service.open

        def open_slow(*args):
            session = original_open(*args)
            session.cancel = lambda: slow_cancel(session)
            return session

        service.open = open_slow
        call = asyncio.ensure_future(servicer.Stream(ending_requests(), context))
        assert await asyncio.to_thread(cancelling.wait, 10)  # the stream ended: the call cleans up
        call.cancel()  # ... and now the call is cancelled too
        with pytest.raises(asyncio.CancelledError):
            await call
        release.set()
        assert ended == [1]  # the leases ended even so

    asyncio.run(main())
