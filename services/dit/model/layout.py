"""Packed single-document layout of one DiT forward: `[text | audio-L | audio-R | video | pad]`.

Builds the per-row metadata the model reads (modality tags, AdaLN timestep slots, RoPE positions and the row
ranges of each modality). Knows nothing about weights, attention patterns, the KV cache or the streaming timeline:
callers compute the (t, h, w) positions and the timesteps and hand them in.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import torch

from services.tensors.cuda_graphs import PromptBuckets

TAG_VIDEO = 0
TAG_TEXT = 1
TAG_AUDIO = 2
TAG_PAD = -1
NUM_MODALITIES = 3
PAD_MULTIPLE = 64


def _f32(value: float) -> float:
    """Round a Python float to the nearest float32, the precision the timestep tables are keyed by."""
    return float(torch.tensor(float(value), dtype=torch.float32).item())


@dataclass(frozen=True, eq=False)
class PackedLayout:
    """Row layout of one packed document; every tensor indexes the global row order.

    The rows are always contiguous ranges in the order [text | audio-L | audio-R | video | pad]; the attention
    patterns slice by these ranges. The order is checked where layouts are built (on the CPU), not again after
    `to(device)`, so a forward never waits on the device for it.
    """

    seq_len: int
    """S: packed rows including padding, a multiple of `PAD_MULTIPLE`."""
    text_len: int
    """Tt: text rows, first in the document."""
    audio_len: int
    """Audio rows per channel; the document holds 2 * audio_len audio rows (left then right)."""
    video_len: int
    """Tv: video rows (patchified latents, 96 values each); may be 0 (text+audio teacher documents)."""
    text_index: torch.Tensor
    """[Tt] int64 row indices of the text rows."""
    audio_index: torch.Tensor
    """[Ta] int64 row indices of the audio rows, left channel rows then right channel rows."""
    video_index: torch.Tensor
    """[Tv] int64 row indices of the video rows."""
    positions: torch.Tensor
    """[S, 3] float32 RoPE coordinates (t, h, w); pad rows are zero."""
    tags: torch.Tensor
    """[S] int64 modality tag: 0 video, 1 text, 2 audio, -1 pad."""
    timestep_slot: torch.Tensor
    """[S] int64 index into `timesteps` for every row."""
    timesteps: torch.Tensor
    """[n] float32 distinct timestep values t = 1 - sigma, in slot order."""
    timestep_values: tuple[float, ...]
    """The same n values as Python floats (float32-rounded); lets the AdaLN cache look slots up without a sync."""
    text_valid: torch.Tensor | None = None
    """[Tt] bool, False on the rows a prompt-length bucket appended to the text (CUDA graphs): those rows are
    masked out as attention keys, so the real rows see exactly the unpadded prompt. None: every text row is real."""

    def __post_init__(self) -> None:
        s = self.seq_len
        if s % PAD_MULTIPLE != 0:
            raise ValueError(f"seq_len={s} must be a multiple of {PAD_MULTIPLE}")
        if self.num_real > s:
            raise ValueError(f"num_real={self.num_real} exceeds seq_len={s}")
        for name, n in (("text_index", self.text_len), ("audio_index", 2 * self.audio_len),
                        ("video_index", self.video_len)):
            if tuple(getattr(self, name).shape) != (n,):
                raise ValueError(f"{name} has shape {tuple(getattr(self, name).shape)}, expected ({n},)")
        if tuple(self.positions.shape) != (s, 3):
            raise ValueError(f"positions has shape {tuple(self.positions.shape)}, expected ({s}, 3)")
        for name in ("tags", "timestep_slot"):
            if tuple(getattr(self, name).shape) != (s,):
                raise ValueError(f"{name} has shape {tuple(getattr(self, name).shape)}, expected ({s},)")
        if tuple(self.timesteps.shape) != (len(self.timestep_values),):
            raise ValueError(f"timesteps has shape {tuple(self.timesteps.shape)}, expected "
                             f"({len(self.timestep_values)},) to match timestep_values")
        if self.text_valid is not None and (tuple(self.text_valid.shape) != (self.text_len,)
                                            or self.text_valid.dtype != torch.bool):
            raise ValueError(f"text_valid must be a bool tensor of shape ({self.text_len},), got "
                             f"{self.text_valid.dtype} {tuple(self.text_valid.shape)}")
        if self.text_index.device.type == "cpu":
            tt, ta = self.text_len, 2 * self.audio_len
            for name, start in (("text_index", 0), ("audio_index", tt), ("video_index", tt + ta)):
                index = getattr(self, name)
                if not torch.equal(index, torch.arange(start, start + index.numel())):
                    raise ValueError(f"{name} is not the contiguous range starting at row {start}: the rows must be "
                                     "ordered [text | audio-L | audio-R | video | pad]")

    @property
    def audio_rows(self) -> int:
        """Ta: audio rows of both channels."""
        return 2 * self.audio_len

    @property
    def num_real(self) -> int:
        """Rows that are not padding."""
        return self.text_len + 2 * self.audio_len + self.video_len

    @property
    def num_media(self) -> int:
        """Audio and video rows."""
        return 2 * self.audio_len + self.video_len

    @property
    def adaln_rows(self) -> torch.Tensor:
        """[S] int64 row of the per-block AdaLN table: timestep_slot * 3 + tag (pad rows use the video tag)."""
        return self.timestep_slot * NUM_MODALITIES + self.tags.clamp(min=0)

    @property
    def device(self) -> torch.device:
        return self.positions.device

    def to(self, device: torch.device | str) -> "PackedLayout":
        """Return a copy with every tensor on `device`."""
        return replace(
            self,
            text_index=self.text_index.to(device), audio_index=self.audio_index.to(device),
            video_index=self.video_index.to(device), positions=self.positions.to(device),
            tags=self.tags.to(device), timestep_slot=self.timestep_slot.to(device),
            timesteps=self.timesteps.to(device),
            text_valid=None if self.text_valid is None else self.text_valid.to(device),
        )


def pad_prompt(buckets: PromptBuckets, text: torch.Tensor, positions: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A prompt's rows padded at the end to their bucket: text `[B, text_dim]` and positions `[B, 3]` with zero rows,
    and the `text_valid` mask `[B]` (True on the real rows) on `positions`' device."""
    # text: [L, text_dim], positions: [L, 3]
    padded, real = buckets.pad(text)
    positions = torch.cat([positions, positions.new_zeros(padded.shape[0] - real, 3)])
    return padded, positions, torch.arange(padded.shape[0], device=positions.device) < real


