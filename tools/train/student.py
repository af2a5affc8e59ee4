"""Train the tiny TaoMate LoRA student for the streaming pattern, on sessions of the synthetic world.

    python -m tools.train.student --base out/dit_export --vae-root out/trained --encoder-root checkpoints/tiny/MiniMax-H3 \
        --state /work/train_ckpt/student --minutes 8 [--export out/student]

Knows nothing about serving. The base DiT (`tools.train.dit`'s export) stays frozen; a LoRA on its targets learns
what the runtime (`services.dit.stream.runtime`) asks of the student, forward for forward:

- A session is two requests (243 frames: 72 video latents, 405 audio latents a channel), eight causal phases. It
  opens on the caption's own scene (`world.opening_scene`); with `--switch` probability request 1 switches to a
  new caption at its first frame, the shape carried on from where it was (`world.continued_scene`).
- Phase n runs the three student forwards at the fixed video sigmas (1, 0.9612, 0.8533), each attending to
  [its request's text | the clean history the KV cache holds before phase n | the phase's own media rows], then
  the clean commit (sigma 0, text at t = 1), whose media K/V become history. The history is the cache's retention:
  before phase n >= 3, commit 0's video rows (the sink) and commits n - 2 and n - 1 whole (`kv_cache`).
- The audio rows a student forward sees are the audio teacher's states at that step (noise, then its states 3 and
  6, at the teacher's sigmas): here the clean audio noised to those sigmas. The commit takes the clean audio.
- Student step s's video input is the clean latents noised to sigma_s with the phase's noise, or, with
  probability `--self-rollout`, the Euler state the student's own earlier steps reached (as served). The loss is the
  x0 error of every step's prediction (x0_hat = x + sigma v) against the clean latents; the commits carry gradients
  through the history's K/V.

Several sessions run side by side in each forward (`--sessions`): their rows share one packed document, each
session attending to its own rows only (in the token refiner too). Resumable like the other trainers; session i of a
run is seed `STUDENT_SEED + i`.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from services.dit.model.checkpoint import load_dit, write_trained_checkpoint
from services.dit.model.layout import PackedLayout, pack_layout, padded_rows
from services.dit.model.lora import AdapterSpec, LoRAAdapter, lora_targets, write_adapter
from services.dit.model.network import PRESETS, DiT
from services.dit.stream.geometry import Canvas, PhasePlan, plan_request, request_latent_start
from services.dit.stream.runtime import patchify, renormalise
from services.dit.stream.schedule import (AUDIO_SIGMAS, TEACHER_MILESTONES, TEACHER_SIGMAS, VIDEO_SIGMAS, euler_step,
                                          model_t)
from services.dit.stream.timeline import Timeline
from tools.train import world
from tools.train.dit import REQUEST_FRAMES, Clips, Conditioner
from tools.train.documents import document, document_losses, window_means
from tools.train.train_state import EMA, TrainState, run_over
from tools.train.vae import HOP, IndexRange

log = logging.getLogger("tools.train.student")

REQUESTS = 2
SESSION_FRAMES = 243  # request 0's 124 + request 1's 119: 72 latents, 17k + 5 frames as the VAE encodes them
STUDENT_SEED = 1 << 20  # sessions never reuse the base trainer's clip seeds
STEPS = len(VIDEO_SIGMAS) - 1
AUDIO_STEP_SIGMAS = (1.0,) + tuple(TEACHER_SIGMAS[m] for m in TEACHER_MILESTONES[:-1])
"""Sigma of the audio a student step is given: noise, then the teacher's states 3 and 6."""


@dataclass(frozen=True)
class SessionClip:
    """One rendered session (what a DataLoader worker makes)."""

    seed: int
    captions: tuple[str, ...]
    """The prompt of each request."""
    frames: torch.Tensor
    """[243, H, W, 3] uint8."""
    wave: torch.Tensor
    """[2, 405 * HOP] float32 stereo."""

    def pin_memory(self) -> "SessionClip":
        return SessionClip(self.seed, self.captions, self.frames.pin_memory(), self.wave.pin_memory())


