"""The session benchmark's VAE stage (`tools.bench`): the VAE service's per-stream decode and fMP4 mux
(`DecodeSession`) in a process of its own on the last device, fed through a queue behind the services' credit
window; or, with `--no-vae`, no decode at all.

Knows nothing about the DiT or the encoder: it takes each phase's latents and reports each phase's stage seconds and
when its chunks were muxed.
"""
from __future__ import annotations

import copy
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from services.common.config import VAEConfig
from services.common.media import AUDIO_SAMPLE_RATE, VIDEO_FPS
from services.vae.incremental import audio_graph_lengths, warm_up_video
from services.vae.model import AudioDecoder, VideoDecoder, build_audio_vae, build_video_vae
from services.vae.service import DecodeSession


def vae_worker(opts, inbox, outbox) -> None:
    """The VAE stage in its own process on the last device: decode and mux every phase put in `inbox`.

    Messages in: ("phase", video [F, C, h, w], audio [2, A, 32], the monotonic time it was put), ("reset",) before a
    new session, None to stop. Out: "ready" once built, then per phase a dict of stage seconds summed over its chunks
    (`hand_over`: from the put to the decode's start, the latents on the device), the monotonic time its last chunk
    was muxed, and `first_chunk`: the video decode, mux and muxed time of its first chunk (a session's first phase
    comes as three chunks: its first 5 frames, the rest of its first clip, the rest).
    """
    device = torch.device(opts.devices.split(",")[-1])
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    with torch.inference_mode():
        vae = build_video_vae(opts.preset).to(device, dtype).eval()
        replicas = [copy.deepcopy(vae).to(d) for d in opts.vae_tile_devices.split(",") if d]
        decoder = VideoDecoder(vae, tile_overlap=opts.tile_overlap, tile_replicas=replicas,
                               compile_blocks=opts.vae_compile)
        if opts.vae_compile:
            warm_up_video(decoder, opts.width, opts.height)
        audio = AudioDecoder(build_audio_vae(opts.preset).to(device).eval())
        if opts.vae_graphs:
            audio.capture_graphs(audio_graph_lengths(audio))
        lock, audio_worker, session = threading.Lock(), ThreadPoolExecutor(1, "vae-audio"), None
        outbox.put("ready")
        while (msg := inbox.get()) is not None:
            if msg[0] == "reset":  # the VAE service's own per-stream decode and mux
                session = DecodeSession(decoder, audio, opts.width, opts.height, VIDEO_FPS, AUDIO_SAMPLE_RATE,
                                        VAEConfig().x264_preset, lock, audio_worker)
                continue
            _, video, audio_latents, put = msg
            video, audio_latents = video.to(device), audio_latents.to(device)
            hand_over = time.monotonic() - put
            chunks = []
            for chunk in session.phase(video, audio_latents):
                chunks.append(dict(video_decode=chunk.video_decode_seconds, audio_decode=chunk.audio_decode_seconds,
                                   mux=chunk.mux_seconds, bytes=len(chunk.data), delivered=time.monotonic()))
            totals = {k: sum(c[k] for c in chunks) for k in ("video_decode", "audio_decode", "mux", "bytes")}
            outbox.put(dict(hand_over=hand_over, **totals, delivered=chunks[-1]["delivered"], first_chunk=chunks[0]))
        audio_worker.shutdown()


class VAEStage:
    """This process's handle on the VAE worker: a credit window of phases in flight, as the services keep."""

    def __init__(self, opts, window: int):
        ctx = torch.multiprocessing.get_context("spawn")
        self.inbox, self.outbox = ctx.Queue(), ctx.Queue()
        self.process = ctx.Process(target=vae_worker, args=(opts, self.inbox, self.outbox), name="bench-vae")
        self.process.start()
        self.window, self.in_flight, self.results = window, 0, []
        if self.outbox.get(timeout=600) != "ready":
            raise RuntimeError("the VAE worker did not start")

    def new_session(self) -> None:
        self.drain()
        self.results = []
        self.inbox.put(("reset",))

    def submit(self, video: torch.Tensor, audio: torch.Tensor) -> None:
        while self.in_flight >= self.window:  # the DiT may run at most `window` phases ahead of delivered chunks
            self._take()
        self.inbox.put(("phase", video, audio, time.monotonic()))
        self.in_flight += 1

    def drain(self) -> list[dict]:
        while self.in_flight:
            self._take()
        return self.results

    def _take(self) -> None:
        result = self.outbox.get(timeout=600)
        self.results.append(result)
        self.in_flight -= 1

    def stop(self) -> None:
        self.inbox.put(None)
        self.process.join(timeout=60)


class NoVAE:
    """`--no-vae`: a chunk counts as delivered when the DiT hands it over (DiT-only sessions, e.g. long memory runs
    that would not fit one device call with the decode beside them)."""

    def __init__(self):
        self.results: list[dict] = []

    def new_session(self) -> None:
        self.results = []

    def submit(self, video: torch.Tensor, audio: torch.Tensor) -> None:
        now = time.monotonic()
        self.results.append(dict(hand_over=0.0, video_decode=0.0, audio_decode=0.0, mux=0.0, bytes=0, delivered=now,
                                 first_chunk=dict(video_decode=0.0, mux=0.0, delivered=now)))

    def drain(self) -> list[dict]:
        return self.results

    def stop(self) -> None:
        pass
