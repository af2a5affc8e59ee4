"""DiT ↔ VAE flow control, the stop path's trailer and the phase event-id lists, over real in-process gRPC.

The real `DiTServicer`, `VAEServicer`, `EncoderServicer` and the gateway's `GrpcPipeline` talk over a grpc.aio
server in this process; only the compute cores behind the servicers are small fakes (no weights). The fake DiT
session installs prompt updates at the next request boundary (4 phases per request), as the runtime does, and
records how many phases it had started and how many acks the consumer had sent when each phase started.
"""
import asyncio
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import grpc
import pytest
import torch

from services.common import tracing
from services.common.config import DiTConfig
from services.common.errors import SequenceMismatch
from services.tensors.transport import tensor_to_parts
from services.dit.api import HoldConfig, PhaseMeta, PhaseOutput, PhaseTimings
from services.dit import flow
from services.dit.flow import PhaseCredit
from services.dit.grpc_server import DiTServicer, phase_messages
from services.encoder.grpc_server import EncoderServicer
from services.encoder.service import Encoded
from services.gateway.grpc_pipeline import GrpcPipeline
from services.gateway.pipeline import SessionRequest
from services.vae.grpc_server import VAEServicer
from services.vae.service import Chunk
from vitascope.dit.v1 import dit_pb2, dit_pb2_grpc
from vitascope.encoder.v1 import encoder_pb2_grpc
from vitascope.vae.v1 import vae_pb2_grpc

pytestmark = pytest.mark.cpu

PHASES_PER_REQUEST = 4
TRAILER = b"muxer-closing-bytes"
TRAILER_AUDIO_SAMPLES = 6667


def _meta(i: int, started=(), active="", completed=()) -> PhaseMeta:
    return PhaseMeta(request_index=i // PHASES_PER_REQUEST, phase_index=i % PHASES_PER_REQUEST, num_frames=4,
                     num_audio_samples=640, num_video_latents=1, num_audio_latents=1,
                     started_event_ids=tuple(started), active_event_id=active,
                     completed_event_ids=tuple(completed), superseded_event_ids=(),
                     timings=PhaseTimings(student_s=0.001))


class FakeDiTSession:
    canvas = types.SimpleNamespace(width=64, height=64)
    kv = None

    def __init__(self, acks_sent: list) -> None:
        self.started = 0
        self.acks_sent = acks_sent  # filled by a raw-gRPC test client before each ack write
        self.ahead_at_start: list[int] = []  # phases started minus acks sent, when each phase started
        self.started_at: list[float] = []  # monotonic time each phase started
        self.cancel_token = types.SimpleNamespace(cancelled=False)
        self._lock = threading.Lock()
        self._pending: list[str] = []
        self._active = ""

    def next_phase(self) -> PhaseOutput:
        i = self.started
        self.started_at.append(time.monotonic())
        self.ahead_at_start.append(i - len(self.acks_sent))
        self.started += 1
        time.sleep(0.005)
        completed = ()
        if i % PHASES_PER_REQUEST == 0:
            with self._lock:
                completed, self._pending = tuple(self._pending), []
            self._active = completed[-1] if completed else self._active
        meta = _meta(i, started=completed, active=self._active, completed=completed)
        return PhaseOutput(video=torch.full((1, 24, 2, 2), float(i)), audio=torch.zeros(2, 1, 32), meta=meta)

    def submit_prompt(self, update) -> None:
        with self._lock:
            self._pending.append(update.event_id)

    def cancel(self) -> None:
        self.cancel_token.cancelled = True

    def close(self) -> None:
        pass


class FakeDiT:
    def __init__(self) -> None:
        self.acks_sent: list = []
        self.sessions: list[FakeDiTSession] = []

    def open(self, config, prompt, fallback) -> FakeDiTSession:
        self.sessions.append(FakeDiTSession(self.acks_sent))
        return self.sessions[-1]

    def hold_config(self, enabled: bool, max_seconds: float) -> HoldConfig:
        return HoldConfig(enabled=enabled, max_seconds=max_seconds or None)


class FakeEncoder:
    def __init__(self) -> None:
        self.worker = ThreadPoolExecutor(1, "encoder")

    def encode(self, prompt: str) -> Encoded:
        return Encoded(embedding=torch.ones(3, 8), seconds=0.001)