def session_scenes(seed: int, switch: float) -> list[world.Scene]:
    """The scene of each request of session `seed`: the opening scene, then (with probability `switch`) another."""
    rng = np.random.default_rng(seed)
    scenes = [world.opening_scene(*world.sample_grammar(rng))]
    for k in range(1, REQUESTS):
        if rng.random() < switch:
            at = plan_request(k).frame_start / world.FPS
            scenes.append(world.continued_scene(scenes[-1], at, *world.sample_grammar(rng)))
        else:
            scenes.append(scenes[-1])
    return scenes


def render_session(seed: int, switch: float) -> SessionClip:
    """Frames and sound of session `seed`, each request from its own scene (a switch cuts at the boundary; the
    audio cuts at the request's first audio latent)."""
    scenes = session_scenes(seed, switch)
    frames, waves = [], []
    for k, scene in enumerate(scenes):
        plan = plan_request(k)
        frames.append(world.render_video(scene, plan.frame_start, plan.num_frames))
        waves.append(world.render_audio(scene, plan.audio_start * HOP, plan.num_audio_latents * HOP))
    return SessionClip(seed, tuple(s.caption for s in scenes), torch.from_numpy(np.concatenate(frames)),
                       torch.from_numpy(np.concatenate(waves, axis=1)))


class Sessions(Dataset):
    def __init__(self, switch: float, distinct: int | None = None) -> None:
        self.switch, self.distinct = switch, distinct

    def __len__(self) -> int:
        return 1 << 40

    def __getitem__(self, i: int) -> SessionClip:
        return render_session(STUDENT_SEED + (i % self.distinct if self.distinct else i), self.switch)


@dataclass(frozen=True)
class Session:
    """One session as the DiT sees it."""

    texts: tuple[torch.Tensor, ...]
    """Per request, [L, text_dim] layer hidden states of its prompt."""
    video: torch.Tensor
    """[72, 24, h, w] normalised video latents."""
    audio: torch.Tensor
    """[2, 405, 32] normalised audio latents (left, right)."""


def encode_session(cond: Conditioner, clip: SessionClip) -> Session:
    """The frozen VAE encoders and text encoder on a rendered session (the base trainer's `Conditioner`, which
    keeps it when it caches)."""
    return cond.cached(("session", clip.seed), lambda: Session(
        tuple(cond.encode_caption(c) for c in clip.captions),
        cond.encode_frames(clip.frames),  # [72, C, h, w]
        cond.encode_wave(clip.wave)))  # [2, 405, 32]


@dataclass(frozen=True)
class SessionRows:
    """Where the rows of B sessions sit in one packed document `[texts | audio-L | audio-R | video | pad]`
    (session-major inside each block), as the indices `SessionsAttention` gathers and scatters them by."""

    seq_len: int
    """S: the document's rows, padding included."""
    text_index: torch.Tensor
    """[B, Lmax] int64 packed row of each session's text rows; row 0 past a text's end."""
    text_valid: torch.Tensor
    """[B, Lmax] bool, False past a text's end."""
    media_index: torch.Tensor
    """[B, M] int64 packed rows of each session's media: its audio-L, audio-R, then video rows (M = 2A + Tv)."""
    order: torch.Tensor
    """[S] int64: the row of [text outputs `[B * Lmax]` | media outputs `[B * M]` | a zero row] each packed row
    takes (the inverse of the two gathers; pad rows take the zero row)."""


def session_rows(text_lens: list[int], audio_len: int, video_len: int, device: torch.device) -> SessionRows:
    """The rows of B sessions of `text_lens` text rows, `audio_len` audio rows a channel and `video_len` video rows
    each."""
    b, a, tv = len(text_lens), audio_len, video_len
    lens = torch.tensor(text_lens)
    lmax, tt, m = max(text_lens), sum(text_lens), 2 * a + tv
    col = torch.arange(lmax)
    text_valid = col < lens[:, None]  # [B, Lmax]
    text_index = torch.where(text_valid, (lens.cumsum(0) - lens)[:, None] + col, 0)
    session = torch.arange(b)[:, None]  # [B, 1]
    media_index = torch.cat([tt + session * a + torch.arange(a),  # audio-L
                             tt + b * a + session * a + torch.arange(a),  # audio-R
                             tt + 2 * b * a + session * tv + torch.arange(tv)], dim=1)  # video -> [B, M]
    seq_len = padded_rows(tt + b * m)
    order = torch.full((seq_len,), b * (lmax + m))
    order[text_index[text_valid]] = torch.arange(b * lmax)[text_valid.flatten()]
    order[media_index.flatten()] = b * lmax + torch.arange(b * m)
    return SessionRows(seq_len, text_index.to(device), text_valid.to(device), media_index.to(device),
                       order.to(device))


