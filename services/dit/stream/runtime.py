"""Streaming runtime of one DiT group: a session turns (seed, canvas, prompts) into an endless stream of
audio+video latents, phase by phase.

Per request (5 s): choose the prompt (hold, updates), draw the noise (request 0's shapes: audio from seed + k after
a discarded full video draw, video from (seed + k * 1,000,003) mod 2**63; a later request drops the transport
prefix's part), start the audio teacher (with `dit.teacher_overlap` its graphs replay beside the previous phase's
commit and the first student step, which needs no teacher state). Per phase: three LoRA-student forwards (Euler on
video; the student's audio is overwritten by teacher states 3/6/9, each waited for when it is needed), renormalise
the clean video rows to an anchor phase's per-feature statistics (the session's first phase, as the official
runtime; with `renormalise_anchor` "prompt", the first phase of the request where the active prompt began), hand
the latents out, then one clean-commit forward at sigma = 0 without heads that stages K/V of every layer and commits
them as one transaction (rollback on any failure). The commit runs at the start of the next phase (before its
students, which read that K/V): a phase's latents never wait for their own commit, and a failed commit is retried
before the students. A request's text rows are computed once per text timestep (the 3 student steps and the
commit): the first forward at that timestep records their K/V of every layer, the same step of the request's later
phases runs on its media rows alone (`RuntimeConfig.reuse_text_kv`); with `RuntimeConfig.text_buckets` the text rows
are padded to a bucket, so those four forwards also have shapes the block graphs hold. Cancellation is checked between forwards and releases the
session's KV at once. Knows nothing about transport, encoding or decoding.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace
from typing import Sequence

import torch
from einops import rearrange

from services.tensors.cuda_graphs import PromptBuckets
from services.common.errors import NoCapacity
from services.dit.api import (InvalidPrompt, PhaseMeta, PhaseOutput, PhaseTimings, PromptUpdate, RuntimeConfig,
                              SessionCancelled, SessionClosed, SessionConfig)
from services.dit.stream.attention import StreamingAttention
from services.dit.stream.geometry import (TEACHER_TAIL_LATENTS, Canvas, PhasePlan, RequestPlan, check_canvas, plan_request,
                                   plans_of_every_shape)
from services.dit.stream.kv_cache import CleanAVKVCache, kv_capacity
from services.dit.model.layout import pack_layout, pad_prompt, padded_rows
from services.dit.model.lora import LoRAAdapter
from services.dit.model.network import DiT
from services.dit.stream.schedule import AUDIO_SIGMAS, VIDEO_SIGMAS, euler_step, model_t
from services.dit.stream.session import CancelToken, PromptBook, RequestPrompt
from services.dit.stream.teacher import AudioTeacher, TeacherRun
from services.dit.stream.timeline import Timeline

log = logging.getLogger(__name__)

VIDEO_SEED_STRIDE = 1_000_003
STUDENT_STEPS = len(VIDEO_SIGMAS) - 1


def text_free_block_shapes(canvases: Sequence[Canvas], ulysses_degree: int) -> list[tuple[int, int]]:
    """(rows per rank, timestep slots) of every forward a session runs without text rows (`reuse_text_kv`).

    The students of phases 1-3 of every request and the commits of phases 1-3 (run at the start of the next phase):
    phase 0's students and its commit are the request's first forwards at their text timesteps, which run the text
    (`block_graph_shapes` adds them).
    """
    return _block_shapes(canvases, ulysses_degree, phases=slice(1, None), text_rows=(0,))


def block_graph_shapes(canvases: Sequence[Canvas], ulysses_degree: int, text_buckets: Sequence[int]
                       ) -> list[tuple[int, int]]:
    """(rows per rank, timestep slots) of every student and commit forward of a session whose text rows are padded
    to `text_buckets` (`RuntimeConfig.text_buckets`): the text-free ones, and phase 0's students and its commit
    (run at the start of phase 1), which run the request's text rows. The shapes `BlockGraphs` captures."""
    with_text = _block_shapes(canvases, ulysses_degree, phases=slice(0, 1), text_rows=tuple(text_buckets))
    return sorted(set(text_free_block_shapes(canvases, ulysses_degree)) | set(with_text))


