"""Streaming attention pattern of the student and commit forwards, over the session's clean AV KV cache.

Text rows attend to the current text only. Media rows (audio-L, audio-R, video) attend to
[current text | cached clean history | current media], bidirectionally. The current media and text K/V are
written into the cache's work area right after the history, so attention runs over one contiguous view, and in
commit mode the media rows are staged for the open transaction without a copy. Pad rows produce zeros.
Knows nothing about weights, sampling or retention policy.
"""

from __future__ import annotations

import torch

from services.dit.kv_cache import CleanAVKVCache
from services.dit.layout import PackedLayout
from services.dit.model import sdpa_rows


class StreamingAttention:
    """`AttentionPattern` for one streaming forward; `commit=True` stages clean media K/V of every layer."""

    def __init__(self, layout: PackedLayout, cache: CleanAVKVCache, commit: bool = False):
        tt, nm = layout.text_len, layout.num_media  # rows: [text | audio | video | pad] (a PackedLayout invariant)
        if layout.text_valid is not None:
            raise ValueError("StreamingAttention takes the prompt's exact rows; bucket-padded text (text_valid) is "
                             "only supported by FullAttention (the audio teacher's graphs)")
        if commit and not cache.in_transaction:
            raise ValueError("commit-mode attention needs an open KV transaction (cache.begin)")
        self.text_len, self.media_len, self.seq_len = tt, nm, layout.seq_len
        self.cache, self.commit = cache, commit

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q, k, v: [S, H, D] (global row order, local heads)
        tt, nm, s = self.text_len, self.media_len, q.shape[0]
        if s != self.seq_len:
            raise ValueError(f"StreamingAttention built for {self.seq_len} rows got {s}")
        hist = self.cache.live
        k_all, v_all = self.cache.work(layer, nm, tt)  # [hist + nm + tt, H, D]
        k_all[hist:hist + nm].copy_(k[tt:tt + nm])
        v_all[hist:hist + nm].copy_(v[tt:tt + nm])
        k_all[hist + nm:].copy_(k[:tt])
        v_all[hist + nm:].copy_(v[:tt])
        if self.commit:
            self.cache.stage(layer, k_all[hist:hist + nm], v_all[hist:hist + nm])
        parts = [sdpa_rows(q[:tt], k[:tt], v[:tt]), sdpa_rows(q[tt:tt + nm], k_all, v_all)]
        if s > tt + nm:
            parts.append(torch.zeros_like(q[tt + nm:]))
        return torch.cat(parts, dim=0)
