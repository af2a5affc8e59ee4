"""gRPC mapping of the DiT stage: one `Stream` call is one session.

Request stream: start, the first prompt's parts (and a fallback prompt's, for hold), then prompt updates and
phase acks. Response stream: `started`, then per phase meta → video parts → audio parts → phase_end. Phases
are generated in a worker thread; cancelling the call cancels the session, which releases its KV cache, and
closing the request stream ends the call after the phase in progress.

Flow control and prompt assembly are the core's (`services.dit.flow`: a phase only while fewer than
`dit.max_phases_ahead` are unacknowledged by `PhaseAck`s); this module maps messages to its `RequestEvent`s and
its phases to messages.

Transport: `SessionStart.consumer` carries the VAE's `TransportHello` (the gateway asks the VAE's `Transport/Hello`).
When the DiT's rank 0 runs on CUDA and the handshake picks CUDA IPC, the session's latents go as single
`TensorPart(cuda=...)` parts leased from the one pool this process exports (`IpcExporter`, created on the first IPC
session); the consumer gives each slot back with `StreamRequest.release` (relayed by the gateway from the VAE's
`DecodeResponse.release_*`), and the slots a session still holds when it ends are taken back. A release of a slot
the session does not hold fails that session only (INVALID_ARGUMENT). Otherwise, latents go as host-byte parts.

Observability: every log line of a call carries `start.session_id` (and the trace id), worker threads
included. The session's span arrives as `traceparent` call metadata (a new trace is started when the caller
sent none); each phase gets a child span whose traceparent goes out in `PhaseMeta.trace`.
"""
from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import AsyncIterator, Callable

import grpc

from services.common import tracing
from services.common.config import DiTConfig
from services.tensors.cuda_ipc import IpcConsumer, IpcError
from services.common.errors import SequenceMismatch, abort_with
from services.common.logging_setup import log_context
from services.common.media import AUDIO_SAMPLE_RATE
from services.common.metrics import ACTIVE_SESSIONS, STAGE_LATENCY, record_gpu_memory
from services.tensors.stage_transport import (IpcExporter, ProcessConsumer, SessionLeases, TensorReceiver,
                                             register_transport, sender)
from services.dit.api import PhaseAck, PhaseOutput, PromptArrival, PromptUpdate, RequestEvent, SessionConfig
from services.dit.flow import SessionFlow
from services.dit.service import DiTService
from vitascope.common.v1 import tensor_pb2
from vitascope.dit.v1 import dit_pb2, dit_pb2_grpc

log = logging.getLogger(__name__)

CONSUMER = "vae"
"""The peer label of the latents' consumer in the transport metrics."""


async def request_events(requests: AsyncIterator[dit_pb2.StreamRequest], receiver: TensorReceiver,
                         leases: SessionLeases | None, prompt_releases: collections.deque[tensor_pb2.Release]
                         ) -> AsyncIterator[RequestEvent]:
    """The request stream after `start` as the core's events: phase acks and whole prompts (assembled from their
    parts by `receiver`). Latent slot releases go to the session's `leases` (None: host bytes, it holds none); a CUDA
    IPC prompt part's release waits in `prompt_releases` for the response stream."""
    async for request in requests:
        kind = request.WhichOneof("kind")
        if kind == "ack":
            yield PhaseAck(request.ack.request_index, request.ack.phase_index)
        elif kind == "release":
            if leases is None:
                raise IpcError(f"release of slot {request.release.slot}: this session's latents go as host "
                               "bytes, it holds no CUDA IPC slot")
            leases.release(request.release)
        elif kind == "prompt":
            part = request.prompt
            embedding, release = await receiver.receive(part.embedding)
            if release is not None:
                prompt_releases.append(release)
            if embedding is not None:
                if part.role not in (dit_pb2.PROMPT_ROLE_ACTIVE, dit_pb2.PROMPT_ROLE_FALLBACK):
                    raise SequenceMismatch(f"prompt {part.event_id!r}: unknown role {part.role}")
                yield PromptArrival(PromptUpdate(embedding=embedding.float(), event_id=part.event_id),
                                    fallback=part.role == dit_pb2.PROMPT_ROLE_FALLBACK)
        else:
            raise SequenceMismatch(f"expected a prompt part, a phase ack or a release, got {kind}")


def release_messages(prompt_releases: collections.deque[tensor_pb2.Release]) -> list[dit_pb2.StreamResponse]:
    """The prompt releases waiting to go out (emptied)."""
    messages = []
    while prompt_releases:
        messages.append(dit_pb2.StreamResponse(prompt_release=prompt_releases.popleft()))
    return messages