def _block_shapes(canvases: Sequence[Canvas], ulysses_degree: int, phases: slice, text_rows: Sequence[int]
                  ) -> list[tuple[int, int]]:
    slots = {len({model_t(VIDEO_SIGMAS[s]), model_t(AUDIO_SIGMAS[s])}) for s in range(STUDENT_STEPS)} | {1}
    rows = set()
    for canvas in canvases:
        for plan in plans_of_every_shape():
            for ph in plan.phases[phases]:
                rows.update(padded_rows(text + ph.media_rows(canvas)) // ulysses_degree for text in text_rows)
    return sorted((r, n) for r in rows for n in slots)


def request_noise(seed: int, request: RequestPlan, canvas: Canvas, channels: int, audio_channels: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Noise of one request: video `[F, C, h, w]` from (seed + k * 1,000,003) mod 2**63, audio `[2, A, 32]` from
    seed + k.

    As the official H3 sampler, every request draws the noise of a whole request 0 (37 video latents, 207 audio
    latents per channel); a later request drops its leading 2 video latents and 207 - A audio latents per channel
    (where the previous request's tail goes as the transport prefix), not draws its own shorter noise."""
    k, full = request.request_index, plan_request(0)
    shape = (channels, full.num_latents, canvas.latent_height, canvas.latent_width)  # [C, F0, h, w]
    video = torch.randn(shape, generator=torch.Generator().manual_seed((seed + k * VIDEO_SEED_STRIDE) % 2**63))
    gen = torch.Generator().manual_seed(seed + k)
    torch.randn(shape, generator=gen)  # discarded full video draw, as the official H3 sampler consumes it
    audio = torch.randn((2, full.num_audio_latents, audio_channels), generator=gen)  # [2, A0, 32]
    video = video[:, full.num_latents - request.num_latents:]  # [C, F, h, w]
    audio = audio[:, full.num_audio_latents - request.num_audio_latents:]  # [2, A, 32]
    return video.transpose(0, 1).contiguous(), audio.contiguous()


def patchify(latents: torch.Tensor, patch: int = 2) -> torch.Tensor:
    """`[F, C, h, w]` video latents -> `[F * h/2 * w/2, C * 4]` DiT rows (frame-major, row-major)."""
    return rearrange(latents, "f c (h ph) (w pw) -> (f h w) (c ph pw)", ph=patch, pw=patch)


def unpatchify(rows: torch.Tensor, frames: int, height: int, width: int, patch: int = 2) -> torch.Tensor:
    """`[F * h/2 * w/2, C * 4]` rows -> `[F, C, h, w]` latents."""
    return rearrange(rows, "(f h w) (c ph pw) -> f c (h ph) (w pw)", f=frames, h=height // patch,
                     w=width // patch, ph=patch, pw=patch)


def renormalise(rows: torch.Tensor, anchor: tuple[torch.Tensor, torch.Tensor] | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Clean video rows `[Tv, 96]` (float32) affinely matched to the anchor's per-feature (each of the 96 columns)
    mean and population std, unchanged without one; and the rows' own mean and std `[96]`, an anchor for later."""
    rows = rows.float()
    mean = rows.mean(dim=0)  # [96]
    std = rows.std(dim=0, unbiased=False).clamp_min(1e-6)
    if anchor is not None:
        ref_mean, ref_std = anchor
        rows = (rows - mean) / std * ref_std + ref_mean
    return rows, mean, std


@dataclass
class _RequestState:
    """What one request computes once and its phases share."""

    plan: RequestPlan
    prompt: RequestPrompt
    text: torch.Tensor  # [L, text_dim] on the model device
    video_noise: torch.Tensor  # [F, C, h, w]
    audio_noise: torch.Tensor  # [2, A, 32]
    teacher: TeacherRun  # states 3/6/9, [2, A, 32]
    text_kv: dict[float, torch.Tensor]
    """Text timestep -> the text rows' K/V of every layer `[L, 2, Tt, H_local, D]`, recorded by the request's first
    forward at that timestep (`StreamingAttention`)."""


class DiTRuntime:
    """One DiT group (model + optional LoRA); serves one active streaming session at a time (a `DiTBackend`)."""

    def __init__(self, model: DiT, config: RuntimeConfig, adapter: LoRAAdapter | None = None):
        if model.args.num_heads % config.ulysses_degree:
            raise ValueError(f"ulysses_degree={config.ulysses_degree} does not divide num_heads="
                             f"{model.args.num_heads}")
        self.model, self.config, self.adapter = model, config, adapter
        self.text_buckets = PromptBuckets(config.text_buckets) if config.text_buckets else None
        self.teacher = AudioTeacher(model, adapter)
        self._lock = threading.Lock()
        self._active: StreamingSession | None = None

    @property
    def active_session(self) -> "StreamingSession | None":
        return self._active

    @property
    def failed(self) -> bool:
        """Always False: a runtime in this process has no ranks to lose."""
        return False

    def shutdown(self) -> None:
        """Nothing runs beside this process: a no-op (`DiTBackend`)."""

    def open_session(self, config: SessionConfig, prompt: PromptUpdate,
                     fallback: PromptUpdate | None = None) -> "StreamingSession":
        """Validate and start a session; raises InvalidCanvas, InvalidPrompt or NoCapacity."""
        canvas = check_canvas(config.width, config.height, self.config.canvases)
        for p in (prompt, fallback):
            if p is not None:
                self.check_prompt(p)
        with self._lock:
            if self._active is not None:
                raise NoCapacity("this DiT group already streams a session; one active session per group")
            session = StreamingSession(self, config, canvas, prompt, fallback)
            self._active = session
        return session

    def check_prompt(self, prompt: PromptUpdate) -> None:
        """Reject an embedding of the wrong width or longer than max_text_tokens."""
        rows, width = prompt.embedding.shape
        if width != self.model.args.text_dim:
            raise InvalidPrompt(f"prompt {prompt.event_id!r}: embedding width {width}, expected text_dim "
                                f"{self.model.args.text_dim}")
        if rows > self.config.max_text_tokens:
            raise InvalidPrompt(f"prompt {prompt.event_id!r}: {rows} tokens exceed max_text_tokens "
                                f"{self.config.max_text_tokens}")

    def _release(self, session: "StreamingSession") -> None:
        with self._lock:
            if self._active is session:
                self._active = None


class StreamingSession:
    """One endless stream (a `DiTSession`); `next_phase()` produces the next phase's latents."""

    def __init__(self, runtime: DiTRuntime, config: SessionConfig, canvas: Canvas, prompt: PromptUpdate,
                 fallback: PromptUpdate | None):
        self.runtime, self.config, self.canvas = runtime, config, canvas
        model = runtime.model
        self.device = model.condition_proj.weight.device
        self.prompts = PromptBook(prompt, config.hold, fallback)
        self.timeline = Timeline(canvas, origin=prompt.embedding.shape[0])
        args = model.args
        self.kv: CleanAVKVCache | None = CleanAVKVCache(
            args.num_layers, kv_capacity(canvas, runtime.config.max_text_tokens),
            args.num_heads // runtime.config.ulysses_degree, args.head_dim, model.dtype, self.device)
        self.cancel_token = CancelToken()
        self.request_index, self.phase_index = 0, 0
        self._request: _RequestState | None = None
        self._boundary: RequestPrompt | None = None
        self._tail: torch.Tensor | None = None  # [2, 40, 32] clean teacher audio of the previous request
        self._ref_stats: tuple[torch.Tensor, torch.Tensor] | None = None  # the first phase's row mean/std [96]
        self._pending_commit: tuple[_RequestState, PhasePlan, torch.Tensor, torch.Tensor] | None = None
        """The last phase's clean commit (request, phase, video rows [Tv, 96], audio rows [2A, 32]), run first by the
        next phase."""
        self._phase_lock = threading.Lock()
        self.closed = False

    # ---- control (any thread) ----------------------------------------------------------------------------
    def submit_prompt(self, update: PromptUpdate) -> None:
        """Queue a prompt update; it takes effect at the next request boundary."""
        self.runtime.check_prompt(update)
        self.prompts.submit(update)

    def close_prompts(self) -> None:
        """No prompt will come any more: a hold at a request boundary ends at once, as if it expired."""
        self.prompts.close()

    def cancel(self) -> None:
        """Cancel: an idle session releases its KV now, a running phase at its next check between forwards."""
        self.cancel_token.cancel()
        if self._phase_lock.acquire(blocking=False):
            try:
                self._shutdown()
            finally:
                self._phase_lock.release()

    def close(self) -> None:
        """End the session normally and release its KV."""
        with self._phase_lock:
            self._shutdown()

    def _shutdown(self) -> None:
        if self.kv is not None:
            self.kv.release()
            self.kv = None
        self._request = None
        self._pending_commit = None
        self.closed = True
        self.runtime._release(self)

    def _check(self) -> None:
        self.cancel_token.check()

    # ---- generation --------------------------------------------------------------------------------------
    def next_phase(self) -> PhaseOutput:
        """Generate the next phase; raises SessionCancelled (KV released) or SessionClosed."""
        try:
            with self._phase_lock:
                if self.closed:
                    raise SessionClosed("the session is closed")
                try:
                    out = self._phase()
                    # A cancel that came after the phase's last check (during the commit or the copy out): nobody
                    # will ask for another phase, so release the session now. Under USP all ranks agree on it.
                    self._check()
                except SessionCancelled:
                    self._shutdown()
                    raise
                return out
        finally:
            # A cancel() that found the lock held after the check above released nothing: release it now.
            if self.cancel_token.cancelled and not self.closed:
                self.cancel()

    def _sync(self) -> None:
        if self.device.type == "cuda":  # this stream only: the teacher's may still be replaying beside it
            torch.cuda.current_stream(self.device).synchronize()

    def _start_request(self) -> _RequestState:
        k, model = self.request_index, self.runtime.model
        if self._boundary is None:  # chosen once per request, even if a later step fails and the phase is retried
            self._boundary = self.prompts.for_request(k, self.cancel_token)
        rp = self._boundary
        plan = plan_request(k)
        video, audio = request_noise(self.config.seed, plan, self.canvas, model.args.video_channels,
                                     model.args.audio_channels)
        text = rp.prompt.embedding.to(self.device, model.dtype)
        teacher = self.runtime.teacher.start(text, plan, self.timeline, audio, self._tail, self.cancel_token)
        self._boundary = None
        return _RequestState(plan, rp, text, video, audio, teacher, {})

    def _phase(self) -> PhaseOutput:
        t_start = time.perf_counter()
        self._check()
        first_phase = self.phase_index == 0
        # The teacher starts before the previous phase's commit, which it may run beside; but a session that may
        # hold for a prompt (in `_start_request`) commits first, so the GPU has nothing left to do while it waits.
        commit_s = self._commit_previous() if self.config.hold.enabled else 0.0
        if self._request is None:  # kept across a failed phase, so a retry reuses prompt, noise and teacher
            self._request = self._start_request()
        req = self._request
        commit_s += self._commit_previous()
        k, reset = self.request_index, self.runtime.config.audio_reset_requests
        if first_phase and k > 0 and k % reset == 0 and self.kv.audio_rows:  # after request k - 1's last commit
            self.kv.drop_audio()
            log.info("request %d: dropped cached audio history", k)
        ph = req.plan.phases[self.phase_index]
        t0 = time.perf_counter()
        try:
            xv, audio = self._student(req, ph)
        except BaseException:
            if req.teacher.failed:  # a retry starts the request's teacher again, with the same prompt
                self._boundary, self._request = req.prompt, None
            raise
        # the anchor of the clean rows' statistics: the session's first phase, or with `renormalise_anchor` "prompt"
        # the first phase of the request where the active prompt began (None: this phase's own become the anchor)
        new_prompt = first_phase and bool(req.prompt.started) and self.runtime.config.renormalise_anchor == "prompt"
        anchor = None if new_prompt else self._ref_stats
        video, mean, std = self._renormalise(xv, ph, anchor)
        self._sync()
        t1 = time.perf_counter()
        last = self.phase_index == len(req.plan.phases) - 1
        tail = req.teacher.state(-1)[:, -TEACHER_TAIL_LATENTS:].clone() if last else None
        timings = PhaseTimings(hold_s=req.prompt.hold_seconds if first_phase else 0.0,
                               teacher_s=req.teacher.seconds if first_phase else 0.0, student_s=t1 - t0,
                               commit_s=commit_s, total_s=time.perf_counter() - t_start)
        meta = PhaseMeta(request_index=self.request_index, phase_index=self.phase_index, num_frames=ph.num_frames,
                         num_audio_samples=ph.num_audio_samples, num_video_latents=ph.num_latents,
                         num_audio_latents=ph.num_audio_latents,
                         started_event_ids=req.prompt.started if first_phase else (),
                         active_event_id=req.prompt.prompt.event_id,
                         completed_event_ids=req.prompt.started + req.prompt.superseded if first_phase else (),
                         superseded_event_ids=req.prompt.superseded if first_phase else (), timings=timings)
        out = PhaseOutput(video=video.to(torch.float32, copy=True),  # stays on the device: CUDA IPC sends it
                          audio=audio.reshape(2, ph.num_audio_latents, -1).to(torch.float32, copy=True), meta=meta)
        # The phase is out: its state changes, all at once (nothing below can fail, so a retried phase finds none).
        self._pending_commit = (req, ph, patchify(video), audio)
        if anchor is None:
            self._ref_stats = (mean, std)
        if last:
            self._tail = tail
            # only the pending commit (sigma = 0) still reads this request's text K/V
            req.text_kv = {t: kv for t, kv in req.text_kv.items() if t == model_t(0.0)}
            self.request_index, self.phase_index, self._request = self.request_index + 1, 0, None
        else:
            self.phase_index += 1
        return out

    def _forward(self, req: _RequestState, ph: PhasePlan, xv: torch.Tensor, xa: torch.Tensor, sigma_v: float,
                 sigma_a: float, commit: bool = False) -> torch.Tensor | None:
        """One student (or, with `commit`, clean-commit) forward of the phase; returns the video velocity [Tv, 96].

        The text rows run only in the request's first forward at this text timestep (the video's), which records
        their K/V; later forwards at that timestep take them from the record.
        """
        text_t = model_t(sigma_v)  # text rows take the video timestep
        config = self.runtime.config
        text_kv = req.text_kv.get(text_t) if config.reuse_text_kv else None
        text = req.text if text_kv is None else req.text[:0]  # [Tt or 0, text_dim]
        positions_text = self.timeline.text(ph.request_index, text.shape[0])  # [Tt or 0, 3] on the CPU
        text_valid = None
        if text.shape[0] and self.runtime.text_buckets is not None:  # [Tt, ...] -> [bucket, ...]
            text, positions_text, text_valid = pad_prompt(self.runtime.text_buckets, text, positions_text)
        layout = pack_layout(text_len=text.shape[0], audio_len_per_channel=ph.num_audio_latents,
                             video_rows=ph.num_latents * self.canvas.rows_per_frame, positions_text=positions_text,
                             positions_audio=self.timeline.audio(ph.audio_start, ph.num_audio_latents),
                             positions_video=self.timeline.video(ph), video_t=text_t, audio_t=model_t(sigma_a))
        if text_valid is not None and not text_valid.all():  # a prompt of exactly a bucket's length is not padded
            layout = replace(layout, text_valid=text_valid)
        attention = StreamingAttention(layout, self.kv, commit=commit, text_kv=text_kv,  # from the CPU layout
                                       record=config.reuse_text_kv and text_kv is None)
        with torch.no_grad():
            out = self.runtime.model(xv, xa, text, layout.to(self.device), attention, heads=not commit)
        if attention.recorded is not None:  # only a forward that completed records
            req.text_kv[text_t] = attention.recorded
        return None if commit else out[0]

    def _student(self, req: _RequestState, ph: PhasePlan) -> tuple[torch.Tensor, torch.Tensor]:
        """Three student forwards; returns clean video rows [Tv, 96] and the teacher's clean audio [2A, 32]."""
        ch = self.runtime.model.args.audio_channels
        lat = req.video_noise[ph.latent_offset:ph.latent_offset + ph.num_latents]
        xv = patchify(lat).to(self.device)  # [Tv, 96]
        a0, a1 = ph.audio_offset, ph.audio_offset + ph.num_audio_latents
        xa = req.audio_noise[:, a0:a1].reshape(-1, ch).to(self.device)  # [2A, 32], L rows then R rows
        for s in range(STUDENT_STEPS):
            self._check()
            vv = self._forward(req, ph, xv, xa, VIDEO_SIGMAS[s], AUDIO_SIGMAS[s])
            xv = euler_step(xv, vv, VIDEO_SIGMAS[s], VIDEO_SIGMAS[s + 1])
            xa = req.teacher.state(s)[:, a0:a1].reshape(-1, ch)  # the teacher's milestone replaces the student's
        return xv, xa

    def _renormalise(self, rows: torch.Tensor, ph: PhasePlan, anchor: tuple[torch.Tensor, torch.Tensor] | None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Clean video `[F, C, h, w]` of the phase's rows `renormalise`d to the anchor; and the rows' statistics."""
        rows, mean, std = renormalise(rows, anchor)
        video = unpatchify(rows, ph.num_latents, self.canvas.latent_height, self.canvas.latent_width)
        return video, mean, std

    def _commit_previous(self) -> float:
        """Run the previous phase's clean commit, if one is pending; returns its seconds. A failed commit stays
        pending (its KV transaction rolled back), so the retried phase runs it again."""
        if self._pending_commit is None:
            return 0.0
        t0 = time.perf_counter()
        self._commit(*self._pending_commit)
        self._sync()
        self._pending_commit = None
        return time.perf_counter() - t0

    def _commit(self, req: _RequestState, ph: PhasePlan, video_rows: torch.Tensor, audio_rows: torch.Tensor) -> None:
        """Clean-commit forward at sigma = 0 without heads; all layers' media K/V commit as one transaction."""
        self._check()
        self.kv.begin(audio_rows.shape[0], video_rows.shape[0])
        try:
            self._forward(req, ph, video_rows, audio_rows, 0.0, 0.0, commit=True)
            self.kv.commit()
        except BaseException:
            if self.kv is not None:
                self.kv.rollback()
            raise
