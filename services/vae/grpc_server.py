"""gRPC mapping of the VAE stage: one `Decode` call is one stream; each phase_end yields its fMP4 chunks (one, or
three for the stream's first phase: `DecodeSession.phase`).

The stream's order (phases in order, each alone on the shared decoders, the trailer last) is the core's
(`services.vae.service.DecodeStream`); this module maps messages. When the client closes its request stream, the
muxer is closed and its closing bytes go out as a last chunk ending in `trailer` (the AAC encoder's held-back
audio); a phase whose phase_end never came is dropped. Cancelling the call drops everything. However a call ends,
its stream's encoders are freed and its heap given back before the call is done (`DecodeStream.release`).

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
from services.vae.service import Chunk, DecodeStreams, VAEService
from vitascope.common.v1 import tensor_pb2
from vitascope.vae.v1 import vae_pb2, vae_pb2_grpc

log = logging.getLogger(__name__)


def chunk_messages(index: int, chunk: Chunk, *, trailer: bool = False,
                   release_video: tensor_pb2.Release | None = None,
                   release_audio: tensor_pb2.Release | None = None) -> list[vae_pb2.DecodeResponse]:
    """One chunk's bytes as responses of at most 1 MiB; the final one carries the chunk's `end` (`trailer`: the
    muxer's closing bytes). The phase's CUDA IPC releases (if any) ride on the first response."""
    pieces = [chunk.data[i:i + MAX_PART_BYTES] for i in range(0, len(chunk.data), MAX_PART_BYTES)] or [b""]
    end = "trailer" if trailer else "phase_continues" if chunk.phase_continues else "phase_done"
    messages = [vae_pb2.DecodeResponse(
        data=piece, chunk_index=index, num_frames=chunk.num_frames, num_audio_samples=chunk.num_audio_samples,
        video_decode_seconds=chunk.video_decode_seconds, audio_decode_seconds=chunk.audio_decode_seconds,
        mux_seconds=chunk.mux_seconds) for piece in pieces]
    getattr(messages[-1], end).SetInParent()
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
        self.streams = DecodeStreams(service)
        """The decode streams' order and their turns on the shared decoders (`DecodeStreams`)."""

    async def Decode(self, request_iterator, context: grpc.aio.ServicerContext):
        ACTIVE_SESSIONS.inc()
        try:
            first = await anext(aiter(request_iterator), None)
            if first is None or first.WhichOneof("kind") != "start":
                raise SequenceMismatch("the first message of a Decode stream must be `start`")
            s = first.start
            session_span = tracing.continue_trace(tracing.metadata_traceparent(context.invocation_metadata()))
            with log_context(session_id=s.session_id or None, trace_id=session_span.trace_id):
                releases: dict[str, tensor_pb2.Release | None] = {"video": None, "audio": None}
                phase_end = vae_pb2.PhaseEnd()

                async def write(index: int, chunk: Chunk) -> None:
                    observe(index, phase_end, chunk)
                    for message in chunk_messages(index, chunk, release_video=releases["video"],
                                                  release_audio=releases["audio"]):
                        await context.write(message)
                    releases.update(video=None, audio=None)  # a phase's releases ride on its first chunk

                stream = await self.streams.open(s.width, s.height, s.fps or VIDEO_FPS,
                                                 s.sample_rate or AUDIO_SAMPLE_RATE, write)
                try:
                    log.info("decode session opened: %dx%d", s.width, s.height)
                    parts = {kind: TensorReceiver(f"{kind} latents", self.consumer, self._device)
                             for kind in ("video", "audio")}
                    async for request in request_iterator:
                        kind = request.WhichOneof("kind")
                        if kind in ("video", "audio"):
                            stream.expect(kind)
                            latents, release = await parts[kind].receive(getattr(request, kind))
                            if latents is not None:
                                getattr(stream, kind)(latents)
                                releases[kind] = release
                        elif kind == "phase_end":
                            phase_end = request.phase_end
                            await stream.end_phase(phase_end.request_index, phase_end.phase_index)
                        else:
                            raise SequenceMismatch(f"unexpected {kind} after start")
                    if stream.partial:
                        log.info("request stream closed inside phase %d: its partial latents are dropped",
                                 stream.chunks)
                    tail = await stream.close()
                    log.info("decode session closed after %d chunks (trailer %d bytes)", stream.chunks,
                             len(tail.data))
                    if tail.data:
                        for message in chunk_messages(stream.chunks, tail, trailer=True):
                            await context.write(message)
                finally:  # closed, failed or cancelled: its encoders are freed, its heap given back
                    await stream.release()
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


def register(server: grpc.aio.Server, service: VAEService) -> None:
    """Add the vae servicer (and the Transport/Hello servicer) to a server."""
    vae_pb2_grpc.add_VAEServicer_to_server(VAEServicer(service), server)
    register_transport(server)
