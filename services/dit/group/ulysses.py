"""Ulysses sequence parallelism for the DiT, installed from outside the model.

`install_ulysses(model, group)` gives the DiT a `UlyssesShard`: its packed rows split into N equal contiguous
slices, one per rank, gathered back before the heads, and every block's attention wrapped (`attend`):
one packed-QKV all-to-all turns the sequence shard `[S/N, H, D]` x 3 into the head shard `[S, H/N, D]` x 3, the
inner pattern (full or streaming) runs over all rows for this rank's heads (so a KV cache keeps `[rows, H/N, D]`
per rank), and a second all-to-all restores `[S/N, H, D]`. q, k and v are written once, by head group, into the
send buffer (`pack_head_groups`' layout; on CUDA by the kernel that finishes the QKV projection, `attention_inputs`
in model/network.py); the receive buffer then holds every row's q, k, v side by side, and the inner pattern reads them
there as views (the layout cuDNN attention calls packed QKV). The text refiner runs replicated (text rows only).
The same `all_to_all_single` path serves NCCL and gloo. Knows nothing about sessions, KV retention, LoRA or
how the ranks were started.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from services.dit.model.network import DiT
from services.dit.model.shard import NoShard

log = logging.getLogger(__name__)


class UlyssesShard:
    """`SequenceShard` over `world_size` ranks: rank r holds rows [r * S/N, (r + 1) * S/N) of the packed sequence."""

    def __init__(self, group: ProcessGroup | None, rank: int, world_size: int):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must lie in [0, world_size={world_size})")
        self.group, self.rank, self.world_size = group, rank, world_size

    def _rows(self, x: torch.Tensor) -> int:
        s = x.shape[0]
        if s % self.world_size:
            raise ValueError(f"packed length {s} is not divisible by the Ulysses degree {self.world_size}; "
                             "pad the layout to a multiple of it")
        return s // self.world_size

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous slice of rows."""
        # x: [S, ...] -> [S/N, ...]
        n = self._rows(x)
        return x.narrow(0, self.rank * n, n).contiguous()

    @property
    def degree(self) -> int:
        return self.world_size

    def attend(self, inner) -> UlyssesAttend:
        """`inner(q, k, v)` over every row for this rank's heads, wrapped in the Ulysses all-to-alls."""
        return UlyssesAttend(inner, self.group, self.world_size)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's slice in rank order."""
        # x: [S/N, ...] -> [S, ...]
        if self.world_size == 1:
            return x
        x = x.contiguous()
        out = torch.empty((self.world_size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x, group=self.group)
        return out


def heads_to_rows(send: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """One all-to-all: q, k, v of this rank's rows, packed by head group -> every row for this rank's heads."""
    # send: [N, S/N, 3, H/N, D] (`pack_head_groups`; chunk j goes to rank j) -> [S, 3, H/N, D]
    recv = torch.empty_like(send)  # chunk i came from rank i: its rows, our heads, already in global row order
    dist.all_to_all_single(recv, send, group=group)
    return recv.flatten(0, 1)


def out_to_rows(out: torch.Tensor, group: ProcessGroup | None, world_size: int) -> torch.Tensor:
    """The inverse all-to-all: this rank's heads of every row -> every head group of this rank's rows."""
    # out: [S, H/N, D] -> [N, S/N, H/N, D]: chunk i is head group i
    send = out.contiguous().view(world_size, -1, *out.shape[1:])  # chunk j: rank j's rows (the patterns' outputs
    # are contiguous already: no copy)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv


class UlyssesAttend:
    """`ShardedAttend` of a Ulysses rank: the inner attention between the two all-to-alls."""

    def __init__(self, inner, group: ProcessGroup | None, world_size: int):
        self.inner, self.group, self.degree = inner, group, world_size

    def packed(self, send: torch.Tensor, out: torch.Tensor) -> None:
        # send: [N, S/N, 3, H/N, D] -> out: [S/N, H, D]
        out.unflatten(1, (self.degree, -1)).copy_(self._exchange(send).transpose(0, 1))

    def _exchange(self, send: torch.Tensor) -> torch.Tensor:
        """All-to-all, the inner attention on views of what came in, all-to-all back: [N, S/N, H/N, D]."""
        full = heads_to_rows(send, self.group)  # [S, 3, H/N, D]
        out = self.inner(full[:, 0], full[:, 1], full[:, 2])  # [S, H/N, D]
        return out_to_rows(out, self.group, self.degree)


@dataclass
class UlyssesHandle:
    """What `install_ulysses` changed; `local()` runs forwards unsharded, `remove()` restores the single-device model."""

    model: DiT
    world_size: int
    rank: int
    shard: UlyssesShard
    local_depth: int = 0
    """> 0 inside `local()`: the sequence is not split and the attention not wrapped (`NoShard`)."""

    @contextmanager
    def local(self):
        """Run forwards inside the block on this rank alone, all heads and all rows, with no collective.

        For short documents (the audio teacher's ~900 rows) the all-to-alls cost more than the work they split;
        every rank holds the same weights and inputs, so each computes the same result by itself.
        """
        self.local_depth += 1
        self.model.sequence_shard = NoShard()
        try:
            yield
        finally:
            self.local_depth -= 1
            if self.local_depth == 0:
                self.model.sequence_shard = self.shard

    def remove(self) -> None:
        """Uninstall: restore the identity shard."""
        self.model.sequence_shard = NoShard()


def install_ulysses(model: DiT, group: ProcessGroup | None, rank: int, world_size: int) -> UlyssesHandle:
    """Shard `model`'s packed sequence over `world_size` ranks of `group`, every block's attention wrapped."""
    heads = model.args.num_heads
    if world_size < 1 or heads % world_size:
        raise ValueError(f"Ulysses degree {world_size} must be >= 1 and divide num_heads={heads}")
    if not isinstance(model.sequence_shard, NoShard):
        raise ValueError("a sequence shard is already installed on this DiT; remove it first")
    shard = UlyssesShard(group, rank, world_size)
    model.sequence_shard = shard
    handle = UlyssesHandle(model, world_size, rank, shard)
    log.info("Ulysses installed: rank %d of %d, %d heads per rank", rank, world_size, heads // world_size)
    return handle
