"""Where a student forward's time goes: `python -m tools.dit.profile_forward` (CUDA).

Times one 10-latent phase forward (480×864, 400 text rows, 13,000 history rows) of the full DiT with random
weights as features are switched on one by one — BF16 base, + LoRA side branch, the LoRA merged into the base,
FP8 block linears, the teacher's path (merged weights minus the side branch: what an unmerged student costs),
cuDNN's attention tried first — then profiles the last configuration and prints the kernels that take the most
GPU time, grouped into matrix products, attention and everything else. Last, the student
forward at smaller phases (5 and 1 latents, and the teacher's ~900-row audio document) with the host time the
call takes to return beside the device time: where they meet, the forward is bound by the host's per-op
dispatch, not the GPU. With `--fa4`, the two FP8 rows again with FlashAttention 4 (`dit.attention: fa4`).
Knows nothing about sessions.
"""
from __future__ import annotations

import argparse
import logging

import torch
from torch.nn.attention import sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from services.dit.model.attention_kernels import SDPA_ORDERS, prefer_attention_kernels
from tools.dit.bench_forward import Geometry, HistoryAttention, _phase, _time, analytic_flops
from services.dit.model.fp8 import quantize_linears
from services.dit.model.lora import LoRAAdapter, random_adapter_spec
from services.dit.model.network import PRESETS, build_random
from tools.gpu_trace import category, host_and_device_ms

log = logging.getLogger("tools.dit.profile_forward")


def dispatch_table(model, args, dev) -> list[str]:
    """Student forwards of shrinking phases: host time to return vs device time."""
    lines = [f"{'phase':28s} {'rows':>6s} {'host ms':>8s} {'device ms':>9s}"]
    shapes = (("10 latents + 13,000 history", Geometry(10 * 15 * 27, 57, 400, 13000)),
              ("5 latents + 13,000 history", Geometry(5 * 15 * 27, 29, 400, 13000)),
              ("1 latent + 13,000 history", Geometry(15 * 27, 6, 400, 13000)),
              ("teacher-size: 137 audio/ch", Geometry(0, 137, 400, 0)))
    for name, g in shapes:
        layout, inputs = _phase(args, g, dev, seed=0)
        attention = HistoryAttention(layout, g.history_rows, args.num_heads, args.head_dim, dev, torch.bfloat16, 0)
        host, device = host_and_device_ms(lambda: model(*inputs, layout, attention), dev)
        lines.append(f"{name:28s} {layout.seq_len:6d} {host:8.1f} {device:9.1f}")
    return lines


def host_profile(model, args, dev, top: int) -> list[str]:
    """Where the host time of a 1-latent student forward goes: the ops with the most self CPU time."""
    g = Geometry(15 * 27, 6, 400, 13000)
    layout, inputs = _phase(args, g, dev, seed=0)
    attention = HistoryAttention(layout, g.history_rows, args.num_heads, args.head_dim, dev, torch.bfloat16, 0)
    model(*inputs, layout, attention)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model(*inputs, layout, attention)
        torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]
    return ["host time of a 1-latent forward, by op (self CPU ms, calls):"] + [
        f"{e.self_cpu_time_total / 1e3:8.2f} ms {e.count:6d}x  {e.key[:90]}" for e in events]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--fa4", action="store_true",
                        help="last, the two FP8 rows again with FlashAttention 4 (dit.attention: fa4)")
    opts = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    dev, args = torch.device("cuda"), PRESETS["full"]
    g = Geometry(video_rows=10 * 15 * 27, audio_per_channel=57, text_rows=400, history_rows=13000)
    model = build_random(args, dev, torch.bfloat16, seed=0)
    layout, inputs = _phase(args, g, dev, seed=0)
    attention = HistoryAttention(layout, g.history_rows, args.num_heads, args.head_dim, dev, torch.bfloat16, 0)
    lin, att = analytic_flops(args, layout, g.history_rows)
    rows = []
    with torch.inference_mode():
        def timed(label: str) -> None:
            rows.append((label, _time(model, layout, inputs, attention, dev, opts.runs, 2)[0]))

        model.cache_adaln(layout.timestep_values)
        timed("bf16 base")
        adapter = LoRAAdapter(model, random_adapter_spec(args, dev, seed=1), torch.bfloat16)
        timed("bf16 + LoRA side branch")
        adapter.merge_into_base()
        timed("bf16, LoRA merged")
        quantize_linears(model)
        timed("fp8, LoRA merged (student)")
        with adapter.suspended():  # the branch's GEMMs: what an unmerged FP8 student costs
            timed("fp8 - LoRA side branch (teacher)")
        with sdpa_kernel(list(SDPA_ORDERS["cudnn"]), set_priority=True):  # the usp2 profile's order
            timed("fp8, LoRA merged, cuDNN first")
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                model(*inputs, layout, attention)
                torch.cuda.synchronize()
            dispatch = dispatch_table(model, args, dev) + host_profile(model, args, dev, opts.top)
        if opts.fa4:
            prefer_attention_kernels("fa4")  # for good: the rows above ran SDPA's kernels
            timed("fp8, LoRA merged, FA4")
            with adapter.suspended():
                timed("fp8 - LoRA side branch, FA4")
    totals: dict[str, float] = {}
    kernels = []
    for evt in prof.key_averages():
        us = evt.self_device_time_total
        if us <= 0:
            continue
        totals[category(evt.key)] = totals.get(category(evt.key), 0.0) + us
        kernels.append((us, evt.count, evt.key[:90]))
    print(f"rows {layout.seq_len} (text {layout.text_len}, media {layout.num_media}), history {g.history_rows}; "
          f"{lin / 1e12:.1f} TFLOP linear + {att / 1e12:.1f} TFLOP attention per forward")
    for name, ms in rows:
        print(f"{name:32s} {ms:8.1f} ms  {(lin + att) / (ms * 1e-3) / 1e12:6.0f} TFLOP/s")
    all_us = sum(totals.values())
    print("profiled student (fp8, LoRA merged, cuDNN first), GPU time by category: " + ", ".join(
        f"{k} {v / 1e3:.1f} ms ({100 * v / all_us:.0f}%)" for k, v in sorted(totals.items(), key=lambda kv: -kv[1])))
    for us, count, name in sorted(kernels, reverse=True)[:opts.top]:
        print(f"{us / 1e3:8.2f} ms {count:6d}x  [{category(name):9s}] {name}")
    print("\n".join(dispatch))


if __name__ == "__main__":
    main()
