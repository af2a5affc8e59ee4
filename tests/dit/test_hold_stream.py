"""A DiT session that holds at a request boundary (an infinite hold, for a newer prompt) ends with its call: a bad
prompt update gives the call its error at once, and the end of the request stream ends the hold. The real
`DiTServicer` over in-process gRPC, the real tiny runtime on the CPU behind it."""
import asyncio

import grpc
import pytest
import torch

from services.tensors.transport import tensor_to_parts
from services.dit.api import HoldConfig
from services.dit.grpc_server import DiTServicer
from vitascope.dit.v1 import dit_pb2, dit_pb2_grpc
from tests.dit.factories import TINY, tiny_model, tiny_runtime

pytestmark = pytest.mark.cpu

ARGS = TINY
PHASES_PER_REQUEST = 4


class TinyDiT:
    """What the servicer asks of the DiT service, over the real tiny runtime."""

    def __init__(self) -> None:
        model = tiny_model()
        self.runtime = tiny_runtime(model=model)

    def hold_config(self, enabled: bool, max_seconds: float) -> HoldConfig:
        return HoldConfig(enabled=enabled, max_seconds=max_seconds or None, poll_seconds=0.02)

    def open(self, config, prompt, fallback):
        return self.runtime.open_session(config, prompt, fallback)


async def held_call(channel) -> grpc.aio.StreamStreamCall:
    """A session with an infinite hold, read through request 0: it now holds for a newer prompt."""
    call = dit_pb2_grpc.DiTStub(channel).Stream()
    await call.write(dit_pb2.StreamRequest(start=dit_pb2.SessionStart(
        session_id="held", seed=1, width=64, height=64, hold=dit_pb2.Hold(enabled=True))))
    for part in tensor_to_parts(torch.randn(3, ARGS.text_dim)):
        await call.write(dit_pb2.StreamRequest(prompt=dit_pb2.PromptPart(event_id="e0", embedding=part)))
    phases = 0
    while phases < PHASES_PER_REQUEST:
        reply = await asyncio.wait_for(call.read(), 60)
        assert reply is not grpc.aio.EOF
        if reply.WhichOneof("kind") == "phase_end":
            phases += 1
            await call.write(dit_pb2.StreamRequest(ack=dit_pb2.PhaseAck(request_index=0, phase_index=phases - 1)))
    return call


@pytest.fixture
async def dit():
    service = TinyDiT()
    server = grpc.aio.server()
    dit_pb2_grpc.add_DiTServicer_to_server(DiTServicer(service, max_phases_ahead=8), server)
    addr = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    async with grpc.aio.insecure_channel(addr) as channel:
        yield service, channel
    await server.stop(0)


async def test_a_bad_prompt_update_during_a_hold_fails_the_call_at_once(dit):
    service, channel = dit
    call = await held_call(channel)
    await asyncio.sleep(0.2)  # holding
    for part in tensor_to_parts(torch.zeros(3, ARGS.text_dim + 1)):  # one column too wide
        await call.write(dit_pb2.StreamRequest(prompt=dit_pb2.PromptPart(event_id="bad", embedding=part)))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        while await asyncio.wait_for(call.read(), 10) is not grpc.aio.EOF:
            pass
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "embedding width" in err.value.details() and str(ARGS.text_dim + 1) in err.value.details()
    await asyncio.sleep(0.2)
    assert service.runtime.active_session is None  # the held session is gone with its call


async def test_the_end_of_the_request_stream_ends_a_hold(dit):
    service, channel = dit
    call = await held_call(channel)
    await asyncio.sleep(0.2)  # holding: no newer prompt can come once the client stops writing
    await call.done_writing()
    replies = []
    while (reply := await asyncio.wait_for(call.read(), 30)) is not grpc.aio.EOF:
        replies.append(reply)
    assert await call.code() == grpc.StatusCode.OK
    assert sum(r.WhichOneof("kind") == "phase_end" for r in replies) <= 1  # at most the phase under way
    await asyncio.sleep(0.2)
    assert service.runtime.active_session is None