class SessionsAttention:
    """The streaming pattern for B sessions packed in one document (`SessionRows`): each text attends to itself;
    each session's media rows to [its text | its history | its media rows]. With `commit`, each layer's media K/V
    `[B, M, H, D]` (rows: audio-L, audio-R, video) are kept in `committed`."""

    def __init__(self, rows: SessionRows, history: list[list[tuple[torch.Tensor, torch.Tensor]]], commit: bool):
        self.rows, self.history, self.commit = rows, history, commit  # history[layer]: [(k, v) [B, n, H, D], ...]
        self.committed: list[tuple[torch.Tensor, torch.Tensor]] = []
        valid = rows.text_valid  # [B, Lmax]
        held = sum(k.shape[1] for k, _ in history[0]) if history else 0  # n: history rows of a session
        keys = torch.cat([valid, valid.new_ones(valid.shape[0], held + rows.media_index.shape[1])], dim=1)
        self.text_mask = valid[:, None, None, :]  # [B, 1, 1, Lmax]
        self.media_mask = keys[:, None, None, :]  # [B, 1, 1, Lmax + n + M]

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q, k, v: [S, H, D]
        rows = self.rows
        if q.shape[0] != rows.seq_len:
            raise ValueError(f"SessionsAttention built for {rows.seq_len} rows got q with {q.shape[0]} rows")
        qt, kt, vt = (x[rows.text_index].transpose(1, 2) for x in (q, k, v))  # [B, H, Lmax, D]
        out_t = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=self.text_mask)  # each text over itself
        qm, km, vm = (x[rows.media_index] for x in (q, k, v))  # [B, M, H, D]
        if self.commit:
            self.committed.append((km, vm))
        hist = self.history[layer] if self.history else []
        keys = torch.cat([kt.transpose(1, 2)] + [h[0] for h in hist] + [km], dim=1)  # [B, Lmax + n + M, H, D]
        values = torch.cat([vt.transpose(1, 2)] + [h[1] for h in hist] + [vm], dim=1)
        out_m = F.scaled_dot_product_attention(qm.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                               attn_mask=self.media_mask)  # [B, H, M, D]
        parts = [out_t.transpose(1, 2).flatten(0, 1), out_m.transpose(1, 2).flatten(0, 1),
                 q.new_zeros(1, *q.shape[1:])]  # [B * Lmax + B * M + 1, H, D]
        return torch.cat(parts)[rows.order]  # [S, H, D]


