"""Triton kernels that finish a LoRA linear inside the kernel reading its output (CUDA, 16-bit floats).

A LoRA linear's output is base + scale * B (A x): the base GEMM (FP8 or BF16) writes `base` `[S, N]` and the side
branch's down-projection writes A x (`down`, `[S, rank]`). Rather than a third GEMM writing B (A x) `[S, N]` for
the consumer to read back, the consumer does the rank-sized up-projection on tensor cores as it reads `base`:
- `qkv_heads`, the attention's input: q, k, v of base + branch; per-head RMSNorm of q and k, then rotate-half RoPE
  on their first `rope` channels; all three written by head group into the Ulysses send buffer.
- `swiglu`, the MLP's fc1: silu(gate) * up of base + branch, `[S, F]`.
Without a branch (`down` None: the LoRA suspended, or a linear without one) they do the same on `base` alone. Both
accumulate in float32 and round once. `model.py` holds the plain-torch reference they are tested against.
Knows nothing about modules, peft or the model.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_ROWS = 64
SWIGLU_COLS = 64
NUM_WARPS = 4
"""Tile sizes: the fastest of a sweep on one H200 at the streaming forwards' row counts (docs/decisions.md, 'LoRA kernel variants')."""


@triton.jit(do_not_specialize=["rows", "out_group"])  # one compile for every row count: none after start-up
def _qkv_heads_kernel(base, down, up, q_weight, k_weight, cos, sin, out,
                      rows, scale, eps, base_row, down_row, rope_row, out_group, out_row, out_part, out_head,
                      HEADS: tl.constexpr, GROUP_HEADS: tl.constexpr, DIM: tl.constexpr, ROPE: tl.constexpr,
                      RANK: tl.constexpr, RANK_P: tl.constexpr, BRANCH: tl.constexpr, BLOCK: tl.constexpr):
    column = tl.program_id(1)  # part * HEADS + head: the DIM-wide column block of base this program reads
    part = column // HEADS  # 0 q, 1 k, 2 v
    head = column % HEADS
    c = tl.arange(0, DIM)
    half: tl.constexpr = ROPE // 2
    partner = tl.where(c < half, c + half, tl.where(c < ROPE, c - half, c))  # rotate-half's other channel
    sign = tl.where(c < half, -1.0, 1.0)
    cols = column * DIM + c
    partners = tl.broadcast_to(partner[None, :], (BLOCK, DIM))
    r = tl.arange(0, RANK_P)
    if BRANCH:  # B rows of this head [DIM, RANK_P] (as they lie: contiguous along the rank), zero past the rank
        up_rows = tl.load(up + cols[:, None] * RANK + r[None, :], mask=r[None, :] < RANK, other=0.0)
    weight = tl.where(part == 0, tl.load(q_weight + c), tl.load(k_weight + c)).to(tl.float32)
    weight_partner = tl.where(part == 0, tl.load(q_weight + partner), tl.load(k_weight + partner)).to(tl.float32)
    dest = out + (head // GROUP_HEADS) * out_group + part * out_part + (head % GROUP_HEADS) * out_head
    m = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = m[:, None] < rows
    x = tl.load(base + m[:, None] * base_row + cols[None, :], mask=live, other=0.0).to(tl.float32)
    if BRANCH:
        d = tl.load(down + m[:, None] * down_row + r[None, :], mask=live & (r[None, :] < RANK), other=0.0)
        x += scale * tl.dot(d, tl.trans(up_rows))
    if part < 2:
        xp = tl.gather(x, partners, axis=1)  # [BLOCK, DIM]: each channel's rotate-half partner
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / DIM + eps)[:, None]
        rope = live & (c[None, :] < ROPE)
        cs = tl.load(cos + m[:, None] * rope_row + c[None, :], mask=rope, other=1.0).to(tl.float32)
        sn = tl.load(sin + m[:, None] * rope_row + c[None, :], mask=rope, other=0.0).to(tl.float32)
        x = (x * weight[None, :] * cs + sign[None, :] * xp * weight_partner[None, :] * sn) * rstd
    tl.store(dest + m[:, None] * out_row + c[None, :], x.to(out.dtype.element_ty), mask=live)


