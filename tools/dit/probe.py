"""A timed DiT forward of one synthetic phase: the bench's comparison with diffusers, on one GPU or a whole group.

`phase_inputs` builds the same seeded document on every rank and device (text, audio and the video rows of
`latents` latents at a canvas, a student step's timesteps, no history); `time_forward` runs it through
`FullAttention` and returns the median time of a few runs after one warm-up (`time_call`: CUDA events on a GPU).
Under Ulysses `group_forward_seconds` has every rank call it with the same inputs (`DiTGroup.run_on_every_rank`),
so rank 0's time is the group's. Knows nothing about sessions, the KV cache or diffusers.
"""
from __future__ import annotations

import functools
import statistics
import time
from typing import Callable

import torch

from services.dit.stream.geometry import SIDE_MULTIPLE, Canvas
from services.dit.model.layout import PackedLayout, pack_layout
from services.dit.group.orchestration import DiTGroup
from services.dit.model.network import DiT, FullAttention
from services.dit.stream.runtime import DiTRuntime
from services.dit.stream.schedule import AUDIO_SIGMAS, VIDEO_SIGMAS, model_t

TEXT_ROWS = 400
AUDIO_LATENTS = 57
"""Audio latents per channel of a 10-latent phase."""
SEED = 3


def phase_inputs(model: DiT, height: int, width: int, latents: int = 10
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, PackedLayout]:
    """(video [Tv, 96], audio [2 * 57, 32], text [400, text_dim], layout) of one phase without history."""
    if height % SIDE_MULTIPLE or width % SIDE_MULTIPLE or height <= 0 or width <= 0:
        raise ValueError(f"canvas {width}x{height}: both sides must be positive multiples of {SIDE_MULTIPLE}")
    a = model.args
    dev = model.condition_proj.weight.device
    tv = latents * Canvas(width, height).rows_per_frame
    gen = torch.Generator().manual_seed(SEED)  # on the CPU: the same draws on every device

    def rand(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=gen)

    layout = pack_layout(text_len=TEXT_ROWS, audio_len_per_channel=AUDIO_LATENTS, video_rows=tv,
                         positions_text=rand(TEXT_ROWS, 3) * 100, positions_audio=rand(2 * AUDIO_LATENTS, 3) * 100,
                         positions_video=rand(tv, 3) * 100, video_t=model_t(VIDEO_SIGMAS[1]),
                         audio_t=model_t(AUDIO_SIGMAS[1])).to(dev)
    video = torch.randn(tv, a.video_row_dim, generator=gen).to(dev)
    audio = torch.randn(2 * AUDIO_LATENTS, a.audio_channels, generator=gen).to(dev)
    text = torch.randn(TEXT_ROWS, a.text_dim, generator=gen).to(dev, model.dtype)
    return video, audio, text, layout


def time_forward(model: DiT, inputs: tuple, runs: int = 5) -> float:
    """Median seconds of `runs` forwards of `inputs` (from `phase_inputs`) after one warm-up."""
    video, audio, text, layout = inputs
    return time_call(lambda: model(video, audio, text, layout, FullAttention(layout)), video.device, runs)


def time_call(fn: Callable[[], object], device: torch.device, runs: int = 5) -> float:
    """Median seconds of `runs` calls of `fn` after one warm-up: CUDA events on a GPU, the wall clock elsewhere."""
    if runs < 1:
        raise ValueError(f"runs={runs}: time at least one forward")
    times = []
    with torch.no_grad():
        for i in range(runs + 1):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                seconds = start.elapsed_time(end) / 1e3
            else:
                started = time.perf_counter()
                fn()
                seconds = time.perf_counter() - started
            if i:  # the first run warms up
                times.append(seconds)
    return statistics.median(times)


def timed_phase_forward(runtime: DiTRuntime, height: int, width: int, latents: int, runs: int) -> float:
    """`time_forward` of `phase_inputs` on this rank's model (what each rank of a group runs)."""
    model = runtime.model
    return time_forward(model, phase_inputs(model, height, width, latents), runs)


def group_forward_seconds(group: DiTGroup, height: int, width: int, latents: int = 10, runs: int = 5) -> float:
    """Median seconds of one synthetic phase forward run by the whole group, between sessions."""
    if latents < 1 or runs < 1:  # checked here: a worker would die of it
        raise ValueError(f"latents={latents}, runs={runs}: probe at least one latent, at least once")
    phase_inputs(group.runtime.model, height, width, latents)  # validates the canvas before any rank moves
    probe = functools.partial(timed_phase_forward, height=height, width=width, latents=latents, runs=runs)
    return group.run_on_every_rank(probe)
