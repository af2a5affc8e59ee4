"""The kernels that finish the QKV projection and fc1, at the streaming forwards' row counts:
`python -m tools.dit.bench_lora_kernels` (CUDA).

For each shape (the media rows of a steady phase, 10 and 5 latents at 480×864, per USP2 rank and on one GPU; the
audio teacher's document per USP2 rank), `lora_kernels.qkv_heads` with the LoRA branch and without it, and
`lora_kernels.swiglu` with it, on random BF16 inputs of the full model's sizes. Beside each, its floor: the bytes it
must move (read the base output, write its result) at the copy bandwidth measured in the same run. Prints the
median device time of one call, timed over back-to-back calls replayed as a CUDA graph: timing single launches
would add the host's launch latency (tens of microseconds) to kernels of that size. Knows nothing about sessions.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable

import torch

from services.dit.model import lora_kernels
from services.dit.stream.geometry import check_canvas, plan_request
from services.dit.model.network import PRESETS
from tools.dit.probe import time_call

RANK = 128
"""TaoMate's LoRA rank."""
TEACHER_ROWS = 704
"""The audio teacher's document: 400 text rows, 2 x 137 audio rows and bucket padding."""


@dataclass(frozen=True)
class KernelShape:
    name: str
    rows: int
    """Rows on the device."""
    groups: int
    """Head groups of the send buffer: the Ulysses degree."""


def streaming_shapes() -> list[KernelShape]:
    """Media rows of a steady 10- and 5-latent phase at 480×864, per USP2 rank and on one GPU; the teacher's document
    per USP2 rank."""
    canvas = check_canvas(864, 480, (480,))
    shapes = []
    for phase in (plan_request(1).phases[0], plan_request(1).phases[3]):
        media = phase.media_rows(canvas)
        for ranks in (2, 1):
            shapes.append(KernelShape(f"{phase.num_latents} latents, {'USP2 rank' if ranks == 2 else 'one GPU'}",
                                      -(-media // ranks), ranks))
    shapes.append(KernelShape("teacher, USP2 rank", TEACHER_ROWS // 2, 2))
    return shapes


def replayed_seconds(fn: Callable[[], object], calls: int, runs: int) -> float:
    """Median seconds of one `fn()` (CUDA), from `runs` replays of a graph of `calls` back-to-back calls."""
    fn()  # compiles and warms up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return time_call(graph.replay, torch.device("cuda"), runs) / calls


def copy_bandwidth(dev: torch.device, runs: int) -> float:
    """Bytes per second read and written by a device-to-device copy of 336 MiB."""
    src = torch.ones(8192, 3 * PRESETS["full"].inner_dim, device=dev, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    return 2 * src.numel() * src.element_size() / replayed_seconds(lambda: dst.copy_(src), 5, runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7, help="graph replays per figure")
    parser.add_argument("--calls", type=int, default=20, help="back-to-back calls per graph")
    opts = parser.parse_args()
    dev, args = torch.device("cuda"), PRESETS["full"]
    heads, dim, qkv_cols, fc1_cols = args.num_heads, args.head_dim, 3 * args.inner_dim, 2 * args.ffn_hidden
    gen = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape: int, spread: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, device=dev, dtype=torch.bfloat16, generator=gen) * spread

    bandwidth = copy_bandwidth(dev, opts.runs)
    print(f"copy bandwidth: {bandwidth / 1e12:.2f} TB/s")
    up_qkv, up_fc1 = rand(qkv_cols, RANK, spread=0.02), rand(fc1_cols, RANK, spread=0.02)
    q_weight, k_weight = rand(dim) + 1, rand(dim) + 1
    print(f"{'shape':22s} {'rows':>5s} {'qkv ms':>7s} {'no branch':>9s} {'floor':>6s} {'fc1 ms':>7s} {'floor':>6s}")
    for shape in streaming_shapes():
        rows = shape.rows
        base, fc1, down = rand(rows, qkv_cols), rand(rows, fc1_cols), rand(rows, RANK)
        cos, sin = rand(rows, args.rope_dims), rand(rows, args.rope_dims)
        send = torch.empty(shape.groups, rows, 3, heads // shape.groups, dim, device=dev, dtype=torch.bfloat16)

        def qkv(branch: bool) -> None:
            lora_kernels.qkv_heads(base, down if branch else None, up_qkv if branch else None, 1.0, q_weight,
                                   k_weight, args.qk_norm_eps, cos, sin, send)

        qkv_ms = replayed_seconds(lambda: qkv(True), opts.calls, opts.runs) * 1e3
        plain_ms = replayed_seconds(lambda: qkv(False), opts.calls, opts.runs) * 1e3
        fc1_ms = replayed_seconds(lambda: lora_kernels.swiglu(fc1, down, up_fc1, 1.0), opts.calls, opts.runs) * 1e3
        qkv_floor = 2 * base.numel() * 2 / bandwidth * 1e3  # read base, write send
        fc1_floor = 1.5 * fc1.numel() * 2 / bandwidth * 1e3  # read [S, 2F], write [S, F]
        print(f"{shape.name:22s} {rows:5d} {qkv_ms:7.3f} {plain_ms:9.3f} {qkv_floor:6.3f} {fc1_ms:7.3f} "
              f"{fc1_floor:6.3f}")


if __name__ == "__main__":
    main()
