"""Mux benchmark: one phase's frames through `FragmentedMP4Muxer` from RGB (swscale converts) and from I420 planes.

    python -m tools.vae.bench_mux --width 864 --height 480 --frames 45

The frames are a smooth random picture per frame (libx264's time depends on the content; noise would be its worst
case), in the decoder's memory layout, which the RGB path gathers frame by frame. The I420 planes are converted by
`to_i420` beforehand, as the VAE does on a GPU, so only the host's part is timed. Prints the best of `--repeats`
chunks for each input. Knows nothing about the decoders or the DiT.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from services.common.media import AUDIO_SAMPLE_RATE, VIDEO_FPS
from services.vae.model import to_i420, to_uint8
from services.vae.mux import FragmentedMP4Muxer


def frames_for(width: int, height: int, count: int, seed: int = 0) -> torch.Tensor:
    """Float RGB `[count, height, width, 3]` in [0, 1]: random colours at 1/16 of the size, upsampled, laid out in
    memory as `VideoDecoder.decode_pixels` leaves them (a view of `[3, count, height, width]`)."""
    gen = torch.Generator().manual_seed(seed)
    small = torch.rand(3, count, max(height // 16, 1), max(width // 16, 1), generator=gen)
    big = torch.nn.functional.interpolate(small, size=(height, width), mode="bilinear")  # [3, count, H, W]
    return big.permute(1, 2, 3, 0)


def time_chunks(frames: np.ndarray, width: int, height: int, repeats: int) -> float:
    """Best seconds to mux `frames` as one chunk, after a first chunk that carries the init segment."""
    audio = np.zeros((2, round(frames.shape[0] * AUDIO_SAMPLE_RATE / VIDEO_FPS)), np.float32)
    muxer = FragmentedMP4Muxer(width, height, fps=VIDEO_FPS, sample_rate=AUDIO_SAMPLE_RATE)
    muxer.encode(frames, audio)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        muxer.encode(frames, audio)
        best = min(best, time.perf_counter() - started)
    muxer.close()
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=864)
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--frames", type=int, default=45, help="frames per chunk (a 12-latent first phase: 45)")
    parser.add_argument("--repeats", type=int, default=5)
    opts = parser.parse_args()
    pixels = frames_for(opts.width, opts.height, opts.frames)
    rgb = to_uint8(pixels).numpy()
    i420 = to_i420(pixels).numpy()
    t_rgb = time_chunks(rgb, opts.width, opts.height, opts.repeats)
    t_i420 = time_chunks(i420, opts.width, opts.height, opts.repeats)
    print(f"mux of {opts.frames} frames at {opts.width}x{opts.height}, best of {opts.repeats}: "
          f"from RGB {t_rgb * 1e3:.0f} ms, from I420 {t_i420 * 1e3:.0f} ms ({1 - t_i420 / t_rgb:.0%} less)")


if __name__ == "__main__":
    main()