class FakeDecodeSession:
    def __init__(self, close_delay_s: float, split_first: bool) -> None:
        self.closed = False
        self.close_delay_s = close_delay_s
        self.split_first = split_first  # the first phase as two chunks, 0.2 s apart, as the real VAE sends it
        self.last_of_first_at = 0.0  # when the first phase's last chunk was made (monotonic)

    def phase(self, video, audio) -> Iterator[Chunk]:
        time.sleep(0.005)
        first = int(video[0, 0, 0, 0]) == 0
        if first and self.split_first:
            yield Chunk(data=b"phase-0-clip-0", num_frames=2, num_audio_samples=320, video_decode_seconds=0.001,
                        audio_decode_seconds=0.001, mux_seconds=0.001, phase_continues=True)
            time.sleep(0.2)
            self.last_of_first_at = time.monotonic()
        yield Chunk(data=b"phase-%d" % int(video[0, 0, 0, 0]), num_frames=4, num_audio_samples=640,
                     video_decode_seconds=0.001, audio_decode_seconds=0.001, mux_seconds=0.001)

    def close(self) -> Chunk:
        time.sleep(self.close_delay_s)
        self.closed = True
        # The decoder's 5 held-back frames and the audio behind them (as the VAE's session.close sends them).
        return Chunk(data=TRAILER, num_frames=5, num_audio_samples=TRAILER_AUDIO_SAMPLES, video_decode_seconds=0.0,
                     audio_decode_seconds=0.0, mux_seconds=0.0)

    def discard(self) -> None:
        pass  # no encoders to free


class FakeVAE:
    def __init__(self) -> None:
        self.sessions: list[FakeDecodeSession] = []
        self.decode_worker = ThreadPoolExecutor(1, "vae-decode")
        self.close_delay_s = 0.0
        self.split_first = False

    def open(self, width, height, fps, sample_rate) -> FakeDecodeSession:
        self.sessions.append(FakeDecodeSession(self.close_delay_s, self.split_first))
        return self.sessions[-1]


class Stages:
    """The three servicers on one in-process server."""

    def __init__(self, max_phases_ahead: int = 2) -> None:
        self.dit, self.vae = FakeDiT(), FakeVAE()
        self.cancelled_at = 0.0  # when the session under test was cancelled (monotonic)
        self.server = grpc.aio.server()
        encoder_pb2_grpc.add_EncoderServicer_to_server(EncoderServicer(FakeEncoder()), self.server)
        dit_pb2_grpc.add_DiTServicer_to_server(DiTServicer(self.dit, max_phases_ahead), self.server)
        vae_pb2_grpc.add_VAEServicer_to_server(VAEServicer(self.vae), self.server)
        self.addr = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"

    async def __aenter__(self) -> "Stages":
        await self.server.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.server.stop(0)


async def _open_raw(channel) -> grpc.aio.StreamStreamCall:
    """A raw DiT stream: start + one prompt; returns the call after `started`."""
    call = dit_pb2_grpc.DiTStub(channel).Stream()
    await call.write(dit_pb2.StreamRequest(start=dit_pb2.SessionStart(session_id="raw", seed=1, width=64,
                                                                       height=64)))
    for part in tensor_to_parts(torch.ones(3, 8)):
        await call.write(dit_pb2.StreamRequest(prompt=dit_pb2.PromptPart(event_id="", embedding=part)))
    first = await call.read()
    assert first.WhichOneof("kind") == "started"
    return call


async def _read_phase(call) -> dit_pb2.PhaseMeta:
    meta = None
    while True:
        reply = await call.read()
        assert reply is not grpc.aio.EOF
        if reply.WhichOneof("kind") == "meta":
            meta = reply.meta
        elif reply.WhichOneof("kind") == "phase_end":
            return meta


# ---------------------------------------------------------------- the DiT servicer alone

@pytest.mark.parametrize("max_ahead", [1, 2, 3])
async def test_slow_consumer_never_has_more_than_max_phases_ahead_unacked(max_ahead):
    async with Stages(max_ahead) as stages, grpc.aio.insecure_channel(stages.addr) as channel:
        call = await _open_raw(channel)
        for _ in range(8):
            meta = await _read_phase(call)
            await asyncio.sleep(0.03)  # a slow VAE: the DiT would run far ahead if nothing held it back
            stages.dit.acks_sent.append((meta.request_index, meta.phase_index))
            await call.write(dit_pb2.StreamRequest(ack=dit_pb2.PhaseAck(
                request_index=meta.request_index, phase_index=meta.phase_index)))
        session = stages.dit.sessions[0]
        for _ in range(500):  # the window refills as the acks land: wait for it (a loaded machine takes a while)
            if session.started >= 8 + max_ahead:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # and a little longer: a phase past the window would start now
        call.cancel()
    assert session.started >= 8 + max_ahead  # it did use the whole window
    assert max(session.ahead_at_start) == max_ahead - 1  # phase k starts only while < max_ahead are unacked
    assert session.started <= len(stages.dit.acks_sent) + max_ahead


