"""Static AdaLN cache: precomputed per-block and final-layer modulation tables for a fixed set of timesteps.

The schedule of a streaming session uses a handful of distinct t values, and the AdaLN projections hold ~13B of
the 33B parameters; tabulating their outputs lets the model drop those weights. Knows nothing about layouts beyond
the float32 timestep values it is keyed by, and nothing about checkpoints or attention.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch
from torch import nn

from services.common.errors import InternalError

if TYPE_CHECKING:
    from services.dit.model.network import DiT

log = logging.getLogger(__name__)


class AdaLNCacheError(InternalError):
    """The AdaLN cache cannot serve a request (uncached timestep, or a cache that is already installed)."""


@dataclass(frozen=True)
class AdaLNCacheReport:
    """What `DiT.cache_adaln` did."""

    timesteps: tuple[float, ...]
    """The cached t values (float32-rounded), in table order."""
    bytes_freed: int
    """Bytes of adaln_proj weights and biases dropped (blocks and final layer)."""
    bytes_table: int
    """Bytes of the tables kept instead."""

    @property
    def net_bytes_saved(self) -> int:
        return self.bytes_freed - self.bytes_table


def _f32(value: float) -> float:
    return float(torch.tensor(float(value), dtype=torch.float32).item())


class AdaLNTable(nn.Module):
    """Modulation tables: blocks `[L, n, 3, 6, C]` and final layer `[n, 2, C]`, keyed by t value."""

    def __init__(self, timesteps: tuple[float, ...], blocks: torch.Tensor, final: torch.Tensor):
        super().__init__()
        self.timesteps = timesteps
        self.slot_of = {t: i for i, t in enumerate(timesteps)}
        self.register_buffer("blocks", blocks, persistent=False)
        self.register_buffer("final", final, persistent=False)
        self._selections: dict[tuple, torch.Tensor] = {}  # (slot list, device) -> index tensor on that device

    def block_tables(self, values: Sequence[float], blocks: range) -> list[torch.Tensor]:
        """Per block of `blocks`, the table `[n * 3, 6, C]` of a layout's timestep values."""
        table = self.blocks[blocks.start:blocks.stop]  # [len(blocks), n_cached, 3, 6, C]
        sel = self._select(values)
        chosen = table if sel is None else table.index_select(1, sel)
        return [b.flatten(0, 1) for b in chosen.unbind(0)]

    def final_table(self, values: Sequence[float]) -> torch.Tensor:
        """The final layer's table `[n, 2, C]` of a layout's timestep values."""
        sel = self._select(values)
        return self.final if sel is None else self.final.index_select(0, sel)

    def _select(self, values: Sequence[float]) -> torch.Tensor | None:
        """The cached slots of `values` as an index tensor, or None when they are every slot in order."""
        missing = [v for v in values if v not in self.slot_of]
        if missing:
            raise AdaLNCacheError(f"timesteps {missing} are not in the AdaLN cache (cached: {list(self.timesteps)}); "
                                  "call cache_adaln with every t the schedule uses")
        idx = tuple(self.slot_of[v] for v in values)
        if idx == tuple(range(len(self.timesteps))):
            return None
        key = (idx, self.blocks.device)
        sel = self._selections.get(key)
        if sel is None:  # made once per slot list, never inside a CUDA graph capture (a host-to-device copy)
            sel = self._selections[key] = torch.tensor(idx, device=self.blocks.device)
        return sel


@torch.no_grad()
def install_adaln_cache(model: "DiT", timesteps: Sequence[float]) -> AdaLNCacheReport:
    """Tabulate every AdaLN modulation of `model` for `timesteps`, then delete the adaln_proj linears."""
    if model.adaln_table is not None:
        raise AdaLNCacheError("the AdaLN cache is already installed and the adaln_proj weights are gone; "
                              f"cached timesteps: {list(model.adaln_table.timesteps)}")
    values: list[float] = []
    for t in timesteps:
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not 0.0 <= float(t) <= 1.0:
            raise AdaLNCacheError(f"timestep {t!r} must be a float in [0, 1]")
        if _f32(t) not in values:
            values.append(_f32(t))
    if not values:
        raise AdaLNCacheError("timesteps is empty: give every t value the schedule uses")
    c = model.args.hidden_size
    dev = model.condition_proj.weight.device
    temb = model.time_embedder(torch.tensor(values, dtype=torch.float32, device=dev))  # [n, E]
    blocks = torch.stack([b.adaln_proj(temb).view(len(values), 3, 6, c) for b in model.blocks])
    final = model.final_layer.adaln_proj(temb).view(len(values), 2, c)
    freed = 0
    for owner in list(model.blocks) + [model.final_layer]:
        freed += sum(p.numel() * p.element_size() for p in owner.adaln_proj.parameters())
        del owner.adaln_proj
    model.adaln_table = AdaLNTable(tuple(values), blocks, final)
    table = blocks.numel() * blocks.element_size() + final.numel() * final.element_size()
    log.info("AdaLN cache for %d timesteps: freed %d bytes of weights, table %d bytes", len(values), freed, table)
    return AdaLNCacheReport(timesteps=tuple(values), bytes_freed=freed, bytes_table=table)
