"""gRPC mapping of the DiT stage: one `Stream` call is one session.

Request stream: start, the first prompt's parts (and a fallback prompt's, for hold), then prompt updates.
Response stream: `started`, then per phase meta → video parts → audio parts → phase_end. Phases are generated
in a worker thread; cancelling the call cancels the session, which releases its KV cache.

Observability: every log line of a call carries `start.session_id` (and the trace id), worker threads
included. The session's span arrives as `traceparent` call metadata (a new trace is started when the caller
sent none); each phase gets a child span whose traceparent goes out in `PhaseMeta.trace`.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import grpc

from services.common import tracing
from services.common.errors import SequenceMismatch, abort_with
from services.common.logging_setup import log_context
from services.common.metrics import ACTIVE_SESSIONS, STAGE_LATENCY, record_gpu_memory
from services.common.transport import TensorAssembler, tensor_to_parts
from services.dit.api import PhaseOutput, PromptUpdate, SessionConfig
from services.dit.runtime import StreamingSession
from services.dit.service import DiTService
from vitascope.common.v1 import tensor_pb2
from vitascope.dit.v1 import dit_pb2, dit_pb2_grpc

log = logging.getLogger(__name__)

AUDIO_SAMPLE_RATE = 32000


class PromptReader:
    """Turns the request stream's prompt parts into whole `PromptUpdate`s."""

    def __init__(self, requests: AsyncIterator[dit_pb2.StreamRequest]):
        self._requests = requests
        self._assembler = TensorAssembler("prompt embedding")

    async def next(self) -> tuple[PromptUpdate, int] | None:
        """The next complete prompt and its role, or None when the client closed its side."""
        async for request in self._requests:
            if request.WhichOneof("kind") != "prompt":
                raise SequenceMismatch(f"expected a prompt part, got {request.WhichOneof('kind')}")
            part = request.prompt
            embedding = self._assembler.add(part.embedding)
            if embedding is not None:
                return PromptUpdate(embedding=embedding.float(), event_id=part.event_id), part.role
        return None


def phase_messages(out: PhaseOutput, span: tracing.SpanContext) -> list[dit_pb2.StreamResponse]:
    """The response messages of one phase (whose span is `span`), in wire order."""
    m, t = out.meta, out.meta.timings
    meta = dit_pb2.PhaseMeta(
        request_index=m.request_index, phase_index=m.phase_index, num_frames=m.num_frames,
        num_audio_samples=m.num_audio_samples, audio_sample_rate=AUDIO_SAMPLE_RATE,
        started_event_ids=list(m.started_event_ids),
        active_event_ids=[m.active_event_id] if m.active_event_id else [],
        completed_event_ids=list(m.completed_event_ids),
        stage_seconds={"hold": t.hold_s, "teacher": t.teacher_s, "student": t.student_s, "commit": t.commit_s},
        first_of_request=m.phase_index == 0,
        trace=tensor_pb2.TraceContext(traceparent=span.traceparent))
    return ([dit_pb2.StreamResponse(meta=meta)]
            + [dit_pb2.StreamResponse(video=p) for p in tensor_to_parts(out.video)]
            + [dit_pb2.StreamResponse(audio=p) for p in tensor_to_parts(out.audio)]
            + [dit_pb2.StreamResponse(phase_end=dit_pb2.PhaseEnd())])


def observe(out: PhaseOutput, span: tracing.SpanContext) -> None:
    """Record one phase's stage latencies and log them with the phase's span."""
    m, t = out.meta, out.meta.timings
    log.info("phase %d.%d generated", m.request_index, m.phase_index,
             extra={"request_index": m.request_index, "phase_index": m.phase_index, **span.log_fields(),
                    "hold_s": round(t.hold_s, 4), "teacher_s": round(t.teacher_s, 4),
                    "student_s": round(t.student_s, 4), "commit_s": round(t.commit_s, 4)})
    for stage, seconds in (("teacher", t.teacher_s), ("student", t.student_s), ("commit", t.commit_s)):
        if seconds:
            STAGE_LATENCY.labels(stage=stage).observe(seconds)
    record_gpu_memory()


def next_phase_or_release(session: StreamingSession) -> PhaseOutput:
    """One phase, run in a worker thread; releases the session if it was cancelled while the phase ran.

    `StreamingSession.cancel()` only sets the token while a phase holds the session, and the phase may already
    be past its last cancellation check. The handler that awaited this thread is gone by then, so nobody would
    ask for another phase and the group would keep its session (every later open fails with NoCapacity).
    """
    out = session.next_phase()
    if session.cancel_token.cancelled:
        session.close()
    return out


class DiTServicer(dit_pb2_grpc.DiTServicer):
    def __init__(self, service: DiTService):
        self.service = service

    async def _open(self, start: dit_pb2.SessionStart, requests) -> tuple[StreamingSession, PromptReader]:
        reader = PromptReader(requests)
        prompt = await reader.next()
        if prompt is None:
            raise SequenceMismatch("the stream closed before the first prompt arrived")
        fallback = None
        if start.hold.has_fallback_prompt:
            fallback = await reader.next()
            if fallback is None or fallback[1] != dit_pb2.PROMPT_ROLE_FALLBACK:
                raise SequenceMismatch("hold.has_fallback_prompt is set but no FALLBACK prompt followed")
            fallback = fallback[0]
        config = SessionConfig(seed=start.seed, width=start.width, height=start.height,
                               hold=self.service.hold_config(start.hold.enabled, start.hold.max_seconds))
        session = await asyncio.to_thread(self.service.open, config, prompt[0], fallback)
        return session, reader

    async def _forward_updates(self, session: StreamingSession, reader: PromptReader) -> None:
        while (item := await reader.next()) is not None:
            session.submit_prompt(item[0])

    async def Stream(self, request_iterator, context: grpc.aio.ServicerContext):
        try:
            first = await anext(aiter(request_iterator), None)
            if first is None or first.WhichOneof("kind") != "start":
                raise SequenceMismatch("the first message of a DiT stream must be `start`")
        except Exception as exc:  # the boundary: every failure becomes a status
            await abort_with(context, exc)
            return
        session_span = tracing.continue_trace(tracing.metadata_traceparent(context.invocation_metadata()))
        with log_context(session_id=first.start.session_id or None, trace_id=session_span.trace_id):
            try:
                session, reader = await self._open(first.start, request_iterator)
            except Exception as exc:  # the boundary: every failure becomes a status
                await abort_with(context, exc)
                return
            ACTIVE_SESSIONS.inc()
            log.info("session started: %dx%d", session.canvas.width, session.canvas.height)
            updates = asyncio.create_task(self._forward_updates(session, reader))
            try:
                yield dit_pb2.StreamResponse(started=dit_pb2.Started(
                    kv_capacity_rows=session.kv.capacity if session.kv is not None else 0))
                while True:
                    if updates.done() and updates.exception() is not None:
                        raise updates.exception()
                    out = await asyncio.to_thread(next_phase_or_release, session)
                    span = session_span.child()
                    observe(out, span)
                    for message in phase_messages(out, span):
                        yield message
            except asyncio.CancelledError:
                log.info("session cancelled by the client")
                raise
            except Exception as exc:  # the boundary: every failure becomes a status
                await abort_with(context, exc)
            finally:
                updates.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await updates
                session.cancel()
                ACTIVE_SESSIONS.dec()
