"""Persistent clean audio+video KV cache of one streaming session, with address-stable preallocated buffers.

Per layer one K and one V buffer `[capacity, local_heads, D]` (after the Ulysses all-to-all, so each rank keeps
its own head shard). Layout inside a buffer:

    [ live history (committed media rows, compacted) | work area: current media rows | current text rows ]

The attention pattern writes the current phase's media and text K/V into the work area and attends over one
contiguous view. A clean commit stages the media rows of every layer in place (`begin` / `stage` / `commit`,
`rollback` on failure); committing only extends the live length, so a failed commit leaves history untouched.
Retention (first-video-sink plus the 2 most recent commits): once 3 commits exist, commit 0 shrinks to its video
rows and stays as a permanent sink; older commits are evicted by compacting rows in place (no allocation).
`drop_audio` removes every cached audio row (done every 12 requests). Knows nothing about the model, layouts or
RoPE; rows arrive with RoPE already applied.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from services.dit.api import KVCacheError
from services.dit.stream.geometry import Canvas, max_later_phase_media_rows, plan_request

log = logging.getLogger(__name__)

RECENT_COMMITS = 2
"""Most recent commits kept whole (audio + video)."""


@dataclass
class CommitRecord:
    """Where one commit's rows live in the buffers: [audio rows | video rows] starting at `start`."""

    index: int
    """Commit number within the session (0 is the sink)."""
    start: int
    audio_rows: int
    video_rows: int

    @property
    def rows(self) -> int:
        return self.audio_rows + self.video_rows


def kv_capacity(canvas: Canvas, max_text_tokens: int) -> int:
    """Rows per layer buffer: the whole first commit + 2 later commits + a phase's work area (media + text)."""
    first_rows = plan_request(0).phases[0].media_rows(canvas)
    later = max_later_phase_media_rows(canvas)
    return first_rows + RECENT_COMMITS * later + max(first_rows, later) + max_text_tokens