def qkv_heads(base: torch.Tensor, down: torch.Tensor | None, up: torch.Tensor | None, scale: float,
              q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
              out: torch.Tensor) -> None:
    """q, k, v of `base` (+ `scale` * `down` `up`^T) into `out` by head group, q and k normalised and rotated."""
    # base: [S, 3 * H * D]; down: [S, rank]; up: [3 * H * D, rank]; cos/sin: [S, R]; out: [G, S, 3, H / G, D]
    groups, rows, _, group_heads, dim = out.shape
    heads = groups * group_heads
    branch = down is not None
    rank = down.shape[1] if branch else 1
    for name, t in (("base", base), ("cos", cos), ("sin", sin), ("out", out)) + (
            (("down", down), ("up", up)) if branch else ()):
        if t.stride(-1) != 1:
            raise ValueError(f"qkv_heads: {name} {tuple(t.shape)} needs its last dimension contiguous")
    if (base.shape != (rows, 3 * heads * dim) or cos.shape != sin.shape or cos.shape[0] != rows
            or cos.shape[1] > dim or cos.shape[1] % 2 or q_weight.shape != (dim,) or k_weight.shape != (dim,)
            or (branch and (down.shape[0] != rows or up.shape != (3 * heads * dim, rank) or up.stride(0) != rank))):
        raise ValueError(f"qkv_heads: base {tuple(base.shape)}, down {None if down is None else tuple(down.shape)}, "
                         f"up {None if up is None else tuple(up.shape)}, cos {tuple(cos.shape)}, sin "
                         f"{tuple(sin.shape)}, norm weights {tuple(q_weight.shape)} / {tuple(k_weight.shape)} do not "
                         f"fit out {tuple(out.shape)}")
    if rows == 0:
        return
    grid = (triton.cdiv(rows, BLOCK_ROWS), 3 * heads)
    _qkv_heads_kernel[grid](
        base, down if branch else base, up if branch else base, q_weight, k_weight, cos, sin, out,
        rows, float(scale), float(eps), base.stride(0), down.stride(0) if branch else 0, cos.stride(0),
        out.stride(0), out.stride(1), out.stride(2), out.stride(3),
        HEADS=heads, GROUP_HEADS=group_heads, DIM=dim, ROPE=cos.shape[1], RANK=rank,
        RANK_P=max(16, triton.next_power_of_2(rank)), BRANCH=branch, BLOCK=BLOCK_ROWS, num_warps=NUM_WARPS)


@triton.jit(do_not_specialize=["rows"])
def _swiglu_kernel(base, down, up, out, rows, width, scale, base_row, down_row, out_row,
                   RANK: tl.constexpr, RANK_P: tl.constexpr, BRANCH: tl.constexpr, BLOCK: tl.constexpr,
                   COLS: tl.constexpr):
    c = tl.program_id(1) * COLS + tl.arange(0, COLS)
    c_live = c[None, :] < width
    r = tl.arange(0, RANK_P)
    if BRANCH:  # B rows of these gate and up columns [COLS, RANK_P] (as they lie), zero past the rank
        live_b = (c[:, None] < width) & (r[None, :] < RANK)
        up_gate = tl.load(up + c[:, None] * RANK + r[None, :], mask=live_b, other=0.0)
        up_up = tl.load(up + (width + c)[:, None] * RANK + r[None, :], mask=live_b, other=0.0)
    m = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = (m[:, None] < rows) & c_live
    gate = tl.load(base + m[:, None] * base_row + c[None, :], mask=live, other=0.0).to(tl.float32)
    lin = tl.load(base + m[:, None] * base_row + width + c[None, :], mask=live, other=0.0).to(tl.float32)
    if BRANCH:
        d = tl.load(down + m[:, None] * down_row + r[None, :], mask=(m[:, None] < rows) & (r[None, :] < RANK),
                    other=0.0)
        gate += scale * tl.dot(d, tl.trans(up_gate))
        lin += scale * tl.dot(d, tl.trans(up_up))
    y = gate * tl.sigmoid(gate) * lin
    tl.store(out + m[:, None] * out_row + c[None, :], y.to(out.dtype.element_ty), mask=live)


def swiglu(base: torch.Tensor, down: torch.Tensor | None, up: torch.Tensor | None, scale: float) -> torch.Tensor:
    """silu(gate) * up of `base` (+ `scale` * `down` `up`^T), gate the first half of the columns."""
    # base: [S, 2F]; down: [S, rank]; up: [2F, rank] -> [S, F]
    rows, width = base.shape[0], base.shape[1] // 2
    branch = down is not None
    rank = down.shape[1] if branch else 1
    if base.stride(-1) != 1 or base.shape[1] % 2 or (branch and (down.stride(-1) != 1 or down.shape[0] != rows
                                                                 or up.shape != (2 * width, rank)
                                                                 or not up.is_contiguous())):
        raise ValueError(f"swiglu: base {tuple(base.shape)}, down {None if down is None else tuple(down.shape)}, up "
                         f"{None if up is None else tuple(up.shape)}: need an even width, as many down rows as base "
                         f"rows, B rows matching the width, and contiguous last dimensions")
    out = base.new_empty(rows, width)
    if rows == 0:
        return out
    grid = (triton.cdiv(rows, BLOCK_ROWS), triton.cdiv(width, SWIGLU_COLS))
    _swiglu_kernel[grid](
        base, down if branch else base, up if branch else base, out, rows, width, float(scale), base.stride(0),
        down.stride(0) if branch else 0, out.stride(0),
        RANK=rank, RANK_P=max(16, triton.next_power_of_2(rank)), BRANCH=branch, BLOCK=BLOCK_ROWS, COLS=SWIGLU_COLS,
        num_warps=NUM_WARPS)
    return out
