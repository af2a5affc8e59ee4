"""Regression tests for gateway bugs found in review: each one failed before its fix.

- Numbers too large for a float, and JSON integers too long for Python's int parser, escaped the protocol
  parser as OverflowError / ValueError instead of a ProtocolError; during a running session that killed the
  frame reader and the session with it.
- A prompt update whose backend call raised something other than a PipelineError killed the update task
  silently: no reply for that update, and every later update was never forwarded.
- Cancelling `GrpcSession.open()` after the DiT accepted the session left the DiT call (and its slot) open.
- NaN and Infinity (accepted by Python's JSON parser) were echoed in video.start as text no browser can parse.
- Prompt encode seconds were handed out one per request, not with the request that installed the prompt.
"""
import asyncio

import aiohttp
import pytest

from services.gateway import grpc_pipeline
from services.gateway.pipeline import HoldSettings, SessionRequest
from services.gateway.protocol import ErrorCode, MessageLimits, ProtocolError, parse_client_text
from tests.gateway.fakes import (
    FakeBehaviour,
    FakePipeline,
    Transcript,
    read_until,
    running_gateway,
    small_config,
    ws_url,
)
from vitascope.common.v1 import tensor_pb2
from vitascope.dit.v1 import dit_pb2
from vitascope.vae.v1 import vae_pb2

pytestmark = pytest.mark.cpu

LIMITS = MessageLimits(max_start_bytes=1 << 20, max_interaction_bytes=1 << 16, max_prompt_chars=200)
HUGE_INT = "9" * 400  # valid JSON, a Python int, too large for a float
TOO_LONG_INT = "1" * 5000  # valid JSON, above Python's int-string conversion limit


@pytest.mark.parametrize("field", ["guidance_scale"])
def test_number_too_large_for_float_is_a_protocol_error(field):
    text = f'{{"type": "session.start", "prompt": "p", "{field}": {HUGE_INT}}}'
    with pytest.raises(ProtocolError) as info:
        parse_client_text(text, LIMITS)
    assert info.value.code in (ErrorCode.INVALID_TYPE, ErrorCode.INVALID_VALUE)
    assert field in info.value.message


def test_hold_seconds_too_large_for_float_is_a_protocol_error():
    text = (f'{{"type": "session.start", "prompt": "p", "extra_params": '
            f'{{"hold_for_prompt": true, "hold_max_seconds": {HUGE_INT}}}}}')
    with pytest.raises(ProtocolError) as info:
        parse_client_text(text, LIMITS)
    assert "hold_max_seconds" in info.value.message


def test_integer_literal_too_long_to_parse_is_invalid_json():
    text = f'{{"type": "session.start", "prompt": "p", "seed": {TOO_LONG_INT}}}'
    with pytest.raises(ProtocolError) as info:
        parse_client_text(text, LIMITS)
    assert info.value.code == ErrorCode.INVALID_JSON


@pytest.mark.parametrize("bad_frame", [
    f'{{"type": "session.start", "prompt": "p", "guidance_scale": {HUGE_INT}}}',
    f'{{"type": "session.ping", "n": {TOO_LONG_INT}}}',
])
async def test_unparsable_number_during_a_session_is_an_error_and_the_session_continues(bad_frame):
    pipeline = FakePipeline(FakeBehaviour(num_chunks=6, chunk_delay_s=0.05))
    async with running_gateway(small_config(max_interaction_bytes=64 * 1024), pipeline) as server:
        t = Transcript()
        async with aiohttp.ClientSession() as http, http.ws_connect(ws_url(server)) as ws:
            await ws.send_json({"type": "session.start", "prompt": "fine prompt"})
            await read_until(ws, t, until="video.chunk_metadata")
            await ws.send_str(bad_frame)
            error = await read_until(ws, t, until="error")
            done = await read_until(ws, t, until="session.done")
    assert error is not None and error["code"] in ("invalid_type", "invalid_value", "invalid_json",
                                                   "session_already_started")
    assert done is not None and done["stopped"] is False and done["chunks"] >= 6


class _BrokenUpdatePipeline(FakePipeline):
    """update_prompt raises a non-PipelineError for the prompt 'explode'."""

    async def start(self, request):
        session = await super().start(request)
        original = session.update_prompt

        async def update_prompt(event_id: str, prompt: str) -> None:
            if prompt == "explode":
                raise asyncio.InvalidStateError("RPC already finished")
            await original(event_id, prompt)

        session.update_prompt = update_prompt
        return session


async def test_unexpected_update_failure_is_reported_and_later_updates_still_flow():
    pipeline = _BrokenUpdatePipeline(FakeBehaviour(num_chunks=12, chunk_delay_s=0.05))
    async with running_gateway(small_config(), pipeline) as server:
        t = Transcript()
        async with aiohttp.ClientSession() as http, http.ws_connect(ws_url(server)) as ws:
            await ws.send_json({"type": "session.start", "prompt": "fine prompt"})
            await read_until(ws, t, until="video.chunk_metadata")
            await ws.send_json({"type": "session.interaction",
                                "interaction": {"event_id": "bad", "event": {"prompt": "explode"}}})
            error = await read_until(ws, t, until="error")
            await ws.send_json({"type": "session.interaction",
                                "interaction": {"event_id": "good", "event": {"prompt": "a later update"}}})
            queued = await read_until(ws, t, until="session.interaction.queued")
            await read_until(ws, t, until="session.done")
    assert error is not None and error["code"] == "interaction_failed" and error["event_id"] == "bad"
    assert error["fault"] == "server"  # the gateway failed the update, not the client
    assert queued is not None and queued["event_id"] == "good"


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


@pytest.mark.parametrize("text", [
    '{"type": "session.start", "prompt": "a \\ud800 lake"}',
    '{"type": "session.start", "prompt": "ok", "extra_params": {"hold_for_prompt": true, '
    '"hold_fallback_prompt": "x\\udfff"}}',
    '{"type": "session.interaction", "interaction": {"event": {"prompt": "\\ud83d"}}}',
    '{"type": "session.interaction", "interaction": {"event_id": "e\\ud800", "event": {"prompt": "fine"}}}',
])
def test_text_that_is_not_valid_unicode_is_rejected_before_any_stage(text):
    # JSON escapes can spell lone surrogates; protobuf (and so every stage call) cannot encode them.
    with pytest.raises(ProtocolError) as info:
        parse_client_text(text, LIMITS)
    assert info.value.code == ErrorCode.INVALID_VALUE
    assert "Unicode" in info.value.message




@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_are_not_json_and_are_never_echoed(constant):
    # Python's parser takes them; echoed back in video.start they made the reply unreadable to browsers.
    text = f'{{"type": "session.start", "prompt": "p", "extra_params": {{"strength": {constant}}}}}'
    with pytest.raises(ProtocolError) as info:
        parse_client_text(text, LIMITS)
    assert info.value.code == ErrorCode.INVALID_JSON
    assert constant in info.value.message


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
    session._vae_call = _Calls([vae_pb2.DecodeResponse(data=b"x", last=True, num_frames=1) for _ in range(4)])
    text = [chunk.timings.text async for chunk in session.chunks()]
    assert text[0] == 0.5
    assert text[1] >= 0.06
    assert text[2:] == [0.0, 0.0], text