def padded_rows(real: int) -> int:
    """Rows of a document of `real` rows: padded up to a multiple of `PAD_MULTIPLE`."""
    return -(-real // PAD_MULTIPLE) * PAD_MULTIPLE


def _check_positions(name: str, pos: torch.Tensor, rows: int) -> torch.Tensor:
    if not isinstance(pos, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of shape [{rows}, 3], got {type(pos).__name__}")
    if tuple(pos.shape) != (rows, 3):
        raise ValueError(f"{name} has shape {tuple(pos.shape)}, expected ({rows}, 3)")
    if pos.is_floating_point() and not bool(torch.isfinite(pos).all()):
        raise ValueError(f"{name} contains non-finite values")
    return pos.detach().to(device="cpu", dtype=torch.float32)


def _check_t(name: str, t: float) -> float:
    if not isinstance(t, (int, float)) or isinstance(t, bool):
        raise ValueError(f"{name} must be a float in [0, 1], got {t!r}")
    if not 0.0 <= float(t) <= 1.0:
        raise ValueError(f"{name}={t} must lie in [0, 1] (t = 1 - sigma)")
    return _f32(t)


def pack_layout(
    *,
    text_len: int,
    audio_len_per_channel: int,
    video_rows: int,
    positions_text: torch.Tensor,
    positions_audio: torch.Tensor,
    positions_video: torch.Tensor,
    video_t: float,
    audio_t: float | None = None,
    text_t: float | None = None,
    audio_timesteps: Sequence[float] | torch.Tensor | None = None,
    pad_multiple: int = PAD_MULTIPLE,
) -> PackedLayout:
    """Build the layout of one document `[text | audio-L | audio-R | video | pad]`.

    Text and pad rows use `text_t` (default `video_t`), video rows `video_t`. Audio rows use `audio_t`, or
    `audio_timesteps` ([2 * audio_len_per_channel] values, L rows then R rows) when rows differ, e.g. the
    audio teacher's clean tail rows at t = 1. Give exactly one of `audio_t` / `audio_timesteps` when there is audio.
    """
    for name, n in (("text_len", text_len), ("audio_len_per_channel", audio_len_per_channel),
                    ("video_rows", video_rows)):
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"{name} must be a non-negative int, got {n!r}")
    if text_len + audio_len_per_channel + video_rows == 0:
        raise ValueError("text_len, audio_len_per_channel and video_rows are all 0: the document is empty")
    if pad_multiple != PAD_MULTIPLE:
        raise ValueError(f"pad_multiple={pad_multiple}: the model's documents are padded to {PAD_MULTIPLE}")
    ta = 2 * audio_len_per_channel
    pos_t = _check_positions("positions_text", positions_text, text_len)
    pos_a = _check_positions("positions_audio", positions_audio, ta)
    pos_v = _check_positions("positions_video", positions_video, video_rows)
    vt = _check_t("video_t", video_t)
    tt = vt if text_t is None else _check_t("text_t", text_t)

    if ta > 0 and (audio_t is None) == (audio_timesteps is None):
        raise ValueError("give exactly one of audio_t (one value) or audio_timesteps (per row) for the audio rows")
    if ta == 0 and audio_timesteps is not None and len(audio_timesteps) != 0:
        raise ValueError(f"audio_timesteps has {len(audio_timesteps)} values but there are no audio rows")
    if audio_timesteps is not None and ta > 0:
        vals = torch.as_tensor(audio_timesteps, dtype=torch.float64).flatten()
        if vals.numel() != ta:
            raise ValueError(f"audio_timesteps has {vals.numel()} values, expected {ta} (2 * audio_len_per_channel)")
        outside = ~((vals >= 0.0) & (vals <= 1.0))  # NaN too
        if bool(outside.any()):
            i = int(outside.nonzero()[0])
            raise ValueError(f"audio_timesteps[{i}]={vals[i].item()} must lie in [0, 1] (t = 1 - sigma)")
        audio_row_t = vals.to(torch.float32).tolist()  # one rounding to float32 for every row, as `_check_t` rounds
    elif ta > 0:
        audio_row_t = [_check_t("audio_t", audio_t)] * ta
    else:
        audio_row_t = []

    real = text_len + ta + video_rows
    seq_len = padded_rows(real)
    pad = seq_len - real
    # Row order and per-row timestep value (pad rows share the text/video value).
    row_t = [tt] * text_len + audio_row_t + [vt] * video_rows + [tt] * pad
    values: list[float] = []
    slot_of: dict[float, int] = {}
    for v in ([vt] if video_rows else []) + row_t:  # slot 0 is the video timestep when there is video
        if v not in slot_of:
            slot_of[v] = len(values)
            values.append(v)
    slots = torch.tensor([slot_of[v] for v in row_t], dtype=torch.int64)
    tags = torch.tensor([TAG_TEXT] * text_len + [TAG_AUDIO] * ta + [TAG_VIDEO] * video_rows + [TAG_PAD] * pad,
                        dtype=torch.int64)
    positions = torch.cat([pos_t, pos_a, pos_v, torch.zeros(pad, 3)], dim=0)
    return PackedLayout(
        seq_len=seq_len, text_len=text_len, audio_len=audio_len_per_channel, video_len=video_rows,
        text_index=torch.arange(0, text_len), audio_index=torch.arange(text_len, text_len + ta),
        video_index=torch.arange(text_len + ta, real), positions=positions, tags=tags, timestep_slot=slots,
        timesteps=torch.tensor(values, dtype=torch.float32), timestep_values=tuple(values),
    )