def retained(commits: list[tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]], audio_rows: list[int]
             ) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per layer, the history the KV cache holds after `len(commits)` commits: all of them up to 2; from 3 on,
    commit 0's video rows (the sink) and the 2 newest whole. `audio_rows[i]`: commit i's audio rows (both
    channels)."""
    if not commits:
        return []
    n, layers = len(commits), len(commits[0][1])
    out: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(layers)]
    for i, (index, per_layer) in enumerate(commits):
        if n > 2 and index == 0:
            cut = audio_rows[0]
            for layer, (k, v) in enumerate(per_layer):
                out[layer].append((k[:, cut:], v[:, cut:]))
        elif i >= n - 2:
            for layer, kv in enumerate(per_layer):
                out[layer].append(kv)
    return out


class SessionBatch:
    """B encoded sessions on one canvas; builds the packed document of any phase and step."""

    def __init__(self, sessions: list[Session], device: torch.device):
        self.sessions, self.device = sessions, device
        _, _, lh, lw = sessions[0].video.shape
        self.canvas = Canvas(width=lw * 16, height=lh * 16)
        self.timelines = [Timeline(self.canvas, origin=float(s.texts[0].shape[0])) for s in sessions]
        self.video = torch.stack([s.video for s in sessions]).to(device)  # [B, 72, 24, h, w]
        self.audio = torch.stack([s.audio for s in sessions]).to(device)  # [B, 2, 405, 32]
        self._phases: dict[tuple[int, int], tuple[dict, SessionRows]] = {}

    def refined_texts(self, model: DiT, k: int) -> torch.Tensor:
        """Request `k`'s text rows of every session, packed `[sum L_b, C]`, through the condition projection and the
        token refiner, each prompt attending to its own rows. Neither sees the phase, the step or the noise level, so
        one loss computes them once a request and all of the request's forwards share them (their gradients add up
        there)."""
        lens = torch.tensor([s.texts[k].shape[0] for s in self.sessions])
        owner = torch.repeat_interleave(torch.arange(len(lens)), lens)  # [Tt] session of each row
        own_prompt = (owner[:, None] == owner[None, :]).to(self.device)  # [Tt, Tt]
        texts = torch.cat([s.texts[k] for s in self.sessions]).to(self.device)  # [Tt, text_dim]
        return model.token_refiner(model.condition_proj(texts), own_prompt)

    def clean(self, ph: PhasePlan) -> tuple[torch.Tensor, torch.Tensor]:
        """Clean video rows `[B, Tv, 96]` and audio rows `[B, 2A, 32]` (L rows then R rows) of phase `ph`."""
        first = request_latent_start(ph.request_index) + ph.latent_offset
        b = len(self.sessions)
        video = patchify(self.video[:, first:first + ph.num_latents].flatten(0, 1)).unflatten(0, (b, -1))
        audio = self.audio[:, :, ph.audio_start:ph.audio_start + ph.num_audio_latents].flatten(1, 2)
        return video, audio

    def phase(self, ph: PhasePlan) -> tuple[dict, SessionRows]:
        """What the packed documents of phase `ph` share whatever the step: `pack_layout`'s row counts and positions,
        and the sessions' rows; built once a phase."""
        key = (ph.request_index, ph.phase_index)
        if key not in self._phases:
            k, a = ph.request_index, ph.num_audio_latents
            lens = [s.texts[k].shape[0] for s in self.sessions]
            aud = [tl.audio(ph.audio_start, a) for tl in self.timelines]  # each [2A, 3]: L then R
            pos_v = torch.cat([tl.video(ph) for tl in self.timelines])
            document = dict(text_len=sum(lens), audio_len_per_channel=len(lens) * a, video_rows=pos_v.shape[0],
                            positions_text=torch.cat([tl.text(k, n) for tl, n in zip(self.timelines, lens)]),
                            positions_audio=torch.cat([p[:a] for p in aud] + [p[a:] for p in aud]),
                            positions_video=pos_v)
            self._phases[key] = document, session_rows(lens, a, pos_v.shape[0] // len(lens), self.device)
        return self._phases[key]

    def layout(self, ph: PhasePlan, sigma_v: float, sigma_a: float) -> tuple[PackedLayout, SessionRows]:
        """The packed layout of phase `ph` for every session at (sigma_v, sigma_a), text at the video's t, and the
        sessions' rows in it."""
        document, rows = self.phase(ph)
        layout = pack_layout(**document, video_t=model_t(sigma_v), audio_t=model_t(sigma_a))
        return layout.to(self.device), rows


def forward(model: DiT, batch: SessionBatch, ph: PhasePlan, video: torch.Tensor, audio: torch.Tensor,
            sigma_v: float, sigma_a: float, history, commit: bool, texts: torch.Tensor):
    """One student (or commit) forward of phase `ph` for the batch: video velocity `[B, Tv, 96]` (None for a
    commit) and the attention (its `committed` K/V after a commit). `texts`: the request's refined texts, packed
    `[sum L_b, C]` (`SessionBatch.refined_texts`)."""
    # video: [B, Tv, 96], audio: [B, 2A, 32] (L rows then R rows per session)
    layout, rows = batch.layout(ph, sigma_v, sigma_a)
    b, tv, a = video.shape[0], video.shape[1], ph.num_audio_latents
    rows_a = model.audio_patch_proj(torch.cat([audio[:, :a].flatten(0, 1), audio[:, a:].flatten(0, 1)]))
    rows_v = model.video_patch_proj(video.flatten(0, 1))
    pad = layout.seq_len - layout.num_real
    x = torch.cat([texts, rows_a, rows_v, rows_v.new_zeros(pad, rows_v.shape[1])])  # [S, C]
    attention = SessionsAttention(rows, history, commit)
    x = model.run_blocks(x, layout, attention, range(len(model.blocks)))
    if commit:
        return None, attention
    v_video, _ = model.head(x, layout)
    return v_video.unflatten(0, (b, tv)), attention


@dataclass(frozen=True)
class StudentLoss:
    total: torch.Tensor
    """The weighted mean of every step's x0 MSE (`session_loss`)."""
    steps: tuple[float, ...]
    """Mean x0 MSE of student step 0, 1, 2 over the session's phases (unweighted)."""
    phases: tuple[float, ...]
    """Mean x0 MSE of each phase over its three steps, in session order (unweighted)."""


def session_loss(model: DiT, batch: SessionBatch, generator: torch.Generator, self_rollout: bool,
                 first_phase_weight: float = 1.0, self_commit: bool = False) -> StudentLoss:
    """Every phase of the batch's sessions as the runtime runs them; the x0 loss of each student step.

    The first phase of each request weighs `first_phase_weight` against 1 for the others: there the prompt is new
    (the opening, with no history; a switch, with the history still showing the old prompt's scene), so only the
    text can say what to draw, while every later phase can copy most of its scene from the history.

    Each phase commits the clean latents, or with `self_commit` what serving commits: the student's own output
    (its last Euler step), renormalised as the runtime's prompt anchor does (`own_commit`)."""
    commits: list[tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]] = []
    anchors: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(batch.sessions)
    audio_rows: list[int] = []
    per_step = [[] for _ in range(STEPS)]
    per_phase = []
    total = 0.0
    weights = 0.0
    n = 0
    for k in range(REQUESTS):
        texts = batch.refined_texts(model, k)  # once a request: every forward of it takes the same
        for i, ph in enumerate(plan_request(k).phases):
            weight = first_phase_weight if i == 0 else 1.0
            phase = 0.0
            x0_v, x0_a = batch.clean(ph)
            e_v = torch.randn(x0_v.shape, generator=generator).to(batch.device)
            e_a = torch.randn(x0_a.shape, generator=generator).to(batch.device)
            history = retained(commits, audio_rows)
            x = e_v
            for s in range(STEPS):
                sv, sa = VIDEO_SIGMAS[s], AUDIO_STEP_SIGMAS[s]
                if not self_rollout:
                    x = (1 - sv) * x0_v + sv * e_v
                xa = (1 - sa) * x0_a + sa * e_a
                v, _ = forward(model, batch, ph, x, xa, sv, AUDIO_SIGMAS[s], history, commit=False, texts=texts)
                x0_hat = x + sv * v
                loss = F.mse_loss(x0_hat, x0_v)
                phase = phase + loss
                per_step[s].append(loss.detach())
                x = euler_step(x, v.detach(), sv, VIDEO_SIGMAS[s + 1]).detach()
            total = total + weight * phase
            weights += weight * STEPS
            per_phase.append(phase.detach() / STEPS)
            committed = own_commit(batch, ph, x, anchors) if self_commit else x0_v
            _, att = forward(model, batch, ph, committed, x0_a, 0.0, 0.0, history, commit=True, texts=texts)
            commits.append((n, att.committed))
            audio_rows.append(x0_a.shape[1])
            n += 1
    steps = torch.stack([torch.stack(p) for p in per_step]).mean(dim=1).tolist()  # one read, no sync a forward
    return StudentLoss(total / weights, tuple(steps), tuple(torch.stack(per_phase).tolist()))


