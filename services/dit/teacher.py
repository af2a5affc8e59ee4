"""Audio teacher: the base model (LoRA suspended) writes each request's audio from text alone.

Once per request, 9 audio-only Euler forwards on a 10-state shift-3 grid over the document
[text | audio-L: tail, noise | audio-R: tail, noise] with full attention. The tail is the previous request's last
1 s (40 latents per channel) of clean teacher audio, frozen at t = 1; request 0 has none. States 3, 6 and 9 are
returned: they overwrite the student's audio rows after its steps 1, 2 and 3, so the published audio is exactly
the teacher's clean latent.

On CUDA the 9 forwards are small (~700-900 rows) and bound by the host's kernel dispatch, so `capture_graphs`
records each step as a CUDA graph at start-up, per prompt-length bucket and audio shape. The prompt is then padded
to its bucket and the padding rows are masked out as attention keys (`PackedLayout.text_valid`), so the real rows
compute what the unpadded prompt gives. Under Ulysses the steps run whole on each rank (`placement`), or, with
`dit.teacher_sharded`, graphed and sharded over the ranks like any forward (the all-to-alls captured with them).
Knows nothing about video, the KV cache or sessions.
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from dataclasses import replace
from typing import Callable, ContextManager, Sequence

import torch

from services.common.cuda_graphs import CudaGraphBank, GraphKey, PromptBuckets
from services.dit.geometry import TEACHER_TAIL_LATENTS, RequestPlan, plan_request
from services.dit.layout import PackedLayout, pack_layout
from services.dit.lora import LoRAAdapter
from services.dit.model import DiT, FullAttention
from services.dit.schedule import TEACHER_MILESTONES, TEACHER_SIGMAS, euler_step, model_t
from services.dit.session import CancelToken
from services.dit.timeline import Timeline

log = logging.getLogger(__name__)

STEPS = len(TEACHER_SIGMAS) - 1


def request_audio_shapes() -> list[tuple[int, int]]:
    """Every (tail latents, new latents) per channel a teacher document takes: request 0, then the 198/199 cycle."""
    later = sorted({plan_request(k).num_audio_latents for k in range(1, 41)})
    return [(0, plan_request(0).num_audio_latents)] + [(TEACHER_TAIL_LATENTS, n) for n in later]


def step_layout(step: int, text_len: int, n_tail: int, num: int, pos_text: torch.Tensor, pos_audio: torch.Tensor,
                device: torch.device) -> PackedLayout:
    """Layout of teacher step `step`: the text at the step's t, the tail rows at t = 1, the new rows at the step's t."""
    t = model_t(TEACHER_SIGMAS[step])
    row_t = ([1.0] * n_tail + [t] * num) * 2
    return pack_layout(text_len=text_len, audio_len_per_channel=n_tail + num, video_rows=0,
                       positions_text=pos_text, positions_audio=pos_audio, positions_video=torch.zeros(0, 3),
                       video_t=t, text_t=t, audio_timesteps=row_t).to(device)


def step_forward(model: DiT, layout: PackedLayout) -> Callable[..., torch.Tensor]:
    """`fn(doc, text, positions, text_valid)` -> audio velocity `[Ta, 32]` of one teacher step on `layout`.

    Positions and the text mask change with every request, so they are inputs (static buffers of a graph).
    """
    def fn(doc: torch.Tensor, text: torch.Tensor, positions: torch.Tensor, text_valid: torch.Tensor) -> torch.Tensor:
        # doc: [Ta, 32] float32, text: [Tt, text_dim], positions: [S, 3], text_valid: [Tt] bool
        lay = replace(layout, positions=positions, text_valid=text_valid)
        video = torch.zeros(0, model.args.video_row_dim, device=doc.device)
        return model(video, doc, text, lay, FullAttention(lay))[1]
    return fn


class AudioTeacher:
    """Runs the base-model audio trajectory of one request."""

    def __init__(self, model: DiT, adapter: LoRAAdapter | None):
        self.model, self.adapter = model, adapter
        self.placement: Callable[[], ContextManager] = nullcontext
        """Where the teacher's forwards (and captures) run; sequence parallelism sets it (from outside) to run them
        whole on each rank."""
        self.graphs: CudaGraphBank | None = None
        """The captured steps (`capture_graphs`); None runs each step eagerly on the prompt's exact rows."""
        self.buckets: PromptBuckets | None = None
        """Prompt lengths the graphs were captured for (set with `graphs`)."""

    def _suspended(self) -> ContextManager:
        return self.adapter.suspended() if self.adapter is not None else nullcontext()

    def capture_graphs(self, buckets: PromptBuckets, audio_shapes: Sequence[tuple[int, int]] | None = None) -> None:
        """Record every step for every bucket and (tail, new) audio shape (default: every shape a session takes) as
        a CUDA graph (CPU: an eager bank), in `placement`. Sharded over a Ulysses group, every rank must call
        this at the same point: the captures run the all-to-alls."""
        audio_shapes = request_audio_shapes() if audio_shapes is None else audio_shapes
        started = time.perf_counter()
        dev = self.model.condition_proj.weight.device
        bank = CudaGraphBank(dev)
        a = self.model.args
        with self._suspended(), self.placement(), torch.no_grad():
            for size in buckets.sizes:
                text = torch.zeros(size, a.text_dim, device=dev, dtype=self.model.dtype)
                valid = torch.ones(size, dtype=torch.bool, device=dev)
                for n_tail, num in audio_shapes:
                    doc = torch.zeros(2 * (n_tail + num), a.audio_channels, device=dev)
                    for step in range(STEPS):
                        layout = step_layout(step, size, n_tail, num, torch.zeros(size, 3),
                                             torch.zeros(2 * (n_tail + num), 3), dev)
                        inputs = [doc, text, layout.positions, valid]
                        bank.capture(GraphKey.for_inputs("teacher", inputs, tag=(step, n_tail)),
                                     step_forward(self.model, layout), inputs)
        bank.seal()
        self.graphs, self.buckets = bank, buckets
        log.info("teacher: %d step graphs captured in %.1f s (buckets %s, audio shapes %s)", len(bank),
                 time.perf_counter() - started, list(buckets.sizes), list(audio_shapes))

    def release_graphs(self) -> None:
        """Free the captured steps (before the process group is destroyed: sharded graphs hold its communicator);
        later requests run eagerly."""
        if self.graphs is not None:
            self.graphs.close()
        self.graphs = self.buckets = None

    def run(self, text: torch.Tensor, request: RequestPlan, timeline: Timeline, noise: torch.Tensor,
            tail: torch.Tensor | None, cancel: CancelToken) -> list[torch.Tensor]:
        """Return the teacher states 3, 6, 9 as float32 `[2, A, 32]` for the whole request."""
        # text: [L, text_dim]; noise: [2, A, 32]; tail: [2, 40, 32] clean audio of the previous request or None
        _, num, ch = noise.shape
        n_tail = 0 if tail is None else tail.shape[1]
        dev = self.model.condition_proj.weight.device
        pos_text = timeline.text(request.request_index, text.shape[0])  # [L, 3]
        pos_audio = timeline.audio(request.audio_start - n_tail, n_tail + num)
        valid = None
        if self.graphs is not None:  # pad to the bucket: [L, text_dim] -> [B, text_dim], positions [B, 3]
            text, n = self.buckets.pad(text)
            pos_text = torch.cat([pos_text, pos_text.new_zeros(text.shape[0] - n, 3)])
            valid = torch.arange(text.shape[0], device=dev) < n  # [B] bool
        x = noise.float().to(dev)  # [2, A, 32]
        tail_rows = None if tail is None else tail.float().to(dev)
        states: list[torch.Tensor] = []
        with self._suspended(), self.placement(), torch.no_grad():
            for i in range(STEPS):
                cancel.check()
                layout = step_layout(i, text.shape[0], n_tail, num, pos_text, pos_audio, dev)
                doc = x if tail_rows is None else torch.cat([tail_rows, x], dim=1)  # [2, n_tail + A, 32]
                fn = step_forward(self.model, layout)
                if self.graphs is None:
                    out = fn(doc.reshape(-1, ch), text, layout.positions, None)
                else:
                    inputs = [doc.reshape(-1, ch), text, layout.positions, valid]
                    out = self.graphs.run(GraphKey.for_inputs("teacher", inputs, tag=(i, n_tail)), fn, inputs)
                v = out.reshape(2, n_tail + num, ch)[:, n_tail:]  # [2, A, 32]
                x = euler_step(x, v, TEACHER_SIGMAS[i], TEACHER_SIGMAS[i + 1])
                if i + 1 in TEACHER_MILESTONES:
                    states.append(x.clone())
        return states
