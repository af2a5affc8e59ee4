"""Audio teacher: the base model (LoRA suspended) writes each request's audio from text alone.

Once per request, 9 audio-only Euler forwards on a 10-state shift-3 grid over the document
[text | audio-L: tail, noise | audio-R: tail, noise] with full attention. The tail is the previous request's last
1 s (40 latents per channel) of clean teacher audio, frozen at t = 1; request 0 has none. States 3, 6 and 9 are
returned: they overwrite the student's audio rows after its steps 1, 2 and 3, so the published audio is exactly
the teacher's clean latent. Knows nothing about video, the KV cache or sessions.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, ContextManager

import torch

from services.dit.geometry import RequestPlan
from services.dit.layout import pack_layout
from services.dit.lora import LoRAAdapter
from services.dit.model import DiT, FullAttention
from services.dit.schedule import TEACHER_MILESTONES, TEACHER_SIGMAS, euler_step, model_t
from services.dit.session import CancelToken
from services.dit.timeline import Timeline


class AudioTeacher:
    """Runs the base-model audio trajectory of one request."""

    def __init__(self, model: DiT, adapter: LoRAAdapter | None):
        self.model, self.adapter = model, adapter
        self.placement: Callable[[], ContextManager] = nullcontext
        """Where the teacher's forwards run; sequence parallelism sets it (from outside) to run them unsharded."""

    def run(self, text: torch.Tensor, request: RequestPlan, timeline: Timeline, noise: torch.Tensor,
            tail: torch.Tensor | None, cancel: CancelToken) -> list[torch.Tensor]:
        """Return the teacher states 3, 6, 9 as float32 `[2, A, 32]` for the whole request."""
        # text: [L, text_dim]; noise: [2, A, 32]; tail: [2, 40, 32] clean audio of the previous request or None
        _, num, ch = noise.shape
        n_tail = 0 if tail is None else tail.shape[1]
        dev = self.model.condition_proj.weight.device
        pos_text = timeline.text(request.request_index, text.shape[0])
        pos_audio = timeline.audio(request.audio_start - n_tail, n_tail + num)
        x = noise.float().to(dev)  # [2, A, 32]
        tail_rows = None if tail is None else tail.float().to(dev)
        states: list[torch.Tensor] = []
        context = self.adapter.suspended() if self.adapter is not None else nullcontext()
        with context, self.placement(), torch.no_grad():
            for i in range(len(TEACHER_SIGMAS) - 1):
                cancel.check()
                sigma, sigma_next = TEACHER_SIGMAS[i], TEACHER_SIGMAS[i + 1]
                t = model_t(sigma)
                row_t = ([1.0] * n_tail + [t] * num) * 2
                layout = pack_layout(text_len=text.shape[0], audio_len_per_channel=n_tail + num, video_rows=0,
                                     positions_text=pos_text, positions_audio=pos_audio,
                                     positions_video=torch.zeros(0, 3), video_t=t, text_t=t,
                                     audio_timesteps=row_t).to(dev)
                doc = x if tail_rows is None else torch.cat([tail_rows, x], dim=1)  # [2, n_tail + A, 32]
                out = self.model(torch.zeros(0, self.model.args.video_row_dim, device=dev),
                                 doc.reshape(-1, ch), text, layout, FullAttention(layout))
                v = out[1].reshape(2, n_tail + num, ch)[:, n_tail:]  # [2, A, 32]
                x = euler_step(x, v, sigma, sigma_next)
                if i + 1 in TEACHER_MILESTONES:
                    states.append(x.clone())
        return states