def own_commit(batch: SessionBatch, ph: PhasePlan, x: torch.Tensor,
               anchors: list[tuple[torch.Tensor, torch.Tensor] | None]) -> torch.Tensor:
    """The student's clean output `x` `[B, Tv, 96]` as the runtime commits it: each session's rows renormalised to
    the first phase of the request where its prompt began (that phase is its own anchor: request 0's first, and a
    later request's first when its caption differs from the last request's). Updates `anchors` in place."""
    rows, k = [], ph.request_index
    for b, session in enumerate(batch.sessions):
        new_prompt = ph.phase_index == 0 and (k == 0 or not torch.equal(session.texts[k], session.texts[k - 1]))
        own, mean, std = renormalise(x[b], None if new_prompt else anchors[b])
        if new_prompt:
            anchors[b] = (mean, std)
        rows.append(own)
    return torch.stack(rows).detach()


def student_adapter(model: DiT, rank: int, seed: int) -> LoRAAdapter:
    """A fresh LoRA on every target of `model`, trainable: A random, B zero (so it starts as the base model)."""
    gen = torch.Generator().manual_seed(seed)
    factors = {t: (torch.randn(rank, fan_in, generator=gen) / math.sqrt(fan_in), torch.zeros(fan_out, rank))
               for t, (fan_in, fan_out) in lora_targets(model.args).items()}
    adapter = LoRAAdapter(model, AdapterSpec(rank, float(rank), factors), dtype=torch.float32)
    for layer in adapter.layers.values():
        for mod in layer.lora_A.values():
            mod.requires_grad_(True)
        for mod in layer.lora_B.values():
            mod.requires_grad_(True)
    return adapter


