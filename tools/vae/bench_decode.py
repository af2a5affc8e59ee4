"""Video VAE decode benchmark: the diffusers per-tile loop against `VideoDecoder`'s batched tiles, one phase at a time.

Knows nothing about gRPC, muxing or the DiT. It builds the video VAE of a preset with seeded random weights directly
on the device (zero-initialised gates, register tokens and biases get noise so every block matters), casts it the way
`from_pretrained(torch_dtype=...)` does (diffusers' `_keep_in_fp32_modules` stay float32), and times two phases of one
stream: the 12-latent first phase (34 frames out, 5 held) and a 10-latent later phase (2 carried + 10 latents -> 34
frames).

- old: `AutoencoderKLMiniMaxH3.decode` (one ViT call per spatial tile per 17-frame clip) + the wrapper's
  post-processing, which is what `VideoDecoder.decode_pixels` did before batching;
- new: `VideoDecoder.decode_pixels` / `IncrementalVideoDecoder.decode_pixels` (all tiles of all clips in one batch);
- new+uint8: `IncrementalVideoDecoder.decode`, i.e. also quantised and copied to the host.

Timings are the median of `--repeats` runs after `--warmup` runs (CUDA events on a GPU, wall clock on the CPU).

    python -m tools.vae.bench_decode --preset full --device cuda --height 480 --width 864
    python -m tools.vae.bench_decode --preset tiny --device cpu --height 192 --width 320   # smoke test
    python -m tools.vae.bench_decode --tile-overlap 32 --compile --vit-tiles 4 8   # host vs device of one ViT call
"""
from __future__ import annotations

import argparse
import logging
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
from diffusers import AutoencoderKLMiniMaxH3
from diffusers.models.modeling_utils import get_parameter_dtype

from tools.gpu_trace import host_and_device_ms
from services.vae.incremental import IncrementalVideoDecoder
from services.vae.model import _IMAGENET_MEAN, _IMAGENET_STD, VideoDecoder, build_video_vae

logger = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class Timing:
    """One timed path on one phase."""

    path: str
    phase: str
    frames: int
    median_ms: float
    peak_gib: float | None  # peak allocated device memory during the timed runs (None on the CPU)

    def line(self) -> str:
        peak = "n/a" if self.peak_gib is None else f"{self.peak_gib:.2f} GiB"
        return (f"{self.phase:<22} {self.path:<10} {self.median_ms:9.1f} ms/phase "
                f"{self.frames / self.median_ms * 1e3:8.1f} frames/s   peak {peak}")


def build_random_vae(preset: str, device: torch.device, dtype: torch.dtype, seed: int) -> AutoencoderKLMiniMaxH3:
    """Build the video VAE of `preset` on `device` with seeded random weights, cast like `from_pretrained`."""
    torch.manual_seed(seed)
    with torch.device(device):
        vae = build_video_vae(preset)
    gen = torch.Generator(device=device).manual_seed(seed)
    pinned = set(vae._keep_in_fp32_modules or ())
    with torch.no_grad():
        for name, param in vae.named_parameters():
            flat = param.flatten()
            if param.numel() > 1 and bool((flat == flat[0]).all()):  # zero gates / tokens / biases, unit norms
                param.add_(0.2 * torch.randn(param.shape, generator=gen, device=device))
            keep_fp32 = any(part in pinned for part in name.split("."))
            param.data = param.data.to(torch.float32 if keep_fp32 else dtype)
    return vae.eval()


def legacy_decode_pixels(vae: AutoencoderKLMiniMaxH3, latents: torch.Tensor) -> torch.Tensor:
    """Decode `[F, 24, h, w]` the pre-batching way: `vae.decode` (tile loop) + de-normalisation, `[N, H, W, 3]`."""
    stats = dict(device=latents.device, dtype=torch.float32)
    mean = torch.tensor(vae.config.latents_mean, **stats).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std, **stats).view(1, -1, 1, 1, 1)
    with torch.inference_mode():
        sample = vae.decode(latents.float().permute(1, 0, 2, 3)[None] * std + mean).sample  # [1, 3, N, H, W]
    rgb = sample[0].permute(1, 2, 3, 0).float()
    rgb_mean = torch.tensor(_IMAGENET_MEAN, **stats)
    rgb_std = torch.tensor(_IMAGENET_STD, **stats)
    return (rgb * rgb_std + rgb_mean).clamp_(0.0, 1.0)


def time_ms(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int) -> tuple[float, float | None]:
    """Return (median ms, peak GiB allocated on the device during the timed runs) of `fn()`."""
    for _ in range(warmup):
        fn()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    samples = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
    return statistics.median(samples), peak