def phase_messages(out: PhaseOutput, span: tracing.SpanContext,
                   send: Callable[..., list[tensor_pb2.TensorPart]] = sender(None, CONSUMER)
                   ) -> list[dit_pb2.StreamResponse]:
    """The response messages of one phase (whose span is `span`), in wire order; `send` turns a latent tensor into
    parts (`sender`: host bytes, or CUDA IPC through the session's leases; blocking, a device copy)."""
    m, t = out.meta, out.meta.timings
    meta = dit_pb2.PhaseMeta(
        request_index=m.request_index, phase_index=m.phase_index, num_frames=m.num_frames,
        num_audio_samples=m.num_audio_samples, audio_sample_rate=AUDIO_SAMPLE_RATE,
        # The first prompt may carry the empty event id: it names no event, so it is in none of the lists.
        started_event_ids=[e for e in m.started_event_ids if e],
        active_event_ids=[m.active_event_id] if m.active_event_id else [],
        completed_event_ids=[e for e in m.completed_event_ids if e],
        stage_seconds={"hold": t.hold_s, "teacher": t.teacher_s, "student": t.student_s, "commit": t.commit_s},
        first_of_request=m.phase_index == 0,
        trace=tensor_pb2.TraceContext(traceparent=span.traceparent))
    return ([dit_pb2.StreamResponse(meta=meta)]
            + [dit_pb2.StreamResponse(video=p) for p in send(out.video)]
            + [dit_pb2.StreamResponse(audio=p) for p in send(out.audio)]
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


def latent_exporter(cfg: DiTConfig) -> IpcExporter:
    """The process's CUDA IPC exporter of latents to the VAE, from the profile (a pool on rank 0's device)."""
    return IpcExporter(cfg.devices[0], cfg.ipc_slot_mib << 20, cfg.ipc_pool_slots, CONSUMER, enabled=cfg.cuda_ipc)


class DiTServicer(dit_pb2_grpc.DiTServicer):
    """`max_phases_ahead`: flow-control window; None takes the service profile's `dit.max_phases_ahead`
    (the DiTConfig default for a service without a profile). `exporter`: how latents reach the VAE; None builds
    it from the same config (`latent_exporter`). `consumer`: makes the process's IpcConsumer of prompt
    embeddings (default `IpcConsumer`)."""

    def __init__(self, service: DiTService, max_phases_ahead: int | None = None,
                 exporter: IpcExporter | None = None, consumer: Callable[[], IpcConsumer] | None = None):
        self.service = service
        profile = getattr(service, "profile", None)
        cfg = profile.dit if profile is not None else DiTConfig()
        self.max_phases_ahead = cfg.max_phases_ahead if max_phases_ahead is None else max_phases_ahead
        self.exporter = latent_exporter(cfg) if exporter is None else exporter
        self.consumer = ProcessConsumer(consumer or IpcConsumer)
        """The process's IPC consumer of prompt embeddings (made on the first CUDA IPC prompt part)."""

    def _config(self, start: dit_pb2.SessionStart) -> SessionConfig:
        return SessionConfig(seed=start.seed, width=start.width, height=start.height,
                             hold=self.service.hold_config(start.hold.enabled, start.hold.max_seconds))

    async def Stream(self, request_iterator, context: grpc.aio.ServicerContext):
        try:
            first = await anext(aiter(request_iterator), None)
            if first is None or first.WhichOneof("kind") != "start":
                raise SequenceMismatch("the first message of a DiT stream must be `start`")
        except Exception as exc:  # the boundary: every failure becomes a status
            await abort_with(context, exc)
            return
        start = first.start
        session_span = tracing.continue_trace(tracing.metadata_traceparent(context.invocation_metadata()))
        with log_context(session_id=start.session_id or None, trace_id=session_span.trace_id):
            prompt_releases: collections.deque[tensor_pb2.Release] = collections.deque()
            leases = None
            try:
                leases = await asyncio.to_thread(self.exporter.session, start.consumer)
                receiver = TensorReceiver("prompt embedding", self.consumer, "cpu")
                events = request_events(request_iterator, receiver, leases, prompt_releases)
                flow = SessionFlow(self.service, events, self.max_phases_ahead)
                session = await flow.open(lambda: self._config(start), start.hold.has_fallback_prompt)
            except Exception as exc:  # the boundary: every failure becomes a status
                self._end_leases(leases)
                await abort_with(context, exc)
                return
            send = sender(leases, CONSUMER)
            ACTIVE_SESSIONS.inc()
            log.info("session started: %dx%d", session.canvas.width, session.canvas.height)
            flow.begin(session)

            async def render(out: PhaseOutput) -> list[dit_pb2.StreamResponse]:
                span = session_span.child()
                observe(out, span)
                return await asyncio.to_thread(phase_messages, out, span, send)

            async def write(messages: list[dit_pb2.StreamResponse]) -> None:
                for message in messages:
                    await context.write(message)

            async def releases() -> None:  # the prompt slots copied out since the last phase, or during the wait
                await write(release_messages(prompt_releases))

            try:
                await context.write(dit_pb2.StreamResponse(started=dit_pb2.Started(
                    kv_capacity_rows=session.kv.capacity if session.kv is not None else 0)))
                await flow.generate(session, render, write, releases, max_requests=start.max_requests)
                log.info("session ended: %s", f"its budget of {start.max_requests} request(s) was generated"
                         if start.max_requests else "the client closed its request stream")
            except asyncio.CancelledError:
                log.info("session cancelled by the client")
                raise
            except Exception as exc:  # the boundary: every failure becomes a status
                await abort_with(context, exc)
            finally:
                try:
                    await flow.end(session)
                finally:  # also when the call is cancelled meanwhile (a client's cancel ends its stream first)
                    self._end_leases(leases)
                    ACTIVE_SESSIONS.dec()

    @staticmethod
    def _end_leases(leases: SessionLeases | None) -> None:
        """Take back the CUDA IPC slots an ended session still holds (its consumer will not release them)."""
        if leases is not None and (taken := leases.close()):
            log.info("session ended holding %d CUDA IPC slot(s): taken back", taken)


def register(server: grpc.aio.Server, service: DiTService) -> None:
    """Add the dit servicer (and the Transport/Hello servicer) to a server."""
    dit_pb2_grpc.add_DiTServicer_to_server(DiTServicer(service), server)
    register_transport(server)
