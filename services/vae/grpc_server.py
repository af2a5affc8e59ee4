"""gRPC mapping of the VAE stage: one `Decode` call is one stream; each phase_end yields its fMP4 chunks (one, or
three for the stream's first phase: `DecodeSession.phase`).

When the client closes its request stream, the muxer is closed and its closing bytes go out as a last chunk
with `trailer` set (the AAC encoder's held-back audio); a phase whose phase_end never came is dropped.
Cancelling the call drops everything.

Transport: latent parts are host bytes or CUDA IPC references into the DiT's exported pool (`TensorPart.cuda`).
A CUDA IPC part is copied out at once (onto `vae.device` when that is a GPU) by the process's one `IpcConsumer`,
and the slot's `Release` goes back on the FIRST response message of that phase's chunk
(`DecodeResponse.release_video` / `release_audio`), which the gateway relays to the DiT. A malformed reference
fails that call only (INVALID_ARGUMENT). `DecodeStart.consumer` is not used: the VAE consumes, it does not
produce tensors. The server also answers `vitascope.common.v1.Transport/Hello` with this process's hello.

Observability: every log line of a call carries `start.session_id` and the session's trace id (from the
`traceparent` call metadata, or a new trace when absent); each chunk's line also carries the DiT phase's
span from `PhaseEnd.trace` with its decode and mux seconds.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from services.common import tracing
from services.tensors.cuda_ipc import IpcConsumer
from services.common.errors import SequenceMismatch, abort_with
from services.common.logging_setup import log_context
from services.common.media import AUDIO_SAMPLE_RATE, VIDEO_FPS
from services.common.metrics import ACTIVE_SESSIONS, STAGE_LATENCY, record_gpu_memory
from services.tensors.stage_transport import ProcessConsumer, TensorReceiver, register_transport
from services.tensors.transport import MAX_PART_BYTES
from services.vae.service import Chunk, VAEService
from vitascope.common.v1 import tensor_pb2
from vitascope.vae.v1 import vae_pb2, vae_pb2_grpc

log = logging.getLogger(__name__)


def chunk_messages(index: int, chunk: Chunk, *, trailer: bool = False,
                   release_video: tensor_pb2.Release | None = None,
                   release_audio: tensor_pb2.Release | None = None) -> list[vae_pb2.DecodeResponse]:
    """One chunk's bytes as responses of at most 1 MiB; `last` marks the final one, `trailer` the muxer's
    closing bytes. The phase's CUDA IPC releases (if any) ride on the first response."""
    pieces = [chunk.data[i:i + MAX_PART_BYTES] for i in range(0, len(chunk.data), MAX_PART_BYTES)] or [b""]
    messages = [vae_pb2.DecodeResponse(
        data=piece, last=i == len(pieces) - 1, chunk_index=index, num_frames=chunk.num_frames,
        num_audio_samples=chunk.num_audio_samples, video_decode_seconds=chunk.video_decode_seconds,
        audio_decode_seconds=chunk.audio_decode_seconds, mux_seconds=chunk.mux_seconds, trailer=trailer,
        phase_continues=chunk.phase_continues)
        for i, piece in enumerate(pieces)]
    if release_video is not None:
        messages[0].release_video.CopyFrom(release_video)
    if release_audio is not None:
        messages[0].release_audio.CopyFrom(release_audio)
    return messages


