"""The DiT's block stack as piecewise CUDA graphs, for the streaming forwards (students and commits) of each phase.

A block is its work before and after its attention call (`attention_inputs`, `residual_branches` in network.py):
compiled regions and the kernels that finish the LoRA linears. The attention stays eager: under Ulysses it holds
the all-to-alls (NCCL work inside a graph cannot be aborted when a rank dies), and the streaming pattern's shapes
grow with the KV history. So one graph covers each stretch between two attention calls (block i-1's work after its
attention and block i's before its own), and a forward is 51 replays with the 50 attention calls between them,
instead of thousands of kernel launches. On an idle GPU a forward below ~2,500 rows was bound by that dispatch (~124
ms of host whatever its size, when first profiled); under USP2 beside the VAE the GPUs are the limit in every
phase (docs/decisions.md, 'Student and commit blocks as piecewise CUDA graphs'), and the graphs take the dispatch
off the ranks' host threads.

`capture(rows, slots)` records the graphs of one shape at start-up: `rows` packed rows on this rank (after the
sequence split) and `slots` timesteps in the AdaLN tables, for a sequence shard of `degree` ranks. Every piece reads
and writes one set of static buffers per shape (`_Buffers`; the shapes of one row count share all but the AdaLN
tables, as forwards replay one at a time); a piece writes its q, k, v straight into the layout the
attention takes them in (under Ulysses, the all-to-all's send buffer), and the attention writes its output into the
next piece's input. All pieces share one memory pool for their temporaries: they replay one after another. A forward
of another shape, or with the LoRA suspended (the teacher), or under another shard degree, or during a graph
capture, runs eagerly. Knows nothing about sessions, KV caches, text rows or the all-to-alls.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import torch

from services.tensors.cuda_graphs import CudaGraphBank, GraphKey
from services.dit.model.lora import LoRAAdapter
from services.dit.model.network import DiT, attention_inputs, residual_branches
from services.dit.model.shard import ShardedAttend


@dataclass
class _Buffers:
    """Static tensors of one captured shape: the pieces' inputs and outputs."""

    x: torch.Tensor  # [R, C] residual stream: the stack's input, each piece's output
    tables: torch.Tensor  # [L, 3 * slots, 6, C] per-block AdaLN tables
    rows: torch.Tensor  # [R] int64 table row of every x row
    cos: torch.Tensor  # [R, rope dims]
    sin: torch.Tensor  # [R, rope dims]
    send: torch.Tensor  # [G, R, 3, H/G, D] the next attention's q, k, v by head group (`pack_head_groups`)
    attn: torch.Tensor  # [R, H, D] the last attention's output


class BlockGraphs:
    """Piecewise graphs of `model.blocks` per (rows on this rank, timestep slots), LoRA active, for a model whose
    sequence shard has `degree` ranks when they replay (installed before or after the capture)."""

    def __init__(self, model: DiT, adapter: LoRAAdapter | None, device: torch.device, degree: int):
        if degree < 1 or model.args.num_heads % degree:
            raise ValueError(f"sequence shard degree {degree} must be >= 1 and divide num_heads="
                             f"{model.args.num_heads}")
        self.model, self.adapter, self.degree = model, adapter, degree
        self.bank = CudaGraphBank(device)
        self._buffers: dict[tuple[int, int], _Buffers] = {}

    @property
    def shapes(self) -> list[tuple[int, int]]:
        """The (rows, slots) captured."""
        return sorted(self._buffers)

    def capture(self, rows: int, slots: int) -> None:
        """Record the 51 pieces of shape (`rows`, `slots`); start-up only, with the LoRA active."""
        if (rows, slots) in self._buffers:
            raise ValueError(f"block graphs for {rows} rows and {slots} timestep slots are already captured")
        if self.adapter is not None and self.adapter.suspended_depth:
            raise ValueError("capture the block graphs with the LoRA active: they replay the students and commits")
        args, dev, dt = self.model.args, self.bank.device, self.model.dtype
        c, h, d = args.hidden_size, args.num_heads, args.head_dim
        g = self.degree
        with torch.inference_mode(False):  # plain tensors: copied into from inside inference mode and outside it
            tables = torch.zeros(args.num_layers, 3 * slots, 6, c, device=dev, dtype=dt)
            same_rows = next((b for (r, _), b in self._buffers.items() if r == rows), None)
            if same_rows is not None:  # forwards replay one at a time: shapes of one row count share the rest
                b = replace(same_rows, tables=tables)
            else:
                b = _Buffers(x=torch.zeros(rows, c, device=dev, dtype=dt), tables=tables,
                             rows=torch.zeros(rows, dtype=torch.int64, device=dev),
                             cos=torch.ones(rows, args.rope_dims, device=dev, dtype=dt),
                             sin=torch.zeros(rows, args.rope_dims, device=dev, dtype=dt),
                             send=torch.zeros(g, rows, 3, h // g, d, device=dev, dtype=dt),
                             attn=torch.zeros(rows, h, d, device=dev, dtype=dt))
        for i in range(args.num_layers + 1):
            self.bank.capture(self._key(rows, slots, i), lambda i=i: self._piece(b, i), [])
        self._buffers[(rows, slots)] = b

    def seal(self) -> None:
        """End of start-up."""
        self.bank.seal()

    def covers(self, x: torch.Tensor, tables: Sequence[torch.Tensor]) -> bool:
        """Whether a forward with this rank's rows `x` `[R, C]` and per-block tables `[3 * slots, 6, C]` replays."""
        return ((x.shape[0], tables[0].shape[0] // 3) in self._buffers
                and self.model.sequence_shard.degree == self.degree
                and (self.adapter is None or not self.adapter.suspended_depth)
                and not (x.is_cuda and torch.cuda.is_current_stream_capturing()))

    def run(self, x: torch.Tensor, tables: Sequence[torch.Tensor], rows: torch.Tensor,
            rope: tuple[torch.Tensor, torch.Tensor], attends: Sequence[ShardedAttend]) -> torch.Tensor:
        """The block stack on `x` `[R, C]`: the pieces replayed, `attends[i]` run eagerly between them."""
        slots = tables[0].shape[0] // 3
        b = self._buffers[(x.shape[0], slots)]
        b.x.copy_(x)
        torch.stack(list(tables), out=b.tables)  # [L, 3 * slots, 6, C]
        b.rows.copy_(rows)
        b.cos.copy_(rope[0])
        b.sin.copy_(rope[1])
        for i, attend in enumerate(attends):
            self.bank.replay(self._key(x.shape[0], slots, i), [])
            attend.packed(b.send, b.attn)
        self.bank.replay(self._key(x.shape[0], slots, len(attends)), [])
        return b.x.clone()  # the next forward overwrites the buffer

    def _piece(self, b: _Buffers, i: int) -> None:
        """Piece i: block i-1's work after its attention, then block i's before its own."""
        blocks = self.model.blocks
        x = b.x
        if i > 0:
            x = residual_branches(blocks[i - 1], b.x, b.tables[i - 1], b.rows, b.attn)
        if i < len(blocks):
            attention_inputs(blocks[i], x, b.tables[i], b.rows, b.cos, b.sin, b.send)
        if i > 0:
            b.x.copy_(x)

    @staticmethod
    def _key(rows: int, slots: int, piece: int) -> GraphKey:
        return GraphKey.for_inputs("blocks", [], tag=(rows, slots, piece))
