"""VAE stage core: per session, decode each phase's latents incrementally and mux them into one fMP4 chunk.

Protocol-neutral (no gRPC). The decoder models are loaded once and shared; each session owns its own
incremental decoders (temporal context) and its own muxer (one H.264 + AAC timeline).

Threads: every stream's blocking work (opening, each chunk, closing) runs on the service's one decode thread, and a
phase's audio on its one audio thread; both run the warm-up, so the process's threads are the same from the first
session to the last (`services.common.threads` says why not the event loop's default executor).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import pathlib
import threading
import time
from concurrent.futures import Executor, ThreadPoolExecutor, wait
from dataclasses import dataclass
from fractions import Fraction
from typing import Awaitable, Callable, Iterator, Protocol

import torch

from services.common.config import Profile
from services.common.errors import InvalidInput, NotReady, SequenceMismatch
from services.common.grpc_server import Stage
from services.common.media import AUDIO_SAMPLE_RATE, VIDEO_FPS
from services.common.memory import release_free_heap
from services.common.startup import Steps
from services.common.threads import run_on
from services.vae.checkpoint import load_audio_vae, load_video_vae
from services.vae.incremental import (IncrementalAudioDecoder, IncrementalVideoDecoder, audio_graph_lengths,
                                      held_audio_latents, warm_up_video)
from services.vae.model import AudioDecoder, InvalidLatents, VideoDecoder, on_device
from services.vae.mux import EncodedTrack, FragmentedMP4Muxer

log = logging.getLogger(__name__)

FIRST_FRAGMENT_FRAMES = 5
"""Frames of a stream's first fragment: its first two latents' (1 + 4). The first clip's other frames follow in a
fragment of their own, so the first picture waits for the H.264 of 5 frames, not of the clip's 17 (an IDR frame
more per session)."""


@dataclass(frozen=True)
class Chunk:
    data: bytes
    """fMP4 bytes of one phase (the init segment is prepended on the first chunk)."""
    num_frames: int
    num_audio_samples: int
    video_decode_seconds: float
    audio_decode_seconds: float
    mux_seconds: float
    phase_continues: bool = False
    """More chunks of the same phase follow: a stream's first phase goes out as its first 5 frames, the rest of its
    first clip, then the rest."""


class DecodeSession:
    """One stream's decoders and muxer; `phase()` is called once per DiT phase, in order."""

    def __init__(self, video: VideoDecoder, audio: AudioDecoder, width: int, height: int, fps: int,
                 sample_rate: int, x264_preset: str, lock: threading.Lock, audio_worker: ThreadPoolExecutor,
                 audio_right_context: int = 0):
        if sample_rate != audio.sample_rate:
            raise InvalidInput(f"sample_rate={sample_rate}: the audio decoder produces {audio.sample_rate} Hz")
        if width % video.spatial_ratio or height % video.spatial_ratio:
            raise InvalidInput(f"canvas {width}x{height}: sides must be multiples of {video.spatial_ratio}")
        if fps != VIDEO_FPS:
            raise InvalidInput(f"fps={fps}: the video decoder's frames are {VIDEO_FPS} per second")
        self.width, self.height = width, height
        self._frames = 0
        """Frames the latents of the phases accepted so far span (those muxed and the decoder's held-back ones)."""
        self._audio_latents = 0
        """Audio latents per channel of the phases accepted so far."""
        self.video = IncrementalVideoDecoder(video)
        self.audio = IncrementalAudioDecoder(audio, right_context_latents=audio_right_context,
                                             held_latents=held_audio_latents(self.video.context_frames, fps,
                                                                             sample_rate, audio.hop_length))
        """Cut where the emitted video ends: the audio of the video's held-back frames waits with them for the next
        phase, which decodes it with that much true right context (`vae.audio_right_context` asks for more)."""
        self.mux = FragmentedMP4Muxer(width, height, fps=fps, sample_rate=sample_rate,
                                      codec_options={"preset": x264_preset})
        self._lock = lock
        self._audio_worker = audio_worker

    def phase(self, video_latents: torch.Tensor, audio_latents: torch.Tensor) -> Iterator[Chunk]:
        """Decode one phase ([F, 24, h, w] video, [2, A, 32] audio latents) and mux it; yield its chunks as each is
        ready: one fMP4 fragment, or, for a stream's first phase, its first `FIRST_FRAGMENT_FRAMES` frames, the rest
        of its first clip, then the rest (`IncrementalVideoDecoder.part_frames`), so a session's first chunk waits
        for one clip's decode and five frames' H.264.

        The latents are checked before the first chunk (InvalidInput); a caller that stops early must `close()` the
        generator, which lets the audio thread finish and frees the shared decoders for other sessions.
        The audio decodes and then AAC-encodes in the worker thread while the video decodes and H.264-encodes here:
        the audio decoder's kernels run on a stream of their own beside the video's ViT, and the two encoders run
        side by side on the host (FFmpeg runs without the GIL).
        """
        # video_latents: [F, 24, h, w]; the latent grid must match the canvas.
        expected = (self.height // self.video.decoder.spatial_ratio, self.width // self.video.decoder.spatial_ratio)
        if video_latents.ndim == 4 and tuple(video_latents.shape[2:]) != expected:
            raise InvalidInput(f"video latents grid {tuple(video_latents.shape[2:])} does not match the "
                               f"{self.width}x{self.height} canvas (expected {expected})")
        try:  # both checked before either decoder advances its carried context
            self.video.decoder.validate(video_latents)
            parts = self.video.part_frames(video_latents.shape[0])
            self.audio.decoder.validate(audio_latents)
        except InvalidLatents as exc:
            raise InvalidInput(str(exc)) from None
        # the phase's latents span its frames and, on a stream's first phase, the 5 the video decoder holds back
        held = self.video.context_frames if self._frames == 0 else 0
        emitted = self._frames + sum(parts) - (self.video.context_frames - held)  # frames muxed after this phase
        self._check_audio_covers_video(sum(parts) + held, audio_latents.shape[1])
        fragments = [[n] for n in parts]  # frames of each fragment, per decoded part
        if self.mux.frames_encoded == 0 and parts[0] > FIRST_FRAGMENT_FRAMES:
            fragments[0] = [FIRST_FRAGMENT_FRAMES, parts[0] - FIRST_FRAGMENT_FRAMES]
        return self._chunks(video_latents, audio_latents, fragments, emitted - sum(parts))

    def _check_audio_covers_video(self, frames: int, audio_latents: int) -> None:
        """Raise InvalidInput unless the stream's audio, this phase's included, ends within half an audio latent of
        its last video frame; then count the phase as accepted.

        A phase's audio ends where its last frame ends on the audio latent grid, rounded (the DiT's
        `audio_boundary`): short audio would leave the phase's last fragments without sound, long audio would run
        ahead of the picture for the rest of the stream.
        """
        frames_total, latents_total = self._frames + frames, self._audio_latents + audio_latents
        hop = self.audio.decoder.hop_length
        expected = Fraction(frames_total * self.mux.sample_rate, self.mux.fps * hop)  # latents that span the frames
        if abs(latents_total - expected) > Fraction(1, 2):
            raise InvalidInput(
                f"audio latents: this phase's {audio_latents} bring the stream to {latents_total} per channel, but its "
                f"{frames_total} frames span {float(expected):.2f} ({self.mux.sample_rate // hop} per second at "
                f"{self.mux.fps} fps); the phase needs {round(expected) - self._audio_latents}")
        self._frames, self._audio_latents = frames_total, latents_total

    def _chunks(self, video_latents: torch.Tensor, audio_latents: torch.Tensor, fragments: list[list[int]],
                first_frame: int) -> Iterator[Chunk]:
        sizes = [n for part in fragments for n in part]
        with self._lock:  # one phase at a time on the shared devices and the muxer
            ready = None
            if self.audio.decoder.stream is not None:  # the latents' copies are queued on this thread's stream
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(self.audio.decoder.device))
            audio = self._audio_worker.submit(self._decode_audio, audio_latents, ready, first_frame, sizes)
            try:
                k, t0 = 0, time.perf_counter()
                for i, frames in enumerate(self.video.decode_parts_for_mux(video_latents)):
                    video_seconds = time.perf_counter() - t0  # uint8 I420 planes (GPU) or RGB (CPU)
                    start = 0
                    for n in fragments[i]:
                        encoded = self.mux.encode_video(frames[start:start + n].numpy())
                        audio_seconds, tracks = audio.result()
                        samples, track = tracks[k]
                        data = self.mux.emit(encoded, track)
                        yield Chunk(data=data, num_frames=n, num_audio_samples=samples,
                                    video_decode_seconds=video_seconds,
                                    audio_decode_seconds=audio_seconds if k == 0 else 0.0,
                                    mux_seconds=time.perf_counter() - t0 - video_seconds,
                                    phase_continues=k < len(sizes) - 1)
                        k, start, t0, video_seconds = k + 1, start + n, time.perf_counter(), 0.0
            finally:
                wait([audio])  # the audio never outlives the lock

    def _decode_audio(self, latents: torch.Tensor, ready: "torch.cuda.Event | None", first_frame: int,
                      parts: list[int]) -> tuple[float, list[tuple[int, EncodedTrack]]]:
        """Worker thread: the decode's seconds and, for each fragment of the phase (`parts`: their frames, the first
        being the stream's frame `first_frame`; cut at their video frame boundaries), its samples per channel and
        their AAC. The audio is cut where the phase's last fragment ends; on a GPU the decode runs on the audio
        decoder's own stream, after `ready`."""
        rate, fps = self.mux.sample_rate, self.mux.fps
        frame_ends = [first_frame + f for f in itertools.accumulate(parts)]
        started = time.perf_counter()
        start = self.audio.returned_samples
        with on_device(self.audio.decoder.device), self.audio.decoder.own_stream(ready):
            samples = self.audio.decode(latents, until=frame_ends[-1] * rate // fps).numpy()  # [2, S]
        seconds = time.perf_counter() - started
        cuts = [min(max(f * rate // fps - start, 0), samples.shape[1]) for f in frame_ends[:-1]]
        bounds = [0, *cuts, samples.shape[1]]
        return seconds, [(b - a, self.mux.encode_audio(samples[:, a:b])) for a, b in zip(bounds, bounds[1:])]

    def close(self) -> Chunk:
        """Close the stream: the video decoder's held-back last frames and the audio held back with them in a
        fragment of their own, then the muxer's closing fragment with the audio the AAC encoder still held (b''
        when nothing was ever muxed)."""
        t0 = time.perf_counter()
        held = self.video.flush_for_mux() if self.mux.frames_encoded else None
        with on_device(self.audio.decoder.device), self.audio.decoder.own_stream(None):
            samples = self.audio.flush().numpy() if held is not None else None  # [2, S]
        audio_seconds = time.perf_counter() - t0
        self.audio.reset()
        num_frames, num_samples, data = 0, 0, b""
        if held is not None:
            num_frames, num_samples = held.shape[0], samples.shape[1]
            data = self.mux.emit(self.mux.encode_video(held.numpy()), self.mux.encode_audio(samples))
        data += self.mux.close()
        return Chunk(data=data, num_frames=num_frames, num_audio_samples=num_samples, video_decode_seconds=0.0,
                     audio_decode_seconds=audio_seconds, mux_seconds=time.perf_counter() - t0 - audio_seconds)

    def discard(self) -> None:
        """End the stream without its trailer (a failed or cancelled call): drop the decoders' carried context and
        free the muxer's encoders. Nothing after `close()`."""
        self.video.reset()
        self.audio.reset()
        self.mux.discard()


class Decoders(Protocol):
    """What a decode stream needs of the service: one stream's decoders and muxer, and the thread they run on."""

    decode_worker: Executor
    """The one thread that runs every stream's blocking work."""

    def open(self, width: int, height: int, fps: int, sample_rate: int) -> DecodeSession:
        """Start one stream's decoders and muxer."""


class DecodeStream:
    """One stream's order, protocol-neutral: per phase its video and audio latents once each, then its end, the
    phases in order, each decoded alone on the shared decoders (`phases`); `close()` gives the trailer, last.

    `write(index, chunk)` sends one chunk as soon as it is muxed (a stream's first phase has three); `run(f, *args)`
    runs blocking work on the service's decode thread. However the stream ends, `release()` ends it for good."""

    def __init__(self, session: DecodeSession, phases: asyncio.Lock, write: Callable[[int, Chunk], Awaitable[None]],
                 run: Callable[..., Awaitable]):
        self.session = session
        self._phases, self._write, self._run = phases, write, run
        self._video: torch.Tensor | None = None
        self._audio: torch.Tensor | None = None
        self._last_phase: tuple[int, int] | None = None
        self.chunks = 0
        """Chunks written so far (the next chunk's index)."""

    @property
    def partial(self) -> bool:
        """A phase's latents arrived without its end (they are dropped at close)."""
        return self._video is not None or self._audio is not None

    def expect(self, kind: str) -> None:
        """Raise SequenceMismatch if the phase already has its `kind` ("video" or "audio") latents."""
        if (self._video if kind == "video" else self._audio) is not None:
            raise SequenceMismatch(f"a second {kind} tensor arrived before phase_end")

    def video(self, latents: torch.Tensor) -> None:
        """Take the phase's video latents [F, 24, h, w]."""
        self.expect("video")
        self._video = latents

    def audio(self, latents: torch.Tensor) -> None:
        """Take the phase's audio latents [2, A, 32]."""
        self.expect("audio")
        self._audio = latents

    async def end_phase(self, request_index: int, phase_index: int) -> None:
        """Decode the phase whose latents arrived and write its chunks; raises SequenceMismatch out of order."""
        if self._video is None or self._audio is None:
            raise SequenceMismatch("phase_end before the phase's video and audio latents")
        phase = (request_index, phase_index)
        if self._last_phase is not None and phase <= self._last_phase:
            raise SequenceMismatch(f"phase_end of (request, phase) {phase} after {self._last_phase}: "
                                   "phases must arrive in order, each once")
        self._last_phase = phase
        video, audio, self._video, self._audio = self._video, self._audio, None, None
        async with self._phases:
            chunks = await self._run(self.session.phase, video.float(), audio.float())
            making = None  # the chunk being made in a worker thread
            try:  # each chunk goes out as soon as it is muxed (a first phase has three)
                while True:
                    making = asyncio.ensure_future(self._run(next, chunks, None))
                    chunk = await asyncio.shield(making)
                    making = None
                    if chunk is None:
                        break
                    await self._write(self.chunks, chunk)
                    self.chunks += 1
            finally:  # a cancelled call leaves its phase: the shared decoders are freed for others
                if making is not None:  # cancelled while a chunk was made: it ends first
                    await asyncio.wait([making])
                await self._run(chunks.close)

    async def close(self) -> Chunk:
        """Close the stream (a phase without its end is dropped); returns the trailer chunk, to go out last."""
        return await self._run(self.session.close)

    async def release(self) -> None:
        """End the stream for good, closed or not (a failed or cancelled call): its encoders are freed and what it
        allocated goes back to the system (`release_free_heap`). Queued behind the stream's other work on the
        decode thread, and done even when the awaiting call is cancelled."""
        await asyncio.shield(self._run(self._release))

    def _release(self) -> None:
        self.session.discard()
        release_free_heap()


class DecodeStreams:
    """Opens decode streams over one service's shared decoders; one phase at a time decodes on them.

    A session's chunks hold the service's own thread lock from its first chunk to its last, so the streams queue
    here, on the event loop: waiting for that lock in worker threads, enough of them filled the pool and the holder
    could never make its next chunk."""

    def __init__(self, service: Decoders):
        self.service = service
        self._phases = asyncio.Lock()

    async def run(self, func: Callable, *args):
        """`func(*args)` on the service's decode thread (`services.common.threads`)."""
        return await run_on(self.service.decode_worker, func, *args)

    async def open(self, width: int, height: int, fps: int, sample_rate: int,
                   write: Callable[[int, Chunk], Awaitable[None]]) -> DecodeStream:
        """Start one stream (its decoders and muxer, on the decode thread); `write` sends its chunks."""
        session = await self.run(self.service.open, width, height, fps, sample_rate)
        return DecodeStream(session, self._phases, write, self.run)


class VAEService(Stage):
    """Owns the shared video and audio decoders of one process."""

    def __init__(self, profile: Profile):
        self.profile = profile
        self.video: VideoDecoder | None = None
        self.audio: AudioDecoder | None = None
        self.audio_right_context = 0
        """`vae.audio_right_context` in latents (resolved against the decoder's receptive radius at start)."""
        self._lock = threading.Lock()
        self._audio_worker = ThreadPoolExecutor(1, "vae-audio")
        self.decode_worker = ThreadPoolExecutor(1, "vae-decode")
        """The one thread of every stream's blocking work (`DecodeStreams`) and of the warm-up."""

    def start(self) -> None:
        """Load both decoders from the checkpoint tree."""
        cfg = self.profile.vae
        root = pathlib.Path(self.profile.model.dir) / "MiniMax-H3"
        dtype = getattr(torch, cfg.dtype)
        loaded = Steps(log, "VAE weights", 2 + len(cfg.tile_devices))
        replicas = []
        for device in cfg.tile_devices:
            replicas.append(load_video_vae(root, device, dtype))
            loaded.tick(f"video VAE tile replica on {device}")
        self.video = VideoDecoder(load_video_vae(root, cfg.device, dtype), tile_overlap=cfg.tile_overlap_px,
                                  tile_replicas=replicas, compile_blocks=cfg.compile_blocks)
        loaded.tick(f"video VAE on {cfg.device}")
        self.audio = AudioDecoder(load_audio_vae(root, cfg.device, dtype))
        loaded.tick(f"audio VAE on {cfg.device}")
        radius = IncrementalAudioDecoder(self.audio).radius
        self.audio_right_context = radius if cfg.audio_right_context == "exact" else min(cfg.audio_right_context,
                                                                                          radius)
        if cfg.cuda_graphs:
            held = held_audio_latents(self.video.vae.frame_overlap, VIDEO_FPS, AUDIO_SAMPLE_RATE,
                                      self.audio.hop_length)
            self.audio.capture_graphs(audio_graph_lengths(self.audio, self.audio_right_context, held))
        log.info("VAE loaded on %s (%s), video tiles shared with %s", cfg.device, cfg.dtype, list(cfg.tile_devices))

    def close(self) -> None:
        """Stop the decode and audio threads."""
        self.decode_worker.shutdown(wait=True)
        self._audio_worker.shutdown(wait=True)

    def warmup(self) -> None:
        """Decode one short phase so kernels and the encoders are ready; with compiled ViT blocks, every phase
        shape of the gateway's allowed canvases first. Runs on the decode thread, which serves the streams."""
        self.decode_worker.submit(self._warm_up).result()

    def _warm_up(self) -> None:
        if self.profile.vae.compile_blocks:
            canvases = self.profile.gateway.allowed_canvases
            compiled = Steps(log, "video decoder compiles (every phase shape of a canvas)", len(canvases))
            for width, height in canvases:
                warm_up_video(self.video, width, height)
                compiled.tick(f"{width}x{height}")
        ratio = self.video.spatial_ratio
        session = self.open(4 * ratio, 4 * ratio, VIDEO_FPS, AUDIO_SAMPLE_RATE)
        for _ in session.phase(torch.zeros(12, self.video.vae.config.latent_channels, 4, 4),
                               torch.zeros(2, 65, self.audio.vae.config.latent_channels)):
            pass
        session.discard()

    def open(self, width: int, height: int, fps: int, sample_rate: int) -> DecodeSession:
        """Start one stream's decoders and muxer."""
        if self.video is None:
            raise NotReady("the VAE is still loading")
        return DecodeSession(self.video, self.audio, width, height, fps, sample_rate,
                             self.profile.vae.x264_preset, self._lock, self._audio_worker,
                             self.audio_right_context)
