"""RoPE (t, h, w) positions of a streaming session on one global timeline of 40 units per second.

Media: video latent frames advance 5/3 units per pixel frame, with the base model's (1, 4, 4, 4, 4) pixel-frame span
pattern counted over the session's latents (latent n of the session, request 0's first being 0, sits at pixel frame
sum_{j<n} pattern[j % 5]; request k >= 1 starts at latent 37 + 35 (k - 1), two past a span cycle, so its latents
do not restart the pattern); audio latent i sits at t = origin + i (40 Hz, global per-channel index). Spatial axes
use the aspect-normalised fractional grid x32; audio rows carry h = 0 and w pinned to the leftmost (left channel) /
rightmost (right channel) video column.
Text of a request is right-aligned to end at that request's media start, so request 0 reproduces the base
model's layout (text 0..L-1, media from L) when `origin` is the first prompt's length.

The audio teacher's documents are not on this timeline: each is the base model's own audio-only document
(`Timeline.teacher`), text at t = 0 ... L-1 and the audio placed as if the previous request's whole audio followed
the text.

Knows nothing about the model, the KV cache or sampling.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import torch

from services.dit.stream.geometry import (Canvas, PhasePlan, RequestPlan, plan_request, request_frame_start,
                                   request_latent_start)

UNITS_PER_FRAME = Fraction(5, 3)
FRAMES_PER_LATENT = (1, 4, 4, 4, 4)
SPATIAL_SCALE = 32.0


def _spatial_axis(latent_dim: int, patch: int, sqrt_area: float) -> np.ndarray:
    """`latent_dim // patch` coordinates centred on the unit interval (right end excluded), scaled by 32."""
    ratio = latent_dim / sqrt_area
    left = (1.0 - ratio) / 2.0
    return np.linspace(left, left + ratio, latent_dim // patch, endpoint=False) * SPATIAL_SCALE


def frame_grid(canvas: Canvas, patch: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, w) of the rows of one latent frame `[rows_per_frame, 2]` (row-major), and the width axis `[W/32]`."""
    lh, lw = canvas.latent_height, canvas.latent_width
    sqrt_area = float(np.sqrt(lh * lw))
    hs = torch.from_numpy(_spatial_axis(lh, patch, sqrt_area))
    ws = torch.from_numpy(_spatial_axis(lw, patch, sqrt_area))
    gh, gw = torch.meshgrid(hs, ws, indexing="ij")
    return torch.stack([gh.reshape(-1), gw.reshape(-1)], dim=-1), ws


def latent_frame_offset(latent_index: int) -> int:
    """Pixel frames before latent `latent_index` of the session (sum of the span pattern)."""
    full, rest = divmod(latent_index, len(FRAMES_PER_LATENT))
    return full * sum(FRAMES_PER_LATENT) + sum(FRAMES_PER_LATENT[:rest])


class Timeline:
    """Positions of one session; `origin` is where media time 0 sits (the first prompt's token count)."""

    def __init__(self, canvas: Canvas, origin: float, patch: int = 2):
        self.canvas, self.origin = canvas, float(origin)
        self._grid, w_axis = frame_grid(canvas, patch)  # [R, 2] float64, [W/32]
        self.w_left, self.w_right = float(w_axis[0]), float(w_axis[-1])

    def media_start(self, request_index: int) -> float:
        """Rotary time where request `request_index`'s media begins."""
        return self.origin + float(request_frame_start(request_index) * UNITS_PER_FRAME)

    def text(self, request_index: int, num_tokens: int) -> torch.Tensor:
        """[L, 3] text positions ending just before the request's media start (t = start - L ... start - 1)."""
        pos = torch.zeros(num_tokens, 3, dtype=torch.float64)
        pos[:, 0] = self.media_start(request_index) - num_tokens + torch.arange(num_tokens, dtype=torch.float64)
        return pos.float()

    def video(self, phase: PhasePlan) -> torch.Tensor:
        """[F * rows_per_frame, 3] positions of the phase's video rows, frame-major then row-major."""
        first = request_latent_start(phase.request_index) + phase.latent_offset  # the phase's first latent
        times = [self.origin + float(latent_frame_offset(first + i) * UNITS_PER_FRAME)
                 for i in range(phase.num_latents)]
        rows = self._grid.shape[0]
        pos = torch.empty(phase.num_latents, rows, 3, dtype=torch.float64)
        pos[:, :, 0] = torch.tensor(times, dtype=torch.float64)[:, None]
        pos[:, :, 1:] = self._grid[None]
        return pos.reshape(-1, 3).float()

    def audio(self, audio_start: int, num_latents: int) -> torch.Tensor:
        """[2 * A, 3] positions of A audio latents per channel from global audio index `audio_start` (L then R)."""
        return self._audio(self.origin + audio_start, num_latents)

    def teacher(self, request: RequestPlan, num_tokens: int, num_tail: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Text `[L, 3]` and audio `[2 * (n_tail + A), 3]` positions of request `request`'s audio-teacher document.

        As the official teacher's base-model document, whatever the request's place in the session: text at
        t = 0 ... L-1; request 0's audio from t = L; a later request's audio from t = L + P, P being the previous
        request's audio latents per channel (207, then 198 or 199), its tail of that request's clean audio just
        before, from t = L + P - n_tail. So the prompt sits P latents before the audio it conditions, not against it.
        """
        k = request.request_index
        previous = 0 if k == 0 else plan_request(k - 1).num_audio_latents
        pos_text = torch.zeros(num_tokens, 3, dtype=torch.float64)
        pos_text[:, 0] = torch.arange(num_tokens, dtype=torch.float64)
        pos_audio = self._audio(float(num_tokens + previous - num_tail), num_tail + request.num_audio_latents)
        return pos_text.float(), pos_audio

    def _audio(self, t0: float, num_latents: int) -> torch.Tensor:
        """[2 * A, 3] positions of A audio latents per channel from rotary time `t0` (left channel, then right)."""
        t = t0 + torch.arange(num_latents, dtype=torch.float64)
        pos = torch.zeros(2 * num_latents, 3, dtype=torch.float64)
        pos[:, 0] = t.repeat(2)
        pos[:num_latents, 2] = self.w_left
        pos[num_latents:, 2] = self.w_right
        return pos.float()
