"""How the DiT's blocks run over a sequence shard: the interface (`SequenceShard`, each block's `ShardedAttend`), the
send-buffer layout its attention takes q, k, v in (`pack_head_groups`), and the single-device shard (`NoShard`).
Ulysses over N ranks is `services.dit.group.ulysses.UlyssesShard`. Knows nothing about the model's weights or the
attention pattern.
"""
from __future__ import annotations

from typing import Callable, Protocol

import torch


class ShardedAttend(Protocol):
    """One block's attention inside a sequence shard: `inner(q, k, v)` over every row for this rank's heads, wrapped
    in what moves rows between ranks."""

    degree: int
    """Ranks of the shard: the head groups of `send`."""

    def packed(self, send: torch.Tensor, out: torch.Tensor) -> None:
        """q, k, v of this rank's rows, laid out by `pack_head_groups` (`send` `[degree, R, 3, H / degree, D]`) ->
        the attention output, written into `out` `[R, H, D]`."""


class SequenceShard(Protocol):
    """Splits the packed sequence across ranks before the blocks and gathers it before the heads (dim 0); wraps
    each block's attention (`ShardedAttend`). `degree` ranks each hold H / degree heads inside the attention."""

    degree: int

    def split(self, x: torch.Tensor) -> torch.Tensor: ...

    def attend(self, inner: Callable[..., torch.Tensor]) -> ShardedAttend: ...

    def gather(self, x: torch.Tensor) -> torch.Tensor: ...


def pack_head_groups(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Write q, k, v into `out` so that head group g of every row, q, k and v together, is the contiguous `out[g]`:
    what a Ulysses all-to-all sends to rank g, and after it a layout the attention reads in place."""
    # q, k, v: [R, H, D] -> out: [G, R, 3, H/G, D]
    for t, x in enumerate((q, k, v)):
        out[:, :, t].copy_(x.unflatten(1, (out.shape[0], -1)).transpose(0, 1))
    return out


class LocalAttend:
    """`ShardedAttend` of a single device: the inner attention over all rows and heads, nothing moved."""

    degree = 1

    def __init__(self, inner: Callable[..., torch.Tensor]):
        self.inner = inner

    def packed(self, send: torch.Tensor, out: torch.Tensor) -> None:
        # send: [1, R, 3, H, D] -> out: [R, H, D]
        out.copy_(self.inner(send[0, :, 0], send[0, :, 1], send[0, :, 2]))


class NoShard:
    """Identity `SequenceShard` (single device)."""

    degree = 1

    def split(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def attend(self, inner: Callable[..., torch.Tensor]) -> LocalAttend:
        return LocalAttend(inner)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return x
