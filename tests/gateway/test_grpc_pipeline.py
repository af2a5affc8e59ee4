"""The gateway's gRPC pipeline against fake stage calls (no servers): cancelling, ended streams, timings."""
import asyncio

import pytest

from services.gateway import grpc_pipeline
from services.gateway.pipeline import HoldSettings, SessionRequest
from vitascope.common.v1 import tensor_pb2
from vitascope.dit.v1 import dit_pb2
from vitascope.vae.v1 import vae_pb2

pytestmark = pytest.mark.cpu


class _FakeCall:
    """Stands in for a grpc.aio stream-stream call."""

    def __init__(self, *, first_reply=None, block_writes: bool = False):
        self.cancelled = False
        self._first = first_reply
        self._block = block_writes

    async def write(self, _message):
        if self._block:
            await asyncio.Event().wait()

    async def read(self):
        return self._first

    def cancel(self):
        self.cancelled = True
        return True

    def done(self):
        return self.cancelled


class _Stub:
    def __init__(self, call):
        self.call = call

    def Stream(self, metadata=None):  # noqa: N802 - gRPC method name
        return self.call

    Decode = Stream


async def test_cancelling_open_after_the_dit_accepted_cancels_the_dit_call():
    dit_call = _FakeCall(first_reply=dit_pb2.StreamResponse(started=dit_pb2.Started()))
    vae_call = _FakeCall(block_writes=True)  # the VAE never takes the start: open() hangs there
    pipeline = grpc_pipeline.GrpcPipeline.__new__(grpc_pipeline.GrpcPipeline)
    pipeline.drain_timeout_s = 1.0
    pipeline.dit, pipeline.vae = _Stub(dit_call), _Stub(vae_call)
    request = SessionRequest(request_id="video_stream-test", prompt="p", seed=1, width=64, height=48, fps=24,
                             hold=HoldSettings())
    session = grpc_pipeline.GrpcSession(pipeline, request, 0.0, grpc_pipeline.tracing.SpanContext.new_root())
    task = asyncio.create_task(session.open([], None))
    for _ in range(20):
        await asyncio.sleep(0)
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert dit_call.cancelled, "the DiT call must be cancelled when open() is cancelled"
    assert vae_call.cancelled


async def test_update_after_the_dit_stream_ended_is_a_pipeline_error():
    class _FinishedCall(_FakeCall):
        async def write(self, _message):
            raise asyncio.InvalidStateError("RPC already finished")

    class _Encoder:
        async def encode(self, *_args):
            return [tensor_pb2.TensorPart()], 0.0

        async def release_embeddings(self, _parts):  # host parts hold no encoder slot
            pass

    pipeline = _Encoder()
    request = SessionRequest(request_id="video_stream-test", prompt="p", seed=1, width=64, height=48, fps=24)
    session = grpc_pipeline.GrpcSession(pipeline, request, 0.0, grpc_pipeline.tracing.SpanContext.new_root())
    session._dit_call = _FinishedCall()
    with pytest.raises(grpc_pipeline.PipelineError, match="already ended"):
        await session.update_prompt("e1", "new prompt")


async def test_prompt_encode_seconds_ride_on_the_request_that_installs_the_prompt():
    # Three updates sent during request 0 are installed together at request 1. Their encode seconds were handed
    # out one per request instead, so requests 2 and 3, which encoded nothing, reported text seconds; and an
    # update whose write to the DiT failed left seconds behind for a later request.
    class _Calls(_FakeCall):
        def __init__(self, replies=(), fail_writes=False):
            super().__init__()
            self._replies, self.fail_writes = list(replies), fail_writes

        async def write(self, _message):
            if self.fail_writes:
                raise asyncio.InvalidStateError("RPC already finished")

        async def read(self):
            return self._replies.pop(0) if self._replies else grpc_pipeline.grpc.aio.EOF

    class _Encoder:
        async def encode(self, *_args):
            await asyncio.sleep(0.02)
            return [tensor_pb2.TensorPart()], 0.0

        async def release_embeddings(self, _parts):
            pass

    request = SessionRequest(request_id="video_stream-test", prompt="p", seed=1, width=64, height=48, fps=24)
    session = grpc_pipeline.GrpcSession(_Encoder(), request, 0.5, grpc_pipeline.tracing.SpanContext.new_root())
    session._dit_call = _Calls()
    for event_id in ("e1", "e2", "e3"):
        await session.update_prompt(event_id, f"prompt {event_id}")
    session._dit_call.fail_writes = True
    with pytest.raises(grpc_pipeline.PipelineError):
        await session.update_prompt("lost", "never reaches the DiT")
    session._dit_call.fail_writes = False
    completed = {1: ["e1", "e2", "e3"]}
    session._metas.extend(dit_pb2.PhaseMeta(request_index=k, phase_index=0, first_of_request=True,
                                            completed_event_ids=completed.get(k, [])) for k in range(4))
    session._vae_call = _Calls([vae_pb2.DecodeResponse(data=b"x", phase_done=vae_pb2.ChunkEnd(), num_frames=1)
                                for _ in range(4)])
    text = [chunk.timings.text async for chunk in session.chunks()]
    assert text[0] == 0.5
    assert text[1] >= 0.06
    assert text[2:] == [0.0, 0.0], text