class VAEServicer(vae_pb2_grpc.VAEServicer):
    """`consumer`: returns the process's one `IpcConsumer` (created on the first CUDA IPC part; it opens each
    producer's pool once)."""

    def __init__(self, service: VAEService, consumer: Callable[[], IpcConsumer] | None = None):
        self.service = service
        self.consumer = ProcessConsumer(consumer or IpcConsumer)
        profile = getattr(service, "profile", None)
        device = profile.vae.device if profile is not None else "cpu"
        self._device = device if device.startswith("cuda") else None  # IPC latents are copied onto the decoder's GPU
        self._phases = asyncio.Lock()
        """One phase at a time decodes on the shared decoders. A session's chunks hold the service's own lock from
        its first chunk to its last, so the sessions queue here, on the event loop: waiting for that lock in
        worker threads, enough of them filled the pool and the holder could never make its next chunk."""

    async def Decode(self, request_iterator, context: grpc.aio.ServicerContext):
        ACTIVE_SESSIONS.inc()
        try:
            first = await anext(aiter(request_iterator), None)
            if first is None or first.WhichOneof("kind") != "start":
                raise SequenceMismatch("the first message of a Decode stream must be `start`")
            s = first.start
            session_span = tracing.continue_trace(tracing.metadata_traceparent(context.invocation_metadata()))
            with log_context(session_id=s.session_id or None, trace_id=session_span.trace_id):
                session = await asyncio.to_thread(self.service.open, s.width, s.height, s.fps or VIDEO_FPS,
                                                  s.sample_rate or AUDIO_SAMPLE_RATE)
                log.info("decode session opened: %dx%d", s.width, s.height)
                video_parts = TensorReceiver("video latents", self.consumer, self._device)
                audio_parts = TensorReceiver("audio latents", self.consumer, self._device)
                video = audio = video_release = audio_release = None
                index, last_phase = 0, None
                async for request in request_iterator:
                    kind = request.WhichOneof("kind")
                    if kind == "video":
                        if video is not None:
                            _twice("video")
                        video, video_release = await video_parts.receive(request.video)
                    elif kind == "audio":
                        if audio is not None:
                            _twice("audio")
                        audio, audio_release = await audio_parts.receive(request.audio)
                    elif kind == "phase_end":
                        if video is None or audio is None:
                            raise SequenceMismatch("phase_end before the phase's video and audio latents")
                        phase = (request.phase_end.request_index, request.phase_end.phase_index)
                        if last_phase is not None and phase <= last_phase:
                            raise SequenceMismatch(f"phase_end of (request, phase) {phase} after {last_phase}: "
                                                   "phases must arrive in order, each once")
                        last_phase = phase
                        async with self._phases:
                            chunks = await asyncio.to_thread(session.phase, video.float(), audio.float())
                            making = None  # the chunk being made in a worker thread
                            try:  # each chunk goes out as soon as it is muxed (a first phase has three)
                                while True:
                                    making = asyncio.ensure_future(asyncio.to_thread(next, chunks, None))
                                    chunk = await asyncio.shield(making)
                                    making = None
                                    if chunk is None:
                                        break
                                    observe(index, request.phase_end, chunk)
                                    for message in chunk_messages(index, chunk, release_video=video_release,
                                                                  release_audio=audio_release):
                                        await context.write(message)
                                    index, video_release, audio_release = index + 1, None, None
                            finally:  # a cancelled call leaves its phase: the shared decoders are freed for others
                                if making is not None:  # cancelled while a chunk was made: it ends first
                                    await asyncio.wait([making])
                                await asyncio.to_thread(chunks.close)
                        video, audio = None, None
                    else:
                        raise SequenceMismatch(f"unexpected {kind} after start")
                if video is not None or audio is not None:
                    log.info("request stream closed inside phase %d: its partial latents are dropped", index)
                tail = await asyncio.to_thread(session.close)
                log.info("decode session closed after %d chunks (trailer %d bytes)", index, len(tail.data))
                if tail.data:
                    for message in chunk_messages(index, tail, trailer=True):
                        await context.write(message)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the boundary: every failure becomes a status
            await abort_with(context, exc)
        finally:
            ACTIVE_SESSIONS.dec()


def observe(index: int, phase_end: vae_pb2.PhaseEnd, chunk: Chunk) -> None:
    """Record one chunk's stage latencies and log them with the DiT phase's trace context."""
    timings = (("video_decode", chunk.video_decode_seconds), ("audio_decode", chunk.audio_decode_seconds),
               ("mux", chunk.mux_seconds))
    for stage, seconds in timings:
        STAGE_LATENCY.labels(stage=stage).observe(seconds)
    record_gpu_memory()
    fields: dict[str, object] = {"chunk_index": index, "request_index": phase_end.request_index,
                                 "phase_index": phase_end.phase_index}
    try:
        phase_span = tracing.parse_optional(phase_end.trace.traceparent)
    except tracing.TraceContextError as exc:  # a bad trace never fails decoding; the line says why
        log.warning("chunk %d: ignoring the phase's trace context: %s", index, exc)
        phase_span = None
    if phase_span is not None:
        fields.update(phase_span.log_fields())
    fields.update({f"{stage}_s": round(seconds, 4) for stage, seconds in timings})
    log.info("chunk %d decoded (%d bytes)", index, len(chunk.data), extra=fields)


def _twice(what: str):
    raise SequenceMismatch(f"a second {what} tensor arrived before phase_end")


def register(server: grpc.aio.Server, service: VAEService) -> None:
    """Add the vae servicer (and the Transport/Hello servicer) to a server."""
    vae_pb2_grpc.add_VAEServicer_to_server(VAEServicer(service), server)
    register_transport(server)
