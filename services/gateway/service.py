"""Session lifecycle and ordering, independent of the transport.

Knows nothing about websockets or JSON text: a transport parses client frames with `protocol`,
calls `SessionService.open()` and the `Session` methods, and delivers what the session emits
through a `MessageSink`. Knows nothing about gRPC either: the backend is a `Pipeline`.

A session's life: accepted (`video.start`) -> waits for a slot (`session.queued` on every
position change) -> `Pipeline.start` -> chunks are forwarded in order (metadata, then bytes) ->
`session.done`. Prompt updates are forwarded to the backend one at a time in arrival order and
acknowledged with `session.interaction.queued` once the backend took them (updates sent while
queued are forwarded right after the backend session starts). While a session holds a slot, a
stretch of `stall_timeout_s` without a chunk and without a ping aborts it (waiting in the queue
never stalls). A cancelled `run()` (client gone) cancels the backend session, then frees the slot. A stage may
free a cancelled session a little after its slot went to the next session, so a start refused with `backend_busy`
is retried until `stall_timeout_s`.
"""
from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Protocol

from services.common.errors import ClientError, Fault
from services.common.logging_setup import log_context
from services.common.memory import release_free_heap
from services.common.media import FIRST_REQUEST_FRAMES, LATER_REQUEST_FRAMES, PHASES_PER_REQUEST
from services.common.config import GatewayConfig
from services.gateway.broadcast import Broadcasts
from services.gateway.errors import ErrorCode, ErrorMessage, ProtocolError
from services.gateway.metrics import GatewayMetrics
from services.gateway.pipeline import (
    BackendUnavailable,
    MediaChunk,
    Pipeline,
    PipelineError,
    PipelineSession,
    SessionRequest,
)
from services.gateway.protocol import (
    ChunkMetadata,
    InteractionQueued,
    PacingSettings,
    ServerMessage,
    SessionDone,
    SessionInteraction,
    SessionQueued,
    SessionStart,
    VideoStart,
    hls_path,
    watch_path,
)
from services.gateway.recording import Recordings
from services.gateway.scheduler import QueueFull, SessionScheduler

logger = logging.getLogger(__name__)


class ClientGone(ClientError):
    """The transport can no longer deliver messages to the client."""


class MessageSink(Protocol):
    """Where a session's outbound messages go.

    Implementations serialize concurrent sends and bound each one's time: a client that stops reading must
    surface as ClientGone, never as a send that waits forever (it would keep its slot or queue place).
    """

    async def send(self, message: ServerMessage) -> None:
        """Deliver one control message; raise ClientGone if the peer is gone."""

    async def send_media(self, metadata: ChunkMetadata, data: bytes) -> None:
        """Deliver a chunk's metadata immediately followed by its bytes; raise ClientGone."""


class Outcome(str, enum.Enum):
    """How a session ended."""

    COMPLETED = "completed"
    STOPPED = "stopped"
    FAILED = "failed"
    DISCONNECTED = "disconnected"


class _Stalled(ClientError):
    """No chunk and no `session.ping` for `stall_timeout_s` (the client's pings keep a slow session alive)."""


_BUSY_RETRY_S = 0.1
"""Seconds between starts refused with `backend_busy` (see `Session._start_pipeline`)."""


