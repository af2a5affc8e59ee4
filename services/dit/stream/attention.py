"""Streaming attention pattern of the student and commit forwards, over the session's clean AV KV cache.

Text rows attend to the current text only. Media rows (audio-L, audio-R, video) attend to
[current text | cached clean history | current media], bidirectionally. The current media and text K/V are
written into the cache's work area right after the history, so attention runs over one contiguous view, and in
commit mode the media rows are staged for the open transaction without a copy. Pad rows produce zeros.

Since text rows see only the text, their K/V at every layer depend on the prompt, its positions and the text
timestep alone, not on the phase: a forward can `record` them (`recorded`: `[L, 2, Tt, H, D]`) and a later
forward of the same request and timestep run without text rows, taking the text K/V from that record
(`text_kv`). Text padded to a prompt-length bucket (`layout.text_valid`, the real rows first) takes part by its real
rows only: they are the keys every row sees and the rows recorded; the pad rows attend to them and are dropped
later. Knows nothing about weights, sampling or retention policy.
"""

from __future__ import annotations

import torch

from services.dit.model.attention_kernels import sdpa_rows
from services.dit.stream.kv_cache import CleanAVKVCache
from services.dit.model.layout import PackedLayout


class StreamingAttention:
    """`AttentionPattern` for one streaming forward; `commit=True` stages clean media K/V of every layer.

    Build it from the layout on the CPU: a bucket-padded layout's real text rows are counted from `text_valid`."""

    def __init__(self, layout: PackedLayout, cache: CleanAVKVCache, commit: bool = False,
                 text_kv: torch.Tensor | None = None, record: bool = False):
        tt, nm = layout.text_len, layout.num_media  # rows: [text | audio | video | pad] (a PackedLayout invariant)
        real = tt
        if layout.text_valid is not None:
            real = int(layout.text_valid.sum())
            if not bool(layout.text_valid[:real].all()):
                raise ValueError("bucket-padded text must hold its real rows first (text_valid True, then False)")
        if commit and not cache.in_transaction:
            raise ValueError("commit-mode attention needs an open KV transaction (cache.begin)")
        if text_kv is not None:
            want = (cache.num_layers, 2, text_kv.shape[2], cache.local_heads, cache.head_dim)
            if tt or record or tuple(text_kv.shape) != want:
                raise ValueError(f"text_kv of shape {tuple(text_kv.shape)} with {tt} text rows in the layout: "
                                 f"recorded text K/V {want} replace the text rows, so the layout must have none")
        if record and not tt:
            raise ValueError("record=True needs text rows in the layout")
        self.text_len, self.media_len, self.seq_len = tt, nm, layout.seq_len
        self.text_real = real
        """The layout's real text rows (its first `text_real`; the rest pad it to a bucket)."""
        self.cache, self.commit = cache, commit
        self.text_kv = text_kv  # [L, 2, Tt, H, D] recorded by an earlier forward, or None
        self.recorded: torch.Tensor | None = None  # [L, 2, Tt real, H, D] this forward's text K/V when recording
        self._record = record

    @property
    def text_keys(self) -> int:
        """Text rows every row attends to: the layout's real ones, or the recorded ones."""
        return self.text_real if self.text_kv is None else self.text_kv.shape[2]

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q, k, v: [S, H, D] (global row order, local heads)
        tt, tr, nm, s = self.text_len, self.text_real, self.media_len, q.shape[0]
        if s != self.seq_len:
            raise ValueError(f"StreamingAttention built for {self.seq_len} rows got {s}")
        hist = self.cache.live
        k_all, v_all = self.cache.work(layer, nm, self.text_keys)  # [hist + nm + text keys, H, D]
        k_all[hist:hist + nm].copy_(k[tt:tt + nm])
        v_all[hist:hist + nm].copy_(v[tt:tt + nm])
        if self.text_kv is None:
            k_all[hist + nm:].copy_(k[:tr])
            v_all[hist + nm:].copy_(v[:tr])
        else:
            k_all[hist + nm:].copy_(self.text_kv[layer, 0])
            v_all[hist + nm:].copy_(self.text_kv[layer, 1])
        if self._record:
            if self.recorded is None:
                self.recorded = k.new_empty((self.cache.num_layers, 2, *k[:tr].shape))
            self.recorded[layer, 0].copy_(k[:tr])
            self.recorded[layer, 1].copy_(v[:tr])
        if self.commit:
            self.cache.stage(layer, k_all[hist:hist + nm], v_all[hist:hist + nm])
        parts = [sdpa_rows(q[tt:tt + nm], k_all, v_all)]
        if tt:  # the text rows, pad rows too, over the real text keys
            parts.insert(0, sdpa_rows(q[:tt], k[:tr], v[:tr]))
        if s > tt + nm:
            parts.append(torch.zeros_like(q[tt + nm:]))
        return torch.cat(parts, dim=0)