def time_vit_tiles(decoder: VideoDecoder, tiles: int, height: int, width: int, repeats: int) -> str:
    """One ViT call on `tiles` tiles of one 7-latent clip (a share of a clip's tiles, as `_decode_share` runs it):
    the median host time to return against the device time, so a decode bound by the host shows."""
    vae, device = decoder.vae, decoder.device
    _, tile_h, _, _, tile_w, _ = decoder.tile_grid(height, width)
    ratio = decoder.spatial_ratio
    shape = (tiles, vae.config.latent_channels, vae.tokens_chunk_size + vae.token_overlap, tile_h // ratio,
             tile_w // ratio)  # [N, C, 7, th, tw]
    z = torch.randn(shape, generator=torch.Generator().manual_seed(5))
    z = z.to(device, get_parameter_dtype(vae.post_quant_conv))
    with torch.inference_mode():
        host, dev = host_and_device_ms(lambda: vae.decoder(vae.post_quant_conv(z)), device, repeats)
    return (f"ViT on {tiles} tiles [{', '.join(map(str, shape))}]: host {host:.1f} ms to return, "
            f"device {dev:.1f} ms (median of {repeats})")


def run(opts: argparse.Namespace) -> list[str]:
    """Run the benchmark and return the report lines."""
    device = torch.device(opts.device)
    dtype = _DTYPES[opts.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    vae = build_random_vae(opts.preset, device, dtype, opts.seed)
    decoder = VideoDecoder(vae, max_batch=opts.max_batch, tile_overlap=opts.tile_overlap,
                           compile_blocks=opts.compile and bool(opts.vit_tiles))
    if opts.vit_tiles:
        return [time_vit_tiles(decoder, n, opts.height, opts.width, opts.repeats) for n in opts.vit_tiles]
    ratio = decoder.spatial_ratio
    if opts.height % ratio or opts.width % ratio:
        raise ValueError(f"--height/--width must be multiples of {ratio}, got {opts.height}x{opts.width}")
    h, w = opts.height // ratio, opts.width // ratio
    gen = torch.Generator(device=device).manual_seed(opts.seed + 1)
    first = torch.randn(12, 24, h, w, generator=gen, device=device)
    later = torch.randn(10, 24, h, w, generator=gen, device=device)
    carried = torch.cat([first[-2:], later])  # what IncrementalVideoDecoder decodes for the later phase

    inc = IncrementalVideoDecoder(decoder)
    new_first, new_later = inc.decode_pixels(first), inc.decode_pixels(later)
    # the stream's frames are the whole decode's, less the 5 it holds back at the end
    whole = legacy_decode_pixels(vae, torch.cat([first, later]))
    old_first, old_later = whole[:new_first.shape[0]], whole[new_first.shape[0]:-inc.context_frames]
    ys, _, _, xs, _, _ = decoder.tile_grid(opts.height, opts.width)
    held = "" if device.type != "cuda" else \
        f", {torch.cuda.memory_allocated(device) / 2**30:.2f} GiB held before timing (weights + kept outputs)"
    lines = [f"video VAE {opts.preset} on {device} ({dtype}), {opts.height}x{opts.width}: "
             f"{len(ys)}x{len(xs)} = {len(ys) * len(xs)} tiles per clip, 2 clips per phase, max_batch "
             f"{decoder.max_batch}; median of {opts.repeats} after {opts.warmup} warm-up{held}"]
    for name, old, new in (("first (12 latents)", old_first, new_first), ("later (10 latents)", old_later, new_later)):
        diff = (new - old).abs()
        mismatch = ((new * 255).round() != (old * 255).round()).float().mean().item()
        lines.append(f"{name}: max |new - old| {diff.max().item():.3e}, mean {diff.mean().item():.3e} "
                     f"(RGB in [0, 1], std of the frames {new.std().item():.3f}); uint8 values that differ: "
                     f"{mismatch:.4%}")

    timings = []
    for path, phase, frames, fn in (
            ("old", "first (12 latents)", old_first.shape[0], lambda: legacy_decode_pixels(vae, first)),
            ("new", "first (12 latents)", new_first.shape[0], lambda: decoder.decode_pixels(first)),
            ("old", "later (10 latents)", old_later.shape[0], lambda: legacy_decode_pixels(vae, carried)),
            ("new", "later (10 latents)", new_later.shape[0], lambda: inc.decode_pixels(later)),
            ("new+uint8", "later (10 latents)", new_later.shape[0], lambda: inc.decode(later))):
        median, peak = time_ms(fn, device, opts.repeats, opts.warmup)
        timings.append(Timing(path, phase, frames, median, peak))
        logger.info("%s %s: %.1f ms", path, phase, median)
    if opts.compile:
        vae.compile_repeated_blocks()
        try:
            inc.reset()
            inc.decode_pixels(first)
            compiled = inc.decode_pixels(later)  # same carried context as new_later
            median, peak = time_ms(lambda: inc.decode_pixels(later), device, opts.repeats, max(opts.warmup, 2))
        except RuntimeError as exc:  # an optional measurement: report the failure, keep the eager results
            logger.exception("torch.compile of the ViT blocks failed")
            lines.append(f"new+compile: failed ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})")
        else:
            timings.append(Timing("new+compile", "later (10 latents)", new_later.shape[0], median, peak))
            lines.append(f"new+compile vs new, later phase: max |diff| "
                         f"{(compiled - new_later).abs().max().item():.3e}")
    lines += [t.line() for t in timings]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="full", choices=["full", "tiny"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--width", type=int, default=864)
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default=None,
                        help="ViT compute dtype (default: bfloat16 on CUDA, float32 on the CPU)")
    parser.add_argument("--max-batch", type=int, default=64, help="most (clip, tile) pairs per ViT call")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tile-overlap", type=int, default=None,
                        help="minimum tile overlap in px for both paths (default: the model's, 64 in the release)")
    parser.add_argument("--compile", action="store_true",
                        help="also time the new path with the ViT blocks torch.compile'd (diffusers' "
                             "compile_repeated_blocks)")
    parser.add_argument("--vit-tiles", type=int, nargs="+", default=[],
                        help="instead: time one ViT call on each of these tile counts of a clip, host against device "
                             "(with --compile, the blocks compiled first)")
    opts = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    for line in run(opts):
        print(line, flush=True)


if __name__ == "__main__":
    main()
