"""Eager forward benchmark of the DiT on one streaming-like phase: `python -m tools.dit.bench_forward`.

Random weights are built on the device (no checkpoint). Media rows attend to [text | cached history | media]
through a self-contained attention callable holding random cached K/V (one buffer shared by all layers: same FLOPs
and bytes per layer as a real cache, a fraction of the memory); text rows see text only. Reports the median time
over several runs, the analytic FLOP count, achieved TFLOP/s and peak memory, without and with the AdaLN cache.
Knows nothing about the streaming runtime, real KV retention or checkpoints.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from dataclasses import dataclass

import torch

from services.dit.model.attention_kernels import sdpa_rows
from services.dit.model.layout import PackedLayout, pack_layout
from services.dit.model.network import PRESETS, DiT, ModelArgs, build_random

log = logging.getLogger(__name__)


class HistoryAttention:
    """Media rows over [text | random history | media]; text rows over text; pad rows alone."""

    def __init__(self, layout: PackedLayout, history_rows: int, heads: int, head_dim: int, device, dtype, seed: int):
        self.tt, self.real = layout.text_len, layout.num_real
        self.hist = history_rows
        gen = torch.Generator(device=device).manual_seed(seed)
        rows = self.tt + history_rows + layout.num_media  # [text | history | media]
        self.k = torch.randn(rows, heads, head_dim, device=device, dtype=dtype, generator=gen)
        self.v = torch.randn(rows, heads, head_dim, device=device, dtype=dtype, generator=gen)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q, k, v: [S, H, D]
        tt, real, h0 = self.tt, self.real, self.tt + self.hist
        self.k[:tt], self.v[:tt] = k[:tt], v[:tt]
        self.k[h0:], self.v[h0:] = k[tt:real], v[tt:real]
        parts = [sdpa_rows(q[:tt], k[:tt], v[:tt]), sdpa_rows(q[tt:real], self.k, self.v)]
        if real < q.shape[0]:
            parts.append(sdpa_rows(q[real:], k[real:], v[real:]))
        return torch.cat(parts, dim=0)


@dataclass(frozen=True)
class Geometry:
    video_rows: int
    audio_per_channel: int
    text_rows: int
    history_rows: int


def analytic_flops(a: ModelArgs, layout: PackedLayout, history_rows: int) -> tuple[float, float]:
    """(linear FLOPs, attention FLOPs) of one forward: 2*rows*in*out per linear, 4*q*kv*D*H per attention."""
    s, tt, m, pad = layout.seq_len, layout.text_len, layout.num_media, layout.seq_len - layout.num_real
    c, i, f, hd = a.hidden_size, a.inner_dim, a.ffn_hidden, a.head_dim * a.num_heads
    per_row = c * 3 * i + i * c + c * 2 * f + f * c  # qkv, out, fc1, fc2
    lin = 2.0 * (a.num_layers * s + a.refiner_layers * tt) * per_row
    lin += 2.0 * (tt * a.text_dim * c + layout.video_len * a.video_row_dim * c + layout.audio_rows * a.audio_channels * c)
    lin += 2.0 * (layout.video_len * c * a.video_row_dim + layout.audio_rows * c * a.audio_channels)
    att = 4.0 * hd * (a.num_layers * (tt * tt + m * (tt + history_rows + m) + pad * pad) + a.refiner_layers * tt * tt)
    return lin, att


def _phase(a: ModelArgs, g: Geometry, device, seed: int):
    gen = torch.Generator().manual_seed(seed)
    tt, al, tv = g.text_rows, g.audio_per_channel, g.video_rows
    layout = pack_layout(
        text_len=tt, audio_len_per_channel=al, video_rows=tv,
        positions_text=torch.stack([torch.arange(tt).float(), torch.zeros(tt), torch.zeros(tt)], 1),
        positions_audio=torch.rand(2 * al, 3, generator=gen) * 60, positions_video=torch.rand(tv, 3, generator=gen) * 60,
        video_t=1 - 0.9612, audio_t=1 - 0.8609).to(device)
    inputs = (torch.randn(tv, a.video_row_dim, generator=gen).to(device),
              torch.randn(2 * al, a.audio_channels, generator=gen).to(device),
              torch.randn(tt, a.text_dim, generator=gen).to(device))
    return layout, inputs


def _time(model: DiT, layout, inputs, attention, device, runs: int, warmup: int) -> tuple[float, bool]:
    cuda = device.type == "cuda"
    times, finite = [], True
    for r in range(warmup + runs):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        out = model(*inputs, layout, attention)
        if cuda:
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end)
        else:
            ms = (time.perf_counter() - t0) * 1e3
        if r >= warmup:
            times.append(ms)
        finite = finite and all(bool(torch.isfinite(o).all()) for o in out)
    return statistics.median(times), finite


def run(preset: str, device: str, geometry: Geometry, runs: int, warmup: int, seed: int) -> list[dict]:
    dev = torch.device(device)
    a = PRESETS[preset]
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    log.info("building %s preset with random %s weights on %s", preset, dtype, dev)
    model = build_random(a, dev, dtype, seed)
    layout, inputs = _phase(a, geometry, dev, seed)
    attention = HistoryAttention(layout, geometry.history_rows, a.num_heads, a.head_dim, dev, dtype, seed)
    lin, att = analytic_flops(a, layout, geometry.history_rows)
    results = []
    with torch.inference_mode():
        for cached in (False, True):
            if cached:
                report = model.cache_adaln(layout.timestep_values)
                log.info("AdaLN cache: freed %.2f GB of weights, table %.1f MB", report.bytes_freed / 1e9,
                         report.bytes_table / 1e6)
            if dev.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats(dev)
            ms, finite = _time(model, layout, inputs, attention, dev, runs, warmup)
            peak = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else float("nan")
            weights = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
            results.append(dict(adaln_cache=cached, ms=ms, tflop=(lin + att) / 1e12, lin_tflop=lin / 1e12,
                                att_tflop=att / 1e12, tflops=(lin + att) / (ms * 1e-3) / 1e12, peak_gib=peak,
                                weights_gib=weights, finite=finite))
    log.info("rows: seq %d = text %d + audio %d + video %d + pad %d; history %d", layout.seq_len, layout.text_len,
             layout.audio_rows, layout.video_len, layout.seq_len - layout.num_real, geometry.history_rows)
    log.info("%-11s %10s %9s %9s %9s %9s %10s %10s %6s", "adaln_cache", "median_ms", "TFLOP", "lin", "attn",
             "TFLOP/s", "peak_GiB", "weights_GiB", "finite")
    for r in results:
        log.info("%-11s %10.2f %9.3f %9.3f %9.3f %9.1f %10.2f %10.2f %6s", r["adaln_cache"], r["ms"], r["tflop"],
                 r["lin_tflop"], r["att_tflop"], r["tflops"], r["peak_gib"], r["weights_gib"], r["finite"])
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="full")
    p.add_argument("--device", default="cuda")
    p.add_argument("--latents", type=int, default=None, help="video latent frames (full: 10, tiny: 2)")
    p.add_argument("--height", type=int, default=480)
    p.add_argument("--width", type=int, default=864)
    p.add_argument("--audio-per-channel", type=int, default=57)
    p.add_argument("--text", type=int, default=400)
    p.add_argument("--history", type=int, default=None, help="cached history rows (full: 13000, tiny: 1000)")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    ns = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    tiny = ns.preset == "tiny"
    latents = ns.latents if ns.latents is not None else (2 if tiny else 10)
    history = ns.history if ns.history is not None else (1000 if tiny else 13000)
    if ns.height % 32 or ns.width % 32:
        raise SystemExit(f"--height {ns.height} / --width {ns.width} must be multiples of 32")
    g = Geometry(video_rows=latents * (ns.height // 32) * (ns.width // 32), audio_per_channel=ns.audio_per_channel,
                 text_rows=ns.text, history_rows=history)
    run(ns.preset, ns.device, g, ns.runs, ns.warmup, ns.seed)


if __name__ == "__main__":
    main()