def adapter_spec(adapter: LoRAAdapter, weights: dict[str, torch.Tensor]) -> AdapterSpec:
    """The adapter's factors as held in `weights` (a state dict of the model, e.g. the EMA's)."""
    factors = {}
    for target in adapter.layers:
        a = weights[f"{target}.lora_A.taomate.weight"].float().cpu()
        b = weights[f"{target}.lora_B.taomate.weight"].float().cpu()
        factors[target] = (a.contiguous(), b.contiguous())
    return AdapterSpec(adapter.spec.rank, adapter.spec.alpha, factors)


@dataclass(frozen=True)
class StudentRunConfig:
    rank: int = 32
    sessions: int = 8
    """Sessions side by side in each forward (one optimizer step)."""
    lr: float = 5e-4
    warmup: int = 50
    ema_decay: float = 0.995
    switch: float = 0.35
    first_phase_weight: float = 1.0
    """The weight of each request's first phase in the student's loss (`session_loss`)."""
    self_commit: float = 0.0
    """The fraction of steps whose sessions commit the student's own output instead of the clean latents (as
    served; `session_loss`)."""
    self_rollout: float = 0.5
    minutes: float = 8.0
    max_steps: int | None = None
    save_every: int = 100
    log_every: int = 5
    distinct: int | None = None
    workers: int = 0
    seed: int = 0
    train_base: bool = False
    """Train the base weights too (see the module docstring): its own objective with the LoRA off, and the
    student's through the LoRA-on forwards."""
    base_lr: float = 3e-4
    base_accum: int = 4
    """Base examples (clips and audio teacher documents, `tools.train.dit`) per step with `train_base`."""
    teacher_docs: float = 0.5
    openings: float = 0.5
    """Of the base clips with `train_base`, the fraction that are opening clips (`tools.train.dit`)."""


def build(base: Path, device: torch.device, cfg: StudentRunConfig) -> tuple[DiT, LoRAAdapter]:
    """The base (float32) with a trainable LoRA; the base frozen unless `cfg.train_base`."""
    model = load_dit(base, PRESETS["tiny"], device, torch.float32).requires_grad_(False)
    adapter = student_adapter(model, cfg.rank, cfg.seed)
    set_trainable(model, cfg.train_base)
    return model, adapter