async def test_first_phases_need_no_ack_and_then_the_dit_waits():
    async with Stages(2) as stages, grpc.aio.insecure_channel(stages.addr) as channel:
        call = await _open_raw(channel)
        metas = [await _read_phase(call), await _read_phase(call)]  # no deadlock: these come without acks
        await asyncio.sleep(0.2)
        assert stages.dit.sessions[0].started == 2  # ... and then it waits
        await call.write(dit_pb2.StreamRequest(ack=dit_pb2.PhaseAck(request_index=0, phase_index=0)))
        third = await asyncio.wait_for(_read_phase(call), 5)
        call.cancel()
    assert [(m.request_index, m.phase_index) for m in metas + [third]] == [(0, 0), (0, 1), (0, 2)]


async def test_out_of_order_ack_fails_the_call_with_a_clear_status():
    async with Stages(2) as stages, grpc.aio.insecure_channel(stages.addr) as channel:
        call = await _open_raw(channel)
        await _read_phase(call)
        await call.write(dit_pb2.StreamRequest(ack=dit_pb2.PhaseAck(request_index=0, phase_index=1)))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            while True:
                await call.read()
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "oldest unacknowledged phase is 0.0" in err.value.details()


async def test_a_fallback_prompt_out_of_place_fails_the_call_with_a_clear_status():
    async with Stages(2) as stages, grpc.aio.insecure_channel(stages.addr) as channel:
        first = dit_pb2_grpc.DiTStub(channel).Stream()  # a FALLBACK prompt first, no ACTIVE one
        await first.write(dit_pb2.StreamRequest(start=dit_pb2.SessionStart(session_id="f", seed=1, width=64,
                                                                            height=64)))
        for part in tensor_to_parts(torch.ones(3, 8)):
            await first.write(dit_pb2.StreamRequest(prompt=dit_pb2.PromptPart(
                event_id="fb", role=dit_pb2.PROMPT_ROLE_FALLBACK, embedding=part)))
        with pytest.raises(grpc.aio.AioRpcError) as at_start:
            await first.read()
        later = await _open_raw(channel)  # an update with the FALLBACK role, no fallback announced
        await _read_phase(later)
        for part in tensor_to_parts(torch.ones(3, 8)):
            await later.write(dit_pb2.StreamRequest(prompt=dit_pb2.PromptPart(
                event_id="fb2", role=dit_pb2.PROMPT_ROLE_FALLBACK, embedding=part)))
        with pytest.raises(grpc.aio.AioRpcError) as as_update:
            while True:
                await asyncio.wait_for(later.read(), 10)
    assert at_start.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "first prompt must have the ACTIVE role" in at_start.value.details()
    assert as_update.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "prompt 'fb2' has the FALLBACK role" in as_update.value.details()


async def test_closing_the_request_stream_ends_the_call():
    async with Stages(2) as stages, grpc.aio.insecure_channel(stages.addr) as channel:
        call = await _open_raw(channel)
        await call.done_writing()
        replies = []
        while (reply := await asyncio.wait_for(call.read(), 5)) is not grpc.aio.EOF:
            replies.append(reply)
        assert await call.code() == grpc.StatusCode.OK
    assert sum(r.WhichOneof("kind") == "phase_end" for r in replies) <= 2


async def test_a_sessions_end_gives_its_freed_heap_back(monkeypatch):
    trims = []
    monkeypatch.setattr(flow, "release_free_heap", lambda: trims.append("trimmed"))
    async with Stages(2) as stages, grpc.aio.insecure_channel(stages.addr) as channel:
        call = await _open_raw(channel)
        assert trims == []
        await call.done_writing()
        while await asyncio.wait_for(call.read(), 5) is not grpc.aio.EOF:
            pass
        assert await call.code() == grpc.StatusCode.OK
    assert trims == ["trimmed"] and stages.dit.sessions[0].cancel_token.cancelled  # once, as the session ended