class CleanAVKVCache:
    """Preallocated per-layer K/V of clean media rows with transactional commits and sink+recent retention."""

    def __init__(self, num_layers: int, capacity: int, local_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str):
        for name, n in (("num_layers", num_layers), ("capacity", capacity), ("local_heads", local_heads),
                        ("head_dim", head_dim)):
            if not isinstance(n, int) or n < 1:
                raise ValueError(f"{name}={n!r} must be a positive int")
        self.num_layers, self.capacity = num_layers, capacity
        self.local_heads, self.head_dim = local_heads, head_dim
        shape = (capacity, local_heads, head_dim)
        self.k: list[torch.Tensor] = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v: list[torch.Tensor] = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.live = 0
        """Committed history rows at the front of every buffer."""
        self.records: list[CommitRecord] = []
        self.num_commits = 0
        self._txn: tuple[int, int] | None = None  # (audio_rows, video_rows) of the open transaction
        self._staged: list[bool] = []

    # ---- state -------------------------------------------------------------------------------------------
    @property
    def released(self) -> bool:
        return not self.k

    @property
    def nbytes(self) -> int:
        """Bytes held by the K and V buffers."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    @property
    def audio_rows(self) -> int:
        """Cached audio history rows."""
        return sum(r.audio_rows for r in self.records)

    @property
    def video_rows(self) -> int:
        """Cached video history rows."""
        return sum(r.video_rows for r in self.records)

    def _check_open(self) -> None:
        if self.released:
            raise KVCacheError("the KV cache has been released")

    # ---- work area used by the attention pattern --------------------------------------------------------
    def work(self, layer: int, media_rows: int, text_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V views `[live + media + text, H, D]`: history followed by the work area for this forward."""
        self._check_open()
        end = self.live + media_rows + text_rows
        if end > self.capacity:
            raise KVCacheError(f"KV overflow: {self.live} history + {media_rows} media + {text_rows} text rows "
                               f"exceed the capacity of {self.capacity} rows")
        return self.k[layer][:end], self.v[layer][:end]

    # ---- transaction -------------------------------------------------------------------------------------
    def begin(self, audio_rows: int, video_rows: int) -> None:
        """Open a clean commit of `audio_rows` + `video_rows` media rows (staged per layer into the work area)."""
        self._check_open()
        if self._txn is not None:
            raise KVCacheError("a KV commit is already open; commit or roll it back first")
        if self.live + audio_rows + video_rows > self.capacity:
            raise KVCacheError(f"KV overflow: commit of {audio_rows + video_rows} rows on {self.live} history rows "
                               f"exceeds the capacity of {self.capacity}")
        self._txn = (audio_rows, video_rows)
        self._staged = [False] * self.num_layers

    @property
    def in_transaction(self) -> bool:
        return self._txn is not None

    def stage(self, layer: int, k_media: torch.Tensor, v_media: torch.Tensor) -> None:
        """Stage one layer's clean media K/V `[rows, H, D]` (a no-op copy when already written in place)."""
        # k_media, v_media: [audio_rows + video_rows, H, D]
        if self._txn is None:
            raise KVCacheError(f"stage(layer={layer}) outside a commit; call begin() first")
        n = sum(self._txn)
        if tuple(k_media.shape) != (n, self.local_heads, self.head_dim) or k_media.shape != v_media.shape:
            raise KVCacheError(f"stage(layer={layer}): K/V of shape {tuple(k_media.shape)}/{tuple(v_media.shape)}, "
                               f"expected ({n}, {self.local_heads}, {self.head_dim})")
        for buf, x in ((self.k[layer], k_media), (self.v[layer], v_media)):
            dst = buf[self.live:self.live + n]
            if dst.data_ptr() != x.data_ptr():
                dst.copy_(x)
        self._staged[layer] = True

    def commit(self) -> None:
        """Make the staged rows history (all layers must be staged), then apply retention."""
        if self._txn is None:
            raise KVCacheError("commit() without begin()")
        missing = [i for i, s in enumerate(self._staged) if not s]
        if missing:
            self.rollback()
            raise KVCacheError(f"commit() with unstaged layers {missing}; rolled back")
        audio, video = self._txn
        self.records.append(CommitRecord(self.num_commits, self.live, audio, video))
        self.live += audio + video
        self.num_commits += 1
        self._txn, self._staged = None, []
        self._retain()

    def rollback(self) -> None:
        """Abandon the open commit; history is exactly as before `begin`."""
        self._txn, self._staged = None, []

    # ---- retention ---------------------------------------------------------------------------------------
    def _retain(self) -> None:
        keep: list[CommitRecord] = []
        newest = {r.index for r in self.records[-RECENT_COMMITS:]}
        for rec in self.records:
            if rec.index == 0 and self.num_commits > RECENT_COMMITS:
                # Sink: commit 0 keeps only its video rows once 3 commits exist.
                keep.append(CommitRecord(0, rec.start + rec.audio_rows, 0, rec.video_rows))
            elif rec.index in newest:
                keep.append(rec)
        self._compact(keep)

    def drop_audio(self) -> None:
        """Remove every cached audio row, keeping the video rows."""
        self._check_open()
        if self._txn is not None:
            raise KVCacheError("drop_audio() during an open commit")
        dropped = self.audio_rows
        self._compact([CommitRecord(r.index, r.start + r.audio_rows, 0, r.video_rows) for r in self.records])
        log.debug("dropped %d cached audio rows; %d video rows remain", dropped, self.live)

    def _compact(self, keep: list[CommitRecord]) -> None:
        """Move the kept row ranges (ascending, each given by its current start) to the front, in place."""
        write = 0
        out: list[CommitRecord] = []
        for rec in keep:
            for buf in self.k + self.v:
                _move_rows(buf, rec.start, write, rec.rows)
            out.append(CommitRecord(rec.index, write, rec.audio_rows, rec.video_rows))
            write += rec.rows
        self.records, self.live = out, write

    def release(self) -> None:
        """Free the buffers at once; the cache is unusable afterwards."""
        self.k, self.v, self.records, self.live = [], [], [], 0
        self._txn, self._staged = None, []


def _move_rows(buf: torch.Tensor, src: int, dst: int, n: int) -> None:
    """Copy rows [src, src+n) to [dst, dst+n) with dst <= src, in chunks that never overlap their source."""
    if n == 0 or src == dst:
        return
    if dst > src:
        raise KVCacheError(f"internal: compaction moves rows forward ({src} -> {dst})")
    step = src - dst
    for i in range(0, n, step):
        m = min(step, n - i)
        buf[dst + i:dst + i + m].copy_(buf[src + i:src + i + m])
