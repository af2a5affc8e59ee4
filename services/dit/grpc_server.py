"""gRPC mapping of the DiT stage: one `Stream` call is one session.

Request stream: start, the first prompt's parts (and a fallback prompt's, for hold), then prompt updates and
phase acks. Response stream: `started`, then per phase meta → video parts → audio parts → phase_end. Phases
are generated in a worker thread; cancelling the call cancels the session, which releases its KV cache, and
closing the request stream ends the call after the phase in progress.

Flow control: a phase is generated only while fewer than `dit.max_phases_ahead` phases are unacknowledged
(`PhaseAck`, sent by the consumer in phase order once it has decoded the phase), so the DiT never runs more
than that far ahead of the VAE and a prompt update lands at the next request boundary after what the viewer
has received. The first max_phases_ahead phases need no ack.

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
import contextlib
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
from services.dit.api import PhaseOutput, PromptUpdate, SessionConfig
from services.dit.stream.runtime import StreamingSession
from services.dit.service import DiTService
from vitascope.common.v1 import tensor_pb2
from vitascope.dit.v1 import dit_pb2, dit_pb2_grpc

log = logging.getLogger(__name__)

CONSUMER = "vae"
"""The peer label of the latents' consumer in the transport metrics."""


class PhaseCredit:
    """Counts the phases sent but not yet acknowledged; `acquire()` waits while `max_ahead` are outstanding."""

    def __init__(self, max_ahead: int):
        if max_ahead < 1:
            raise ValueError(f"max_phases_ahead={max_ahead}: must be >= 1")
        self.max_ahead = max_ahead
        self._unacked: collections.deque[tuple[int, int]] = collections.deque()
        self._changed = asyncio.Event()
        self._closed = False
        self._error: BaseException | None = None

    @property
    def unacked(self) -> int:
        return len(self._unacked)

    def sent(self, request_index: int, phase_index: int) -> None:
        """Record that phase (request_index, phase_index) went out."""
        self._unacked.append((request_index, phase_index))

    def ack(self, request_index: int, phase_index: int) -> None:
        """The consumer decoded this phase; acks must come in phase order."""
        if not self._unacked:
            raise SequenceMismatch(f"ack for phase {request_index}.{phase_index}, but no phase is unacknowledged")
        if self._unacked[0] != (request_index, phase_index):
            oldest = "{}.{}".format(*self._unacked[0])
            raise SequenceMismatch(f"ack for phase {request_index}.{phase_index}, but the oldest "
                                   f"unacknowledged phase is {oldest} (acks must come in phase order)")
        self._unacked.popleft()
        self._changed.set()

    @property
    def error(self) -> BaseException | None:
        """Why reading the request stream failed (None while it has not)."""
        return self._error

    def close(self, error: BaseException | None = None) -> None:
        """The request stream ended (with `error` if reading it failed): no more acks will come."""
        self._closed, self._error = True, error
        self._changed.set()

    async def acquire(self) -> bool:
        """Wait until another phase may be generated; False once the request stream has ended.

        Raises the request reader's error if reading the stream failed."""
        while not self._closed and len(self._unacked) >= self.max_ahead:
            self._changed.clear()
            await self._changed.wait()
        if self._error is not None:
            raise self._error
        return not self._closed


class RequestReader:
    """Reads the request stream after `start`: assembles prompt parts into whole `PromptUpdate`s, hands
    phase acks to the session's `PhaseCredit` and latent slot releases to its `SessionLeases` (None: host bytes).

    A CUDA IPC prompt part is copied out of the encoder's pool into host memory (the same tensor the host path
    gives) by `consumer()`, the process's IpcConsumer; its release waits in `prompt_releases` for the response
    stream. Without `consumer`, only host parts are accepted."""

    def __init__(self, requests: AsyncIterator[dit_pb2.StreamRequest], credit: PhaseCredit,
                 leases: SessionLeases | None = None, consumer: Callable[[], IpcConsumer] | None = None):
        self._requests = requests
        self._credit = credit
        self._leases = leases
        self._receiver = TensorReceiver("prompt embedding", consumer or _no_ipc_consumer, "cpu")
        self.prompt_releases: collections.deque[tensor_pb2.Release] = collections.deque()

    async def next_prompt(self) -> tuple[PromptUpdate, int] | None:
        """The next complete prompt and its role (acks on the way are applied), or None at the stream's end."""
        async for request in self._requests:
            kind = request.WhichOneof("kind")
            if kind == "ack":
                self._credit.ack(request.ack.request_index, request.ack.phase_index)
            elif kind == "release":
                if self._leases is None:
                    raise IpcError(f"release of slot {request.release.slot}: this session's latents go as host "
                                   "bytes, it holds no CUDA IPC slot")
                self._leases.release(request.release)
            elif kind == "prompt":
                part = request.prompt
                embedding, release = await self._receiver.receive(part.embedding)
                if release is not None:
                    self.prompt_releases.append(release)
                if embedding is not None:
                    return PromptUpdate(embedding=embedding.float(), event_id=part.event_id), part.role
            else:
                raise SequenceMismatch(f"expected a prompt part, a phase ack or a release, got {kind}")
        return None

    async def run(self, session: StreamingSession) -> None:
        """Submit prompt updates and apply acks until the stream ends; then (or on failure) close the credit.

        At the stream's end no prompt can come any more, so a hold for one ends. A failure ends the call with its
        error, so the session is cancelled at once: a phase or a hold under way would only delay the status."""
        try:
            while (item := await self.next_prompt()) is not None:
                if item[1] != dit_pb2.PROMPT_ROLE_ACTIVE:
                    raise SequenceMismatch(f"prompt {item[0].event_id!r} has the FALLBACK role: a fallback is only "
                                           "accepted right after the first prompt, with hold.has_fallback_prompt")
                session.submit_prompt(item[0])
        except Exception as exc:  # handed to the generation loop, which turns it into the call's status
            self._credit.close(exc)
            await asyncio.to_thread(session.cancel)  # a group's cancel talks to the other ranks: off the loop
            return
        self._credit.close()
        session.close_prompts()