def requests_for_frames(num_frames: int) -> int:
    """Whole 5 s requests needed to publish at least `num_frames` frames (as vLLM-Omni's TaoMate-H3 counts)."""
    if num_frames <= 0:
        raise ValueError(f"num_frames={num_frames} must be > 0")
    later = max(0, num_frames - FIRST_REQUEST_FRAMES)
    return 1 + -(-later // LATER_REQUEST_FRAMES)


def _error_code(exc: PipelineError) -> ErrorCode:
    try:
        return ErrorCode(exc.code)
    except ValueError:
        return ErrorCode.INTERNAL_ERROR


class MediaPacer:
    """Holds chunks back so none leaves earlier than its media time minus a lead."""

    def __init__(self, settings: PacingSettings) -> None:
        self._lead = settings.lead_s
        self._max_lag = settings.max_lag_s
        self._origin: float | None = None
        self._media_s = 0.0

    def delay_for(self, now: float, duration_s: float) -> float:
        """Seconds to wait before sending, at monotonic time `now`, a chunk of `duration_s` media."""
        if self._origin is None:
            self._origin = now
        due = self._origin + self._media_s - self._lead
        if now - due > self._max_lag:  # far behind (slow backend): restart the clock, no burst
            self._origin = now - self._media_s + self._lead
            due = now
        self._media_s += duration_s
        return max(0.0, due - now)


class SessionService:
    """Admits sessions: validates starts against the deployment and hands out scheduler slots."""

    def __init__(self, config: GatewayConfig, pipeline: Pipeline, metrics: GatewayMetrics,
                 recordings: Recordings | None = None) -> None:
        self.config = config
        self.pipeline = pipeline
        self.metrics = metrics
        self.scheduler = SessionScheduler(config.num_slots, config.queue_limit)
        self.broadcasts = Broadcasts(config.broadcast)
        """Each session's shared stream, by request id (the watch websocket and the HLS routes read it)."""
        self.recordings = recordings
        """Where each session's broadcast is recorded (None: not recorded)."""
        metrics.sessions_active.set_function(lambda: self.scheduler.num_active)
        metrics.sessions_queued.set_function(lambda: self.scheduler.num_waiting)

    def build_request(self, start: SessionStart, request_id: str) -> SessionRequest:
        """Check a parsed session.start against this deployment; raise ProtocolError."""
        cfg = self.config
        if start.model is not None and start.model != cfg.model:
            raise ProtocolError(
                ErrorCode.MODEL_MISMATCH, f"model {start.model!r} is not served here; use {cfg.model!r}"
            )
        width = start.width if start.width is not None else cfg.default_canvas[0]
        height = start.height if start.height is not None else cfg.default_canvas[1]
        allowed = {tuple(c) for c in cfg.allowed_canvases}
        if (width, height) not in allowed:
            names = ", ".join(f"{w}x{h}" for w, h in cfg.allowed_canvases)
            raise ProtocolError(
                ErrorCode.CANVAS_NOT_ALLOWED, f"canvas {width}x{height} is not allowed; use one of {names}"
            )
        if start.fps is not None and start.fps != cfg.fps:
            raise ProtocolError(
                ErrorCode.FPS_NOT_ALLOWED, f"fps={start.fps} is not supported; this model runs at {cfg.fps}"
            )
        return SessionRequest(
            request_id=request_id, prompt=start.prompt,
            seed=start.seed if start.seed is not None else cfg.default_seed,
            width=width, height=height, fps=cfg.fps, hold=start.hold, extra=start.extra_params,
            max_requests=requests_for_frames(start.num_frames) if start.num_frames is not None else 0,
        )

    def open(self, start: SessionStart, sink: MessageSink) -> Session:
        """Validate a start and take a slot or a queue place; raise ProtocolError when rejected."""
        request_id = f"video_stream-{uuid.uuid4()}"
        try:
            request = self.build_request(start, request_id)
            session = Session(self, request, sink, start.pacing, num_frames=start.num_frames)
        except ProtocolError:
            self.metrics.sessions_total.labels(outcome="rejected").inc()
            raise
        except QueueFull as exc:
            self.metrics.sessions_total.labels(outcome="rejected").inc()
            raise ProtocolError(ErrorCode.QUEUE_FULL, str(exc)) from None
        if self.recordings is not None:
            self.recordings.record(session.broadcast)
        with log_context(session_id=request_id):
            logger.info("session %s accepted (%dx%d seed %d)", request_id, request.width,
                        request.height, request.seed)
        return session

    async def health(self) -> dict[str, object]:
        """Report backend health and slot occupancy."""
        try:
            ok = bool(await self.pipeline.health())
        except Exception:  # noqa: BLE001 - health must answer, whatever the backend raised
            logger.exception("pipeline health check failed")
            ok = False
        down = self.pipeline.stages_down()
        return {"ok": ok and not down, "stages_down": down, "sessions_active": self.scheduler.num_active,
                "sessions_queued": self.scheduler.num_waiting,
                "slots": self.scheduler.num_slots, "queue_limit": self.scheduler.queue_limit}


class Session:
    """One client's session: queue wait, generation, updates, stop, stall and cancellation."""

    def __init__(self, service: SessionService, request: SessionRequest, sink: MessageSink,
                 pacing: PacingSettings | None = None, *, num_frames: int | None = None) -> None:
        self._service = service
        self._num_frames = num_frames
        self._max_requests = request.max_requests or None  # the frame budget in whole requests
        self._pacing = pacing
        self._pacer = MediaPacer(pacing) if pacing is not None else None
        self._cfg = service.config
        self._metrics = service.metrics
        self.request = request
        self.request_id = request.request_id
        self._sink = sink
        self._position_changed = asyncio.Event()
        self._stop_requested = asyncio.Event()
        self._updates: asyncio.Queue[tuple[str, str]] = asyncio.Queue()
        self._event_ids: set[str] = set()
        self._pipe: PipelineSession | None = None
        self._last_progress = time.monotonic()
        self._granted_at = 0.0
        self._chunks_sent = 0
        self._media_chunks = 0
        self._drain_deadline: float | None = None
        self.finished = False
        self._ran = False
        self.ticket = service.scheduler.enqueue(lambda _pos: self._position_changed.set())
        self._start = VideoStart(self.request_id, self._accepted_config(), watch_url=watch_path(self.request_id),
                                 hls_url=hls_path(self.request_id))
        self.broadcast = service.broadcasts.open(self.request_id, fps=request.fps)
        """What this session's viewers see: every chunk sent to this client (the director), published as sent."""
        self.broadcast.start = self._start.to_wire()

    @property
    def stopped(self) -> bool:
        return self._stop_requested.is_set()

    # ------------------------------------------------------------ client actions

    def ping(self) -> None:
        """Refresh the stall clock."""
        self._last_progress = time.monotonic()

    def stop(self) -> None:
        """Ask the session to end; `run()` then sends session.done{stopped: true}."""
        self._stop_requested.set()

    def interact(self, interaction: SessionInteraction) -> str:
        """Accept a prompt update for forwarding; return its event id or raise ProtocolError."""
        event_id = interaction.event_id
        if self.stopped or self.finished:
            raise ProtocolError(
                ErrorCode.SESSION_STOPPED, "the session was stopped; no more prompt updates",
                event_id=event_id,
            )
        if event_id is None:
            event_id = f"event-{uuid.uuid4().hex[:12]}"
        elif event_id in self._event_ids:
            raise ProtocolError(
                ErrorCode.EVENT_ID_CONFLICT, f"event_id {event_id!r} was already used in this session",
                event_id=event_id,
            )
        if self._updates.qsize() >= self._cfg.max_pending_updates:
            raise ProtocolError(
                ErrorCode.TOO_MANY_UPDATES,
                f"{self._cfg.max_pending_updates} prompt updates are already waiting for the backend; "
                "send the next one after an acknowledgement", event_id=event_id,
            )
        self._event_ids.add(event_id)
        self._updates.put_nowait((event_id, interaction.prompt))
        return event_id

    # ------------------------------------------------------------ lifecycle

    def abandon(self) -> None:
        """Free the slot of a session whose run() never started (a no-op once it has)."""
        if not self._ran:
            self.finished = True
            self._service.scheduler.release(self.ticket)
            self.broadcast.end(chunks=0, stopped=True)

    async def run(self) -> Outcome:
        """Drive the session to its end; cancelling this coroutine cancels the backend session."""
        with log_context(session_id=self.request_id):  # every log line of the session, backend included
            return await self._run()

    async def _run(self) -> Outcome:
        self._ran = True
        outcome = Outcome.DISCONNECTED
        updater: asyncio.Task[None] | None = None
        try:
            await self._sink.send(self._start)
            if await self._wait_for_slot():
                outcome = Outcome.STOPPED
                await self._sink.send(SessionDone(self.request_id, 0, stopped=True))
                return outcome
            self._granted_at = self._last_progress = time.monotonic()
            self._pipe = await self._start_pipeline()
            if self._pipe is None:
                outcome = Outcome.STOPPED
                await self._sink.send(SessionDone(self.request_id, 0, stopped=True))
                return outcome
            updater = asyncio.create_task(self._forward_updates(self._pipe))
            await self._pump(self._pipe)
            outcome = Outcome.STOPPED if self.stopped else Outcome.COMPLETED
            await self._sink.send(SessionDone(self.request_id, self._chunks_sent, stopped=self.stopped))
        except _Stalled:
            outcome = Outcome.FAILED
            await self._send_error(
                ErrorCode.STALL_TIMEOUT,
                f"no progress and no session.ping for {self._cfg.stall_timeout_s:g} s; session aborted",
            )
        except PipelineError as exc:
            outcome = Outcome.FAILED
            logger.warning("session %s failed in the backend: %s", self.request_id, exc)
            await self._send_error(_error_code(exc), exc.message, fault=exc.fault)
        except ClientGone:
            outcome = Outcome.DISCONNECTED
        except Exception as exc:  # noqa: BLE001 - session boundary: report, never crash the server
            outcome = Outcome.FAILED
            logger.exception("session %s failed unexpectedly", self.request_id)
            await self._send_error(ErrorCode.INTERNAL_ERROR, f"internal error: {type(exc).__name__}")
        finally:
            self.finished = True
            if updater is not None:
                updater.cancel()
            # Shielded: a second cancellation (e.g. the client leaving right after session.done)
            # must not skip cancelling the backend or freeing the slot.
            await asyncio.shield(asyncio.ensure_future(self._close(outcome)))
        return outcome

    async def _close(self, outcome: Outcome) -> None:
        """Cancel the backend session, then free the slot (in this order: one session per group)."""
        try:
            if self._pipe is not None:
                await self._cancel_pipe(self._pipe)
        finally:
            self._service.scheduler.release(self.ticket)
            self.broadcast.end(chunks=self._chunks_sent, stopped=outcome is not Outcome.COMPLETED)
            self._metrics.sessions_total.labels(outcome=outcome.value).inc()
            logger.info("session %s ended: %s after %d chunks", self.request_id, outcome.value,
                        self._chunks_sent)
            release_free_heap()  # its chunks' buffers: back to the system, not kept in the allocator's arenas

    def _accepted_config(self) -> dict[str, object]:
        """The start as accepted (defaults filled in), echoed in video.start."""
        req = self.request
        extra: dict[str, object] = {**dict(req.extra), "hold_for_prompt": req.hold.enabled,
                                    "hold_max_seconds": req.hold.max_seconds}
        if req.hold.fallback_prompt is not None:
            extra["hold_fallback_prompt"] = req.hold.fallback_prompt
        if self._pacing is not None:
            extra.update(pace_to_media_time=True, pacing_lead_seconds=self._pacing.lead_s,
                         pacing_max_lag_seconds=self._pacing.max_lag_s)
        config: dict[str, object] = {
            "model": self._cfg.model, "prompt": req.prompt, "seed": req.seed, "width": req.width,
            "height": req.height, "fps": req.fps, "format": "m4s", "extra_params": extra}
        if self._num_frames is not None:
            config["num_frames"] = self._num_frames
        return config

    async def _wait_for_slot(self) -> bool:
        """Wait for a slot, reporting position changes; return True if stopped while waiting."""
        if self.ticket.granted:
            return False
        queued_at = time.monotonic()
        stop_wait = asyncio.ensure_future(self._stop_requested.wait())
        try:
            while not self.ticket.granted:
                position = self.ticket.position
                self._position_changed.clear()
                await self._sink.send(SessionQueued(self.request_id, position))
                changed = asyncio.ensure_future(self._position_changed.wait())
                granted = asyncio.ensure_future(self._service.scheduler.wait(self.ticket))
                try:
                    await asyncio.wait({changed, granted, stop_wait},
                                       return_when=asyncio.FIRST_COMPLETED)
                finally:
                    changed.cancel()
                    granted.cancel()
                if stop_wait.done():
                    return True
            return False
        finally:
            stop_wait.cancel()
            self._metrics.queue_wait.observe(time.monotonic() - queued_at)

    async def _start_pipeline(self) -> PipelineSession | None:
        """Start the backend session within `stall_timeout_s`; None when stopped while the backend was busy.

        The slot is ours, so a stage that answers `backend_busy` still holds the slot's previous session: the
        gateway's cancel returns at once, but a DiT group frees a cancelled session only at its next check
        between forwards. Such a start is retried until the deadline.
        """
        down = await self._service.pipeline.wait_ready(self._cfg.backend_wait_s)
        if down:  # a stage is restarting (or gone): say which, rather than hang on it
            raise BackendUnavailable(f"stage {', '.join(down)} not serving after {self._cfg.backend_wait_s:g} s; "
                                     "the node restarts failed stages: try again shortly")
        deadline = time.monotonic() + self._cfg.stall_timeout_s
        logged = False
        while True:
            try:
                return await asyncio.wait_for(
                    self._service.pipeline.start(self.request), max(0.0, deadline - time.monotonic())
                )
            except asyncio.TimeoutError:
                raise _Stalled() from None
            except PipelineError as exc:
                if exc.code != ErrorCode.BACKEND_BUSY.value or time.monotonic() + _BUSY_RETRY_S >= deadline:
                    raise
                if not logged:
                    logged = True
                    logger.info("session %s: backend still busy with the slot's previous session (%s); retrying",
                                self.request_id, exc)
            if self.stopped:
                return None
            await asyncio.sleep(_BUSY_RETRY_S)

    async def _pump(self, pipe: PipelineSession) -> None:
        """Forward chunks until the backend ends the stream, honouring stop and the stall clock."""
        previous: float | None = None
        iterator = pipe.chunks().__aiter__()
        stop_wait = asyncio.ensure_future(self._stop_requested.wait())
        try:
            budget_spent = False
            while (chunk := await self._next_chunk(pipe, iterator, stop_wait)) is not None:
                if budget_spent and chunk.kind == "media":  # after the budget only the trailer goes out
                    logger.error("session %s: the backend sent a chunk past the frame budget (request %d phase %d); "
                                 "dropped", self.request_id, chunk.request_index, chunk.phase_index)
                    continue
                now = time.monotonic()
                self._last_progress = now
                if chunk.kind == "media":
                    if previous is None:
                        self._metrics.time_to_first_chunk.observe(now - self._granted_at)
                    else:
                        self._metrics.chunk_interval.observe(now - previous)
                    previous = now
                if self._pacer is not None and not self.stopped:
                    delay = self._pacer.delay_for(now, chunk.num_frames / self.request.fps)
                    if delay > 0:
                        await asyncio.wait({stop_wait}, timeout=delay)
                await self._send_chunk(chunk)
                if not budget_spent and self._ends_budget(chunk):
                    budget_spent = True
                if self._drain_deadline is None and budget_spent:
                    # The frame budget is spent: end the stream as a completed one (trailer, session.done).
                    self._drain_deadline = time.monotonic() + self._cfg.drain_timeout_s
                    await self._cancel_pipe(pipe)
        finally:
            stop_wait.cancel()
            with contextlib.suppress(Exception):
                await iterator.aclose()  # type: ignore[attr-defined]

    async def _next_chunk(self, pipe: PipelineSession, iterator: AsyncIterator[MediaChunk],
                          stop_wait: asyncio.Future) -> MediaChunk | None:
        """Await the next chunk (None at the end); on stop, cancel the backend and drain briefly."""
        step = asyncio.ensure_future(iterator.__anext__())
        try:
            while True:
                if self._drain_deadline is None:
                    waiting, timeout = {step, stop_wait}, self._cfg.queue_poll_s
                else:
                    waiting, timeout = {step}, max(0.0, self._drain_deadline - time.monotonic())
                done, _ = await asyncio.wait(waiting, timeout=timeout,
                                             return_when=asyncio.FIRST_COMPLETED)
                if step in done:
                    try:
                        return step.result()
                    except StopAsyncIteration:
                        return None
                if self._drain_deadline is not None:
                    logger.warning("session %s: backend did not end within %.1f s of stop",
                                   self.request_id, self._cfg.drain_timeout_s)
                    return None
                if stop_wait.done():
                    self._drain_deadline = time.monotonic() + self._cfg.drain_timeout_s
                    await self._cancel_pipe(pipe)
                elif time.monotonic() - self._last_progress > self._cfg.stall_timeout_s:
                    raise _Stalled()
        finally:
            if not step.done():
                step.cancel()

    def _ends_budget(self, chunk: MediaChunk) -> bool:
        """True when `chunk` completes the last request of the session's `num_frames` budget."""
        return (self._max_requests is not None and chunk.kind == "media" and not chunk.phase_continues
                and chunk.request_index >= self._max_requests - 1
                and chunk.phase_index == PHASES_PER_REQUEST - 1)

    async def _send_chunk(self, chunk: MediaChunk) -> None:
        metadata = ChunkMetadata(
            request_id=self.request_id, kind=chunk.kind, transport_chunk_index=self._chunks_sent,
            generation_chunk_index=self._media_chunks if chunk.kind == "media" else None,
            request_index=chunk.request_index, phase_index=chunk.phase_index,
            num_frames=chunk.num_frames, num_audio_samples=chunk.num_audio_samples,
            audio_sample_rate=chunk.audio_sample_rate, byte_length=len(chunk.data),
            started_event_ids=chunk.started_event_ids, active_event_ids=chunk.active_event_ids,
            completed_event_ids=chunk.completed_event_ids, timings=chunk.timings.as_dict(),
        )
        await self._sink.send_media(metadata, chunk.data)
        self.broadcast.publish(metadata.to_wire(), chunk.data)  # never waits on viewers
        self._chunks_sent += 1
        if chunk.kind == "media" and not chunk.phase_continues:  # a generation chunk is a whole phase
            self._media_chunks += 1
        self._metrics.observe_chunk(len(chunk.data), chunk.timings)

    async def _forward_updates(self, pipe: PipelineSession) -> None:
        """Forward prompt updates one at a time, in arrival order."""
        while True:
            event_id, prompt = await self._updates.get()
            try:
                await pipe.update_prompt(event_id, prompt)
            except PipelineError as exc:
                logger.info("session %s: update %s rejected: %s", self.request_id, event_id, exc)
                self._event_ids.discard(event_id)  # as in vLLM-Omni, a failed update's event id may be reused
                await self._send_error(ErrorCode.INTERACTION_FAILED, exc.message, event_id=event_id, fault=exc.fault)
                continue
            except Exception as exc:  # noqa: BLE001 - one failed update must not end the forwarding task
                logger.exception("session %s: update %s failed unexpectedly", self.request_id, event_id)
                self._event_ids.discard(event_id)
                await self._send_error(ErrorCode.INTERACTION_FAILED,
                                       f"the update could not be forwarded ({type(exc).__name__})",
                                       event_id=event_id, fault="server")
                continue
            with contextlib.suppress(ClientGone):
                await self._sink.send(InteractionQueued(self.request_id, event_id))

    async def _cancel_pipe(self, pipe: PipelineSession) -> None:
        try:
            await pipe.cancel()
        except Exception:  # noqa: BLE001 - cancellation is best effort; the slot is freed anyway
            logger.exception("session %s: backend cancel failed", self.request_id)

    async def _send_error(self, code: ErrorCode, message: str, *, event_id: str | None = None,
                          fault: Fault | None = None) -> None:
        """Send one `error`; its fault is the code's unless given (a backend error's own side)."""
        self._metrics.errors_total.labels(code=code.value).inc()
        with contextlib.suppress(ClientGone):
            await self._sink.send(ErrorMessage(code, message, event_id=event_id,
                                               request_id=self.request_id, fault=fault))