async def test_the_dit_generates_no_phase_past_the_session_budget():
    async with Stages(3) as stages, grpc.aio.insecure_channel(stages.addr) as channel:
        call = dit_pb2_grpc.DiTStub(channel).Stream()
        await call.write(dit_pb2.StreamRequest(start=dit_pb2.SessionStart(session_id="budget", seed=1, width=64,
                                                                           height=64, max_requests=2)))
        for part in tensor_to_parts(torch.ones(3, 8)):
            await call.write(dit_pb2.StreamRequest(prompt=dit_pb2.PromptPart(event_id="", embedding=part)))
        assert (await call.read()).WhichOneof("kind") == "started"
        phases = []
        while (reply := await asyncio.wait_for(call.read(), 10)) is not grpc.aio.EOF:
            if reply.WhichOneof("kind") == "meta":
                phases.append((reply.meta.request_index, reply.meta.phase_index))
                if len(phases) < 8:  # the budget's last phase ends the stream: an ack of it would race that end
                    await call.write(dit_pb2.StreamRequest(ack=dit_pb2.PhaseAck(
                        request_index=reply.meta.request_index, phase_index=reply.meta.phase_index)))
        assert await call.code() == grpc.StatusCode.OK  # the stream ends by itself, with the budget's last phase
    assert phases == [(k // 4, k % 4) for k in range(8)]
    assert stages.dit.sessions[0].started == 8 and stages.dit.sessions[0].cancel_token.cancelled  # slot freed

def test_phase_credit_rejects_bad_acks_and_window():
    credit = PhaseCredit(2)
    with pytest.raises(SequenceMismatch, match="no phase is unacknowledged"):
        credit.ack(0, 0)
    credit.sent(0, 0)
    credit.ack(0, 0)
    assert credit.unacked == 0
    with pytest.raises(ValueError, match="max_phases_ahead=0"):
        PhaseCredit(0)
    with pytest.raises(ValueError, match="dit.max_phases_ahead=0"):
        DiTConfig(max_phases_ahead=0)
    assert DiTConfig().max_phases_ahead == 2


def test_phase_messages_drop_the_empty_event_id_from_every_list():
    span = tracing.SpanContext.new_root()
    out = PhaseOutput(video=torch.zeros(1, 24, 2, 2), audio=torch.zeros(2, 1, 32),
                      meta=_meta(0, started=("",), active="", completed=("",)))
    meta = phase_messages(out, span)[0].meta
    assert (list(meta.started_event_ids), list(meta.active_event_ids), list(meta.completed_event_ids)) == \
        ([], [], [])
    out = PhaseOutput(video=torch.zeros(1, 24, 2, 2), audio=torch.zeros(2, 1, 32),
                      meta=_meta(4, started=("", "e1"), active="e1", completed=("", "e1")))
    meta = phase_messages(out, span)[0].meta
    assert (list(meta.started_event_ids), list(meta.active_event_ids), list(meta.completed_event_ids)) == \
        (["e1"], ["e1"], ["e1"])


# ---------------------------------------------------------------- through the gateway's GrpcPipeline

async def _run_pipeline_session(stages: Stages, *, stop_after: int, update_after: int | None,
                                consumer_delay_s: float, drain_timeout_s: float = 5.0) -> list:
    pipeline = GrpcPipeline(stages.addr, stages.addr, stages.addr, drain_timeout_s=drain_timeout_s)
    chunks = []
    try:
        session = await pipeline.start(SessionRequest(request_id="flow", prompt="first", seed=1, width=64,
                                                      height=64, fps=24))
        stream = session.chunks()
        async for chunk in stream:
            chunks.append(chunk)
            if len(chunks) == update_after:
                await session.update_prompt("late-update", "second")
            if len(chunks) == stop_after:
                await session.cancel()  # the gateway's stop: what is in flight and the trailer still come
                stages.cancelled_at = time.monotonic()
            await asyncio.sleep(consumer_delay_s)
        await session.cancel()
    finally:
        await pipeline.close()
    return chunks


async def test_update_sent_after_chunk_4_is_applied_at_chunk_8():
    async with Stages(2) as stages:
        chunks = await asyncio.wait_for(
            _run_pipeline_session(stages, stop_after=10, update_after=4, consumer_delay_s=0.05), 30)
    media = [c for c in chunks if c.kind == "media"]
    applied = [i for i, c in enumerate(media) if "late-update" in c.completed_event_ids]
    assert applied == [8]
    assert (media[8].request_index, media[8].phase_index) == (2, 0)
    assert all("late-update" in c.active_event_ids for c in media[8:])
    assert not any("late-update" in c.active_event_ids for c in media[:8])
    assert all(not c.started_event_ids and not c.completed_event_ids for c in media[:8])  # no "" ids


async def test_a_phase_in_two_chunks_is_acked_once_its_last_chunk_is_in():
    async with Stages(1) as stages:
        stages.vae.split_first = True
        chunks = await asyncio.wait_for(
            _run_pipeline_session(stages, stop_after=4, update_after=None, consumer_delay_s=0.0), 30)
        dit_session, vae_session = stages.dit.sessions[0], stages.vae.sessions[0]
    media = [c for c in chunks if c.kind == "media"]
    assert [(c.request_index, c.phase_index, c.phase_continues) for c in media[:3]] == [
        (0, 0, True), (0, 0, False), (0, 1, False)]
    assert [c.data for c in media[:3]] == [b"phase-0-clip-0", b"phase-0", b"phase-1"]
    assert media[1].timings.dit == 0.0 < media[0].timings.dit  # the phase's DiT seconds ride on its first chunk
    # with a window of one phase, phase 1 starts only on phase 0's ack: after its second chunk, not its first
    assert dit_session.started_at[1] > vae_session.last_of_first_at


async def test_cancel_delivers_the_phases_in_flight_then_the_trailer():
    async with Stages(2) as stages:
        chunks = await asyncio.wait_for(
            _run_pipeline_session(stages, stop_after=3, update_after=None, consumer_delay_s=0.05), 30)
        dit_session, vae_session = stages.dit.sessions[0], stages.vae.sessions[0]
    kinds = [c.kind for c in chunks]
    assert kinds[-1] == "trailer" and kinds[:-1] == ["media"] * (len(chunks) - 1)
    assert chunks[-1].data == TRAILER and chunks[-1].num_frames == 5
    assert chunks[-1].num_audio_samples == TRAILER_AUDIO_SAMPLES  # the VAE's count, not 0
    media = chunks[:-1]
    assert [c.data for c in media] == [b"phase-%d" % i for i in range(len(media))]  # in order, none lost
    assert 3 <= len(media) <= 3 + 2  # at most max_phases_ahead were in flight at the stop
    assert vae_session.closed and dit_session.cancel_token.cancelled
    assert (chunks[-1].request_index, chunks[-1].phase_index) == (media[-1].request_index, media[-1].phase_index)


async def test_a_vae_that_does_not_finish_after_cancel_is_cancelled_at_the_drain_timeout():
    async with Stages(2) as stages:
        stages.vae.close_delay_s = 1.0  # a stuck muxer close
        chunks = await asyncio.wait_for(
            _run_pipeline_session(stages, stop_after=2, update_after=None, consumer_delay_s=0.0,
                                  drain_timeout_s=0.3), 30)
        ended = time.monotonic()
    assert ended - stages.cancelled_at < 0.9  # the gateway did not wait for the VAE
    assert [c.kind for c in chunks] == ["media"] * len(chunks) and len(chunks) >= 2


async def _budget_session(stages: Stages, max_requests: int) -> list:
    """A session with a frame budget of `max_requests` requests, read by a slow consumer (the DiT far ahead)."""
    pipeline = GrpcPipeline(stages.addr, stages.addr, stages.addr)
    chunks = []
    try:
        session = await pipeline.start(SessionRequest(request_id="budget", prompt="first", seed=1, width=64,
                                                      height=64, fps=24, max_requests=max_requests))
        async for chunk in session.chunks():
            chunks.append(chunk)
            await asyncio.sleep(0.05)  # the DiT may run max_phases_ahead phases ahead meanwhile
        await session.cancel()
    finally:
        await pipeline.close()
    return chunks


async def test_no_phase_past_the_frame_budget_reaches_the_vae_or_the_client():
    async with Stages(3) as stages:
        chunks = await asyncio.wait_for(_budget_session(stages, max_requests=2), 30)
        dit_session, vae_session = stages.dit.sessions[0], stages.vae.sessions[0]
    assert [c.data for c in chunks] == [b"phase-%d" % i for i in range(8)] + [TRAILER]
    assert chunks[-1].kind == "trailer" and dit_session.started == 8 and vae_session.closed


async def test_a_dit_that_ignores_the_budget_still_gets_no_phase_past_it_to_the_vae(monkeypatch):
    from services.dit.flow import SessionFlow

    generate = SessionFlow.generate

    async def unbounded(self, session, render, write, between, max_requests=0):  # an older DiT: no budget
        await generate(self, session, render, write, between)

    monkeypatch.setattr(SessionFlow, "generate", unbounded)
    async with Stages(3) as stages:
        chunks = await asyncio.wait_for(_budget_session(stages, max_requests=1), 30)
        dit_session = stages.dit.sessions[0]
    assert [c.data for c in chunks] == [b"phase-%d" % i for i in range(4)] + [TRAILER]
    assert dit_session.started > 4  # it did run ahead, and the pump kept that from the VAE