def _no_ipc_consumer() -> IpcConsumer:
    raise IpcError("this reader takes host parts only")


def release_messages(reader: RequestReader) -> list[dit_pb2.StreamResponse]:
    """The prompt releases waiting to go out (emptied)."""
    messages = []
    while reader.prompt_releases:
        messages.append(dit_pb2.StreamResponse(prompt_release=reader.prompt_releases.popleft()))
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


def _cancel_opened(opening: asyncio.Future) -> None:
    """Done-callback of an open whose call was cancelled: cancel the session it opened (frees the slot), off the
    event loop (a group's cancel talks to the other ranks)."""
    if not opening.cancelled() and opening.exception() is None:
        asyncio.get_running_loop().run_in_executor(None, opening.result().cancel)


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

    async def _open(self, start: dit_pb2.SessionStart, reader: RequestReader) -> StreamingSession:
        prompt = await reader.next_prompt()
        if prompt is None:
            raise SequenceMismatch("the stream closed before the first prompt arrived")
        if prompt[1] != dit_pb2.PROMPT_ROLE_ACTIVE:
            raise SequenceMismatch("the first prompt must have the ACTIVE role; a FALLBACK prompt follows it")
        fallback = None
        if start.hold.has_fallback_prompt:
            fallback = await reader.next_prompt()
            if fallback is None or fallback[1] != dit_pb2.PROMPT_ROLE_FALLBACK:
                raise SequenceMismatch("hold.has_fallback_prompt is set but no FALLBACK prompt followed")
            fallback = fallback[0]
        config = SessionConfig(seed=start.seed, width=start.width, height=start.height,
                               hold=self.service.hold_config(start.hold.enabled, start.hold.max_seconds))
        opening = asyncio.ensure_future(asyncio.to_thread(self.service.open, config, prompt[0], fallback))
        try:
            return await asyncio.shield(opening)
        except asyncio.CancelledError:  # the caller left while the open ran on: give back what it opens
            opening.add_done_callback(_cancel_opened)
            raise

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
            credit = PhaseCredit(self.max_phases_ahead)
            leases = None
            try:
                leases = await asyncio.to_thread(self.exporter.session, first.start.consumer)
                reader = RequestReader(request_iterator, credit, leases, self.consumer)
                session = await self._open(first.start, reader)
            except Exception as exc:  # the boundary: every failure becomes a status
                self._end_leases(leases)
                await abort_with(context, exc)
                return
            send = sender(leases, CONSUMER)
            ACTIVE_SESSIONS.inc()
            log.info("session started: %dx%d", session.canvas.width, session.canvas.height)
            requests = asyncio.create_task(reader.run(session))
            try:
                await context.write(dit_pb2.StreamResponse(started=dit_pb2.Started(
                    kv_capacity_rows=session.kv.capacity if session.kv is not None else 0)))
                while True:
                    for message in release_messages(reader):  # prompt slots copied out since the last phase
                        await context.write(message)
                    if not await credit.acquire():
                        break
                    for message in release_messages(reader):  # ... and while waiting for the credit
                        await context.write(message)
                    out = await asyncio.to_thread(session.next_phase)
                    span = session_span.child()
                    observe(out, span)
                    messages = await asyncio.to_thread(phase_messages, out, span, send)
                    credit.sent(out.meta.request_index, out.meta.phase_index)
                    for message in messages:
                        await context.write(message)
                log.info("session ended: the client closed its request stream")
            except asyncio.CancelledError:
                log.info("session cancelled by the client")
                raise
            except Exception as exc:  # the boundary: every failure becomes a status
                await abort_with(context, credit.error or exc)  # the request reader's error cancels the session
            finally:
                try:
                    requests.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await requests
                    await asyncio.shield(asyncio.to_thread(session.cancel))  # a group's cancel talks to the ranks
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
