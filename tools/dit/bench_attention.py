"""Attention kernels on the streaming forwards' shapes: `python -m tools.dit.bench_attention` (CUDA).

For each shape (a phase's media rows over the KV cache, its text rows and the current rows; per USP2 rank, 28
heads, and on one GPU, 56), one call of every kernel `dit.attention` can run: SDPA's cuDNN and flash kernels, and
FlashAttention 4 when it imports. Prints the median device time of a call, its TFLOP/s and its error against a float32
reference. q is a plane of a packed `[S, 3, H, D]` buffer, as the Ulysses receive buffer hands it to the pattern.
Knows nothing about sessions.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from services.dit.model.attention_kernels import load_flash_attention_4, sdpa_rows
from services.dit.stream.geometry import check_canvas, plan_request
from services.dit.model.network import PRESETS
from tools.dit.probe import time_call


@dataclass(frozen=True)
class AttentionShape:
    name: str
    heads: int
    q_rows: int
    k_rows: int

    @property
    def flops(self) -> float:
        return 4.0 * self.q_rows * self.k_rows * self.heads * PRESETS["full"].head_dim


def streaming_shapes(text_rows: int = 400, history_rows: int = 13000) -> list[AttentionShape]:
    """The media rows' attention at 480×864 of a steady phase (10 and 5 latents, over `history_rows` of KV cache)
    and of a session's first (12 latents, no history), per USP2 rank and on one GPU."""
    heads, canvas = PRESETS["full"].num_heads, check_canvas(864, 480, (480,))
    shapes = []
    for phase, history in ((plan_request(1).phases[0], history_rows), (plan_request(1).phases[3], history_rows),
                           (plan_request(0).phases[0], 0)):
        media = phase.media_rows(canvas)
        for ranks in (2, 1):
            shapes.append(AttentionShape(f"{phase.num_latents} latents, {'USP2 rank' if ranks == 2 else 'one GPU'}",
                                         heads // ranks, media, history + media + text_rows))
    return shapes


def kernels() -> dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]]:
    """Label -> one attention call `[Sq, H, D]` x `[Sk, H, D]` -> `[Sq, H, D]` with that kernel alone."""
    def sdpa_with(backend: SDPBackend):
        def call(q, k, v):
            with sdpa_kernel([backend]):
                return sdpa_rows(q, k, v)
        return call

    found = {"cudnn": sdpa_with(SDPBackend.CUDNN_ATTENTION), "flash2": sdpa_with(SDPBackend.FLASH_ATTENTION)}
    try:
        fa4 = load_flash_attention_4()
    except RuntimeError as e:
        print(f"FlashAttention 4 left out: {e}")
    else:
        found["fa4"] = lambda q, k, v: fa4(q[None], k[None], v[None])[0][0]
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50)
    opts = parser.parse_args()
    dev, head_dim = torch.device("cuda"), PRESETS["full"].head_dim
    calls = kernels()
    table = []
    for shape in streaming_shapes():
        gen = torch.Generator(device=dev).manual_seed(0)
        packed = torch.randn(shape.q_rows, 3, shape.heads, head_dim, device=dev, dtype=torch.bfloat16, generator=gen)
        k, v = (torch.randn(shape.k_rows, shape.heads, head_dim, device=dev, dtype=torch.bfloat16, generator=gen)
                for _ in range(2))
        q = packed[:, 0]  # [Sq, H, D], rows 3·H·D apart
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
            reference = sdpa_rows(q.float(), k.float(), v.float())
        row = [shape]
        for label, call in calls.items():
            ms = time_call(lambda: call(q, k, v), dev, opts.runs) * 1e3  # median after a warm-up (compiles FA4)
            out = call(q, k, v).float()
            err = ((out - reference).norm() / reference.norm()).item()
            row.append((label, ms, err))
        table.append(row)
    labels = list(calls)
    print(f"{'shape':24s} {'heads':>5s} {'q rows':>6s} {'k rows':>6s} "
          + " ".join(f"{label + ' ms':>9s} {'TFLOP/s':>7s} {'err':>7s}" for label in labels)
          + (f" {'fa4 vs cudnn':>12s}" if "fa4" in labels else ""))
    for shape, *cells in table:
        times = {label: ms for label, ms, _ in cells}
        line = f"{shape.name:24s} {shape.heads:5d} {shape.q_rows:6d} {shape.k_rows:6d} " + " ".join(
            f"{ms:9.3f} {shape.flops / ms / 1e9:7.0f} {err:7.1e}" for _, ms, err in cells)
        if "fa4" in times:
            line += f" {times['cudnn'] / times['fa4']:11.2f}x"
        print(line)


if __name__ == "__main__":
    main()
