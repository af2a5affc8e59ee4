"""Review regression: a DiT call cancelled while the session is still opening (e.g. waiting for a cancelled
predecessor to release its KV) must not leave the newly opened session holding the group's one slot."""

import asyncio
import threading
import types

import pytest
import torch

from services.common.transport import tensor_to_parts
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