def is_lora(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def set_trainable(model: DiT, train_base: bool) -> None:
    """The LoRA factors trainable, and the base weights when `train_base` (the adapter's on/off switch freezes its
    layers, so this runs again after every LoRA-off forward)."""
    for name, p in model.named_parameters():
        p.requires_grad_(is_lora(name) or train_base)


def param_groups(model: DiT, cfg: StudentRunConfig) -> list[dict]:
    """The optimizer's groups: the LoRA factors at `cfg.lr`, then (with `train_base`) the base's own at
    `cfg.base_lr`; `peak` is each group's rate after the warm-up."""
    lora = [p for n, p in model.named_parameters() if is_lora(n)]
    groups = [dict(params=lora, lr=cfg.lr, peak=cfg.lr)]
    if cfg.train_base:
        own = [p for n, p in model.named_parameters() if not is_lora(n)]
        groups.append(dict(params=own, lr=cfg.base_lr, peak=cfg.base_lr))
    return groups


def base_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The base model's own state dict from that of the model with the LoRA installed (peft's `base_layer` names)."""
    return {k.replace(".base_layer.", "."): v for k, v in weights.items() if not is_lora(k)}


class StepClock:
    """Wall seconds of each part of one step, the device drained at every mark (so each part holds its own GPU
    work); a clock made with `on=False` does nothing, so only the logged steps pay for the syncs."""

    def __init__(self, device: torch.device, on: bool):
        self.device, self.on, self.parts = device, on, {}
        self.last = time.monotonic()

    def mark(self, part: str) -> None:
        if not self.on:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.monotonic()
        self.parts[part] = round(now - self.last, 3)
        self.last = now


def train(cfg: StudentRunConfig, base: Path, cond: Conditioner, state_dir: Path) -> tuple[TrainState, LoRAAdapter]:
    device = cond.device
    model, adapter = build(base, device, cfg)
    groups = param_groups(model, cfg)
    optimizer = torch.optim.AdamW(groups, betas=(0.9, 0.99), weight_decay=0.0)
    state = TrainState(model, EMA(model, cfg.ema_decay), optimizer)
    torch.manual_seed(cfg.seed)
    state.load(state_dir, expect=dict(rank=cfg.rank, sessions=cfg.sessions, train_base=cfg.train_base))
    state_dir.mkdir(parents=True, exist_ok=True)
    loader = dict(batch_size=None, num_workers=cfg.workers, pin_memory=device.type == "cuda",
                  prefetch_factor=4 if cfg.workers else None)
    clips = iter(DataLoader(Sessions(cfg.switch, cfg.distinct), sampler=IndexRange(state.step * cfg.sessions),
                            generator=torch.Generator(), **loader))
    first_base = state.step * cfg.base_accum
    base_clips = iter(DataLoader(Clips(REQUEST_FRAMES, distinct=cfg.distinct, teacher_docs=cfg.teacher_docs,
                                       openings=cfg.openings, encoded_after=first_base if cond.caches else None),
                                 sampler=IndexRange(first_base), generator=torch.Generator(),
                                 **loader)) if cfg.train_base else None
    generator = torch.Generator().manual_seed(cfg.seed)
    started, seconds_before, window, base_window = time.monotonic(), state.seconds, [], []
    while True:
        for group in optimizer.param_groups:
            group["lr"] = group["peak"] * min(1.0, (state.step + 1) / cfg.warmup)
        clock = StepClock(device, on=(state.step + 1) % cfg.log_every == 0)
        optimizer.zero_grad(set_to_none=True)
        batch = SessionBatch([encode_session(cond, next(clips)) for _ in range(cfg.sessions)], device)
        rollout = bool(torch.rand((), generator=generator) < cfg.self_rollout)
        # drawn only when asked for, so runs without it keep the random stream they always had
        own = cfg.self_commit > 0 and bool(torch.rand((), generator=generator) < cfg.self_commit)
        clock.mark("sessions")
        loss = session_loss(model, batch, generator, rollout, cfg.first_phase_weight, own)
        clock.mark("student_forward")
        loss.total.backward()
        clock.mark("student_backward")
        if base_clips is not None:
            with adapter.suspended():  # the base's own objective, LoRA off
                set_trainable(model, True)
                docs = [document(cond.encode(next(base_clips)), device) for _ in range(cfg.base_accum)]
                base_loss, parts = document_losses(model, docs)
                base_loss.backward()
                base_window.extend(parts)
            set_trainable(model, True)
            clock.mark("base")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(groups[0]["params"], 1.0))
        for group in groups[1:]:  # the base's gradients are clipped on their own scale
            torch.nn.utils.clip_grad_norm_(group["params"], 1.0)
        optimizer.step()
        state.step += 1
        state.ema.update(model, state.step)
        clock.mark("optimizer")
        elapsed = time.monotonic() - started
        state.seconds = seconds_before + elapsed
        window.append(loss.steps)
        if state.step % cfg.log_every == 0:
            steps = np.mean(window, axis=0)
            record = dict(step=state.step, x0=[round(float(s), 5) for s in steps], grad_norm=grad_norm,
                          seconds=round(state.seconds, 1))
            if base_window:
                record["base"] = window_means(base_window)
            record["timing"] = clock.parts  # this step's alone
            with (state_dir / "log.jsonl").open("a") as fh:
                fh.write(json.dumps(record) + "\n")
            log.info("student step %d x0 %s%s", state.step, " ".join(f"{s:.4f}" for s in steps),
                     f" base {record['base']}" if base_window else "")
            window.clear()
            base_window.clear()
        done = run_over(state_dir, elapsed, cfg.minutes, state.step, cfg.max_steps)
        if done or state.step % cfg.save_every == 0:
            state.save(state_dir, dict(vars(cfg)))
        if done:
            return state, adapter


def export(state: TrainState, adapter: LoRAAdapter, out: Path, base_out: Path | None = None) -> Path:
    """Write the EMA's LoRA to `out` in the native TaoMate layout (`services.dit.model.lora.load_adapter`), and with
    `base_out` its base weights to `base_out` in the shipped layout (`load_dit`): a LoRA belongs to the base it
    was trained on."""
    if base_out is not None:
        write_trained_checkpoint(PRESETS["tiny"], base_weights(state.ema.shadow), base_out)
    return write_adapter(adapter_spec(adapter, state.ema.shadow), out)


def export_saved(state_dir: Path, base: Path, out: Path, rank: int, base_out: Path | None = None) -> Path:
    """`export` of the state saved in `state_dir`, without training (`base_out`: a `--train-base` state's base)."""
    cfg = StudentRunConfig(rank=rank, train_base=base_out is not None)
    model, adapter = build(base, torch.device("cpu"), cfg)
    state = TrainState(model, EMA(model, 0.0), torch.optim.AdamW(param_groups(model, cfg)))
    if state.load(state_dir, expect=dict(rank=rank, train_base=cfg.train_base)) is None:
        raise FileNotFoundError(f"no saved state in {state_dir}")
    return export(state, adapter, out, base_out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, type=Path, help="the base DiT's FL2VA/transformer directory")
    parser.add_argument("--vae-root", type=Path)
    parser.add_argument("--encoder-root", type=Path)
    parser.add_argument("--state", required=True, type=Path)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    defaults = StudentRunConfig()
    for name in ("rank", "sessions", "lr", "warmup", "switch", "first_phase_weight", "self_commit", "self_rollout",
                 "minutes", "max_steps", "save_every", "log_every", "distinct", "workers", "base_lr", "base_accum",
                 "teacher_docs", "openings"):
        value = getattr(defaults, name)
        kind = float if isinstance(value, float) else int
        parser.add_argument("--" + name.replace("_", "-"), type=kind, default=value)
    parser.add_argument("--train-base", action="store_true", help="train the base weights too")
    parser.add_argument("--export", type=Path, help="write the EMA's LoRA here at the end")
    parser.add_argument("--export-base", type=Path,
                        help="with --train-base: write the EMA's base weights here (a FL2VA/transformer directory)")
    parser.add_argument("--export-only", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.export_only:
        if args.export is None:
            parser.error("--export-only needs --export")
        export_saved(args.state, args.base, args.export, args.rank, args.export_base)
        return
    if args.export_base is not None and not args.train_base:
        parser.error("--export-base needs --train-base")
    if args.vae_root is None or args.encoder_root is None:
        parser.error("training needs --vae-root and --encoder-root")
    torch.set_float32_matmul_precision("high")
    cfg = StudentRunConfig(rank=args.rank, sessions=args.sessions, lr=args.lr, warmup=args.warmup,
                           switch=args.switch, first_phase_weight=args.first_phase_weight,
                           self_commit=args.self_commit,
                           self_rollout=args.self_rollout, minutes=args.minutes,
                           max_steps=args.max_steps, save_every=args.save_every, log_every=args.log_every,
                           distinct=args.distinct, workers=args.workers, train_base=args.train_base,
                           base_lr=args.base_lr, base_accum=args.base_accum, teacher_docs=args.teacher_docs,
                           openings=args.openings)
    cond = Conditioner(args.vae_root, args.encoder_root, torch.device(args.device), SESSION_FRAMES,
                       cache=args.distinct is not None)
    state, adapter = train(cfg, args.base, cond, args.state)
    if args.export is not None:
        export(state, adapter, args.export, args.export_base)


if __name__ == "__main__":
    main()
