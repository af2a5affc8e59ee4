"""gRPC mapping of the VAE stage: one `Decode` call is one stream; each phase_end yields one fMP4 chunk."""
from __future__ import annotations

import asyncio
import logging

import grpc

from services.common.errors import SequenceMismatch, abort_with
from services.common.metrics import ACTIVE_SESSIONS, STAGE_LATENCY
from services.common.transport import MAX_PART_BYTES, TensorAssembler
from services.vae.service import Chunk, VAEService
from vitascope.vae.v1 import vae_pb2, vae_pb2_grpc

log = logging.getLogger(__name__)


def chunk_messages(index: int, chunk: Chunk) -> list[vae_pb2.DecodeResponse]:
    """One chunk's bytes as responses of at most 1 MiB; `last` marks the final one."""
    pieces = [chunk.data[i:i + MAX_PART_BYTES] for i in range(0, len(chunk.data), MAX_PART_BYTES)] or [b""]
    return [vae_pb2.DecodeResponse(
        data=piece, last=i == len(pieces) - 1, chunk_index=index, num_frames=chunk.num_frames,
        num_audio_samples=chunk.num_audio_samples, video_decode_seconds=chunk.video_decode_seconds,
        audio_decode_seconds=chunk.audio_decode_seconds, mux_seconds=chunk.mux_seconds)
        for i, piece in enumerate(pieces)]


class VAEServicer(vae_pb2_grpc.VAEServicer):
    def __init__(self, service: VAEService):
        self.service = service

    async def Decode(self, request_iterator, context: grpc.aio.ServicerContext):
        ACTIVE_SESSIONS.inc()
        try:
            first = await anext(aiter(request_iterator), None)
            if first is None or first.WhichOneof("kind") != "start":
                raise SequenceMismatch("the first message of a Decode stream must be `start`")
            s = first.start
            session = await asyncio.to_thread(self.service.open, s.width, s.height, s.fps or 24,
                                              s.sample_rate or 32000)
            video_parts, audio_parts = TensorAssembler("video latents"), TensorAssembler("audio latents")
            video = audio = None
            index = 0
            async for request in request_iterator:
                kind = request.WhichOneof("kind")
                if kind == "video":
                    video = video_parts.add(request.video) if video is None else _twice("video")
                elif kind == "audio":
                    audio = audio_parts.add(request.audio) if audio is None else _twice("audio")
                elif kind == "phase_end":
                    if video is None or audio is None:
                        raise SequenceMismatch("phase_end before the phase's video and audio latents")
                    chunk = await asyncio.to_thread(session.phase, video.float(), audio.float())
                    for stage, seconds in (("video_decode", chunk.video_decode_seconds),
                                           ("audio_decode", chunk.audio_decode_seconds),
                                           ("mux", chunk.mux_seconds)):
                        STAGE_LATENCY.labels(stage=stage).observe(seconds)
                    for message in chunk_messages(index, chunk):
                        yield message
                    index, video, audio = index + 1, None, None
                else:
                    raise SequenceMismatch(f"unexpected {kind} after start")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the boundary: every failure becomes a status
            await abort_with(context, exc)
        finally:
            ACTIVE_SESSIONS.dec()


def _twice(what: str):
    raise SequenceMismatch(f"a second {what} tensor arrived before phase_end")
