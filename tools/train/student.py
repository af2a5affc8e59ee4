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
  With `--sound-spread S`, a session's sound is rendered with its shape S px (one normal draw a session, the same
  in every request) to the side of where its frames show it: the served teacher writes a session's sound from the
  caption and its own tail, and places a still opening several dB either way of the centre, so a student that
  reads the place from the balance moves the picture with it (docs/training.md, "Run F"). With
  `--spread-requests 1` only request 0's sound stands aside and request 1's is where its picture is: a sound set
  aside for a whole session leaves the balance nothing to return to, and a served sound then walks away from a
  still shape request by request (docs/training.md, "Run F", session 15).
- Student step s's video input is the clean latents noised to sigma_s with the phase's noise, or, with
  probability `--self-rollout`, the Euler state the student's own earlier steps reached (as served). The loss is the
  x0 error of every step's prediction (x0_hat = x + sigma v) against the clean latents; the commits carry gradients
  through the history's K/V.
- With `--sink-gap U`, each session of a step keeps its sink where it was committed with probability 1/2, else
  its sink's keys turn back a uniform 0..U time units: the distance to the sink of a served session's later requests.

With `--video-weights` the base's video-only weights (`student_weights.video_only_weights`: the video patch
projection and output, each block's AdaLN rows for video) learn from the student's loss too. An audio teacher
document has no video rows, so the audio teacher, the base with the LoRA off, stays the loaded base's to the bit
(docs/training.md, "Run H").

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
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from services.dit.model.checkpoint import load_dit, write_trained_checkpoint
from services.dit.model.lora import LoRAAdapter, write_adapter
from services.dit.model.network import PRESETS, DiT
from services.dit.stream.geometry import PhasePlan, plan_request
from services.dit.stream.runtime import renormalise
from services.dit.stream.schedule import AUDIO_SIGMAS, TEACHER_MILESTONES, TEACHER_SIGMAS, VIDEO_SIGMAS, euler_step
from tools.train import world
from tools.train.ahead import Ahead
from tools.train.dit import REQUEST_FRAMES, Clips, Conditioner, encoded_before
from tools.train.documents import document, document_losses, window_means
from tools.train.session_batch import Session, SessionBatch, forward, retained
from tools.train.student_weights import (adapter_spec, base_weights, hold_shared_rows, is_lora, set_trainable,
                                         student_adapter, video_only_weights)
from tools.train.train_state import EMA, StepClock, TrainState, run_over
from tools.train.vae import HOP, IndexRange

log = logging.getLogger("tools.train.student")

REQUESTS = 2
SESSION_FRAMES = 243  # request 0's 124 + request 1's 119: 72 latents, 17k + 5 frames as the VAE encodes them
STUDENT_SEED = 1 << 20  # sessions never reuse the base trainer's clip seeds
SOUND_STREAM = 7  # the second key of a session's sound offset draw (`sound_offset`)
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


def sound_offset(seed: int, spread: float) -> float:
    """How far (px, rightwards) session `seed`'s sound stands from its picture: a normal draw of deviation `spread`,
    from a stream of its own (the session's scenes draw as without it); 0 when `spread` is 0."""
    return float(np.random.default_rng((seed, SOUND_STREAM)).normal(0.0, spread))


def render_session(seed: int, switch: float, sound_spread: float = 0.0,
                   spread_requests: int = REQUESTS) -> SessionClip:
    """Frames and sound of session `seed`, each request from its own scene (a switch cuts at the boundary; the
    audio cuts at the request's first audio latent); the sound of its first `spread_requests` requests
    `sound_offset` to the side."""
    return render_scenes(seed, session_scenes(seed, switch), sound_offset(seed, sound_spread), spread_requests)


def render_scenes(seed: int, scenes: list[world.Scene], sound_dx: float = 0.0,
                  spread_requests: int = REQUESTS) -> SessionClip:
    """Frames and sound of a session whose request k shows `scenes[k]` (`seed` names it, e.g. for a cache), the
    sound of requests k < `spread_requests` rendered from the scene moved `sound_dx` px sideways
    (`world.moved_sideways`)."""
    frames, waves = [], []
    for k, scene in enumerate(scenes):
        plan = plan_request(k)
        frames.append(world.render_video(scene, plan.frame_start, plan.num_frames))
        heard = world.moved_sideways(scene, sound_dx) if sound_dx and k < spread_requests else scene
        waves.append(world.render_audio(heard, plan.audio_start * HOP, plan.num_audio_latents * HOP))
    return SessionClip(seed, tuple(s.caption for s in scenes), torch.from_numpy(np.concatenate(frames)),
                       torch.from_numpy(np.concatenate(waves, axis=1)))


@dataclass(frozen=True)
class SeenSession:
    """A session this run has already encoded: nothing rendered, the conditioner's cache holds it."""

    seed: int


class Sessions(Dataset):
    """Session i of a run; over `distinct` sessions, i and i + distinct are one.

    `encoded_after`: a run whose conditioner caches, from its first sample on: past the first `distinct` samples
    every session has been encoded, so the workers name it (`SeenSession`) instead of rendering it again (a
    session's frames are 45 MB that the step would only pin and drop)."""

    def __init__(self, switch: float, distinct: int | None = None, encoded_after: int | None = None,
                 sound_spread: float = 0.0, spread_requests: int = REQUESTS) -> None:
        self.switch, self.distinct, self.encoded_after = switch, distinct, encoded_after
        self.sound_spread, self.spread_requests = sound_spread, spread_requests

    def __len__(self) -> int:
        return 1 << 40

    def __getitem__(self, i: int) -> SessionClip | SeenSession:
        seed = STUDENT_SEED + (i % self.distinct if self.distinct else i)
        if encoded_before(i, self.distinct, self.encoded_after):
            return SeenSession(seed)
        return render_session(seed, self.switch, self.sound_spread, self.spread_requests)


def encode_session(cond: Conditioner, clip: SessionClip | SeenSession) -> Session:
    """The frozen VAE encoders and text encoder on a rendered session (the base trainer's `Conditioner`, which
    keeps it when it caches), or the one it keeps for a session named as encoded."""
    if isinstance(clip, SeenSession):
        return cond.held(clip.seed, ("session", clip.seed))
    return cond.cached(("session", clip.seed), lambda: Session(
        tuple(cond.encode_caption(c) for c in clip.captions),
        cond.encode_frames(clip.frames),  # [72, C, h, w]
        cond.encode_wave(clip.wave)))  # [2, 405, 32]


@dataclass(frozen=True)
class StudentLoss:
    total: torch.Tensor
    """The weighted mean of every step's x0 MSE (`session_loss`)."""
    steps: tuple[float, ...]
    """Mean x0 MSE of student step 0, 1, 2 over the session's phases (unweighted)."""
    phases: tuple[float, ...]
    """Mean x0 MSE of each phase over its three steps, in session order (unweighted)."""


def session_loss(model: DiT, batch: SessionBatch, generator: torch.Generator, self_rollout: bool,
                 first_phase_weight: float = 1.0, self_commit: bool = False,
                 sink_gaps: torch.Tensor | None = None) -> StudentLoss:
    """Every phase of the batch's sessions as the runtime runs them; the x0 loss of each student step.

    The first phase of each request weighs `first_phase_weight` against 1 for the others: there the prompt is new
    (the opening, with no history; a switch, with the history still showing the old prompt's scene), so only the
    text can say what to draw, while every later phase can copy most of its scene from the history.

    Each phase commits the clean latents, or with `self_commit` what serving commits: the student's own output
    (its last Euler step), renormalised as the runtime's prompt anchor does (`own_commit`).

    With `sink_gaps` `[B]`, each session's sink is moved back that many time units (`retained`), as a later
    request of a served session sees it."""
    commits: list[tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]] = []
    anchors: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(batch.sessions)
    audio_rows: list[int] = []
    sink_turn = None if sink_gaps is None else batch.sink_turn(model, sink_gaps)
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
            history = retained(commits, audio_rows, sink_turn)
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


def draw_sink_gaps(sessions: int, most: float, generator: torch.Generator) -> torch.Tensor:
    """A gap `[B]` for each session's sink: 0 with probability 1/2 (a session's opening requests, as trained
    without the option), else uniform in [0, `most`]."""
    later = torch.rand(sessions, generator=generator) < 0.5
    return torch.where(later, torch.rand(sessions, generator=generator) * most, 0.0)


def served_history(cfg: "StudentRunConfig", step: int, generator: torch.Generator
                   ) -> tuple[bool, torch.Tensor | None]:
    """(whether this step's sessions commit their own output, their sinks' gaps `[B]` or None) for step `step`:
    neither before `cfg.served_from`. Drawn only when asked for, so that runs without them keep the random stream
    they always had."""
    if step < cfg.served_from:
        return False, None
    own = cfg.self_commit > 0 and bool(torch.rand((), generator=generator) < cfg.self_commit)
    gaps = draw_sink_gaps(cfg.sessions, cfg.sink_gap, generator) if cfg.sink_gap > 0 else None
    return own, gaps


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
    sink_gap: float = 0.0
    """U > 0: each session of a step has its sink moved back in time (RoPE units, 40 a second) by 0 with
    probability 1/2, else by a uniform draw in [0, U], as later requests of a served session see it
    (`session_loss`)."""
    served_from: int = 0
    """The step from which `self_commit` and `sink_gap` apply: the history as served is for a student that already
    draws the scene (run D's took them from step 468, at x0 about 0.2)."""
    sound_spread: float = 0.0
    """px: each session's sound stands a normal draw of this deviation to the side of its picture
    (`sound_offset`)."""
    spread_requests: int = REQUESTS
    """The requests, from the first, whose sound stands `sound_spread` aside; the later ones' is where the picture
    is."""
    self_rollout: float = 0.5
    minutes: float = 8.0
    max_steps: int | None = None
    save_every: int = 100
    log_every: int = 5
    distinct: int | None = None
    workers: int = 0
    seed: int = 0
    train_base: bool = False
    """Train the base weights too (see the module docstring): its own objective with the LoRA off, and, with
    `student_reaches_base`, the student's through the LoRA-on forwards."""
    student_reaches_base: bool = True
    """With `train_base`, the student's loss trains the base weights as well as the LoRA. False: the LoRA only, the
    base by its own objective alone, so the audio teacher (the base, LoRA off) learns from nothing but what asks of
    it (docs/training.md, "Run F at 3,214": the teacher's walk moved with the student's steps, not one way)."""
    video_weights: bool = False
    """Without `train_base`: the base's video-only weights (`video_only_weights`) learn from the student's loss
    beside the LoRA, at `base_lr`; the rest of the base, all that the audio teacher reads, stays as loaded."""
    base_lr: float = 3e-4
    base_accum: int = 4
    """Base examples (clips and audio teacher documents, `tools.train.dit`) per step with `train_base`."""
    teacher_docs: float = 0.5
    openings: float = 0.5
    """Of the base clips with `train_base`, the fraction that are opening clips (`tools.train.dit`)."""


def build(base: Path, device: torch.device, cfg: StudentRunConfig) -> tuple[DiT, LoRAAdapter]:
    """The base (float32) with a trainable LoRA; the base frozen unless `cfg.train_base`, but for its video-only
    weights with `cfg.video_weights`."""
    model = load_dit(base, PRESETS["tiny"], device, torch.float32).requires_grad_(False)
    adapter = student_adapter(model, cfg.rank, cfg.seed)
    set_trainable(model, cfg.train_base, trained_video_weights(model, cfg))
    if cfg.video_weights:
        hold_shared_rows(model)
    return model, adapter


def trained_video_weights(model: DiT, cfg: StudentRunConfig) -> frozenset[str]:
    """The names of the video-only weights that train with the student's loss (none unless `cfg.video_weights`)."""
    return frozenset(video_only_weights(model)) if cfg.video_weights else frozenset()


def param_groups(model: DiT, cfg: StudentRunConfig) -> list[dict]:
    """The optimizer's groups: the LoRA factors at `cfg.lr`, then (with `train_base`) the base's own, or (with
    `video_weights`) its video-only ones, at `cfg.base_lr`; `peak` is each group's rate after the warm-up."""
    lora = [p for n, p in model.named_parameters() if is_lora(n)]
    groups = [dict(params=lora, lr=cfg.lr, peak=cfg.lr)]
    video = trained_video_weights(model, cfg)
    if cfg.train_base or video:
        own = [p for n, p in model.named_parameters() if not is_lora(n) and (cfg.train_base or n in video)]
        groups.append(dict(params=own, lr=cfg.base_lr, peak=cfg.base_lr))
    return groups


def steps_ahead(cfg: StudentRunConfig, caches: bool) -> int:
    """How many steps' inputs `train` encodes ahead of its steps: in a run whose conditioner caches, as many as fill
    its bank of sessions and, with `train_base`, the base's cache (what is encoded is kept there anyway, so being
    ahead costs no memory); else one step's."""
    if not caches or cfg.distinct is None:
        return 1
    return max(math.ceil(cfg.distinct / cfg.sessions),
               math.ceil(cfg.distinct / cfg.base_accum) if cfg.train_base else 1)


def train(cfg: StudentRunConfig, base: Path, cond: Conditioner, state_dir: Path) -> tuple[TrainState, LoRAAdapter]:
    device = cond.device
    model, adapter = build(base, device, cfg)
    groups = param_groups(model, cfg)
    optimizer = torch.optim.AdamW(groups, betas=(0.9, 0.99), weight_decay=0.0)
    generator = torch.Generator().manual_seed(cfg.seed)  # the noise, rollouts and served history's draws
    state = TrainState(model, EMA(model, cfg.ema_decay), optimizer, generators={"student": generator})
    torch.manual_seed(cfg.seed)
    state.load(state_dir, expect=dict(rank=cfg.rank, sessions=cfg.sessions, train_base=cfg.train_base,
                                      sound_spread=cfg.sound_spread, spread_requests=cfg.spread_requests,
                                      student_reaches_base=cfg.student_reaches_base,
                                      video_weights=cfg.video_weights),
               before=dict(sound_spread=0.0, spread_requests=REQUESTS, student_reaches_base=True,
                           video_weights=False))
    state_dir.mkdir(parents=True, exist_ok=True)
    loader = dict(batch_size=None, num_workers=cfg.workers, pin_memory=device.type == "cuda",
                  prefetch_factor=4 if cfg.workers else None)
    first = state.step * cfg.sessions
    clips = iter(DataLoader(Sessions(cfg.switch, cfg.distinct, encoded_after=first if cond.caches else None,
                                     sound_spread=cfg.sound_spread, spread_requests=cfg.spread_requests),
                            sampler=IndexRange(first), generator=torch.Generator(), **loader))
    first_base = state.step * cfg.base_accum
    base_clips = iter(DataLoader(Clips(REQUEST_FRAMES, distinct=cfg.distinct, teacher_docs=cfg.teacher_docs,
                                       openings=cfg.openings, encoded_after=first_base if cond.caches else None),
                                 sampler=IndexRange(first_base), generator=torch.Generator(),
                                 **loader)) if cfg.train_base else None
    started, seconds_before, window, base_window = time.monotonic(), state.seconds, [], []
    video = trained_video_weights(model, cfg)

    def encoded():
        """Each step's sessions, then its base examples, encoded one by one (the bank and the base's cache fill from
        them)."""
        while True:
            yield from (encode_session(cond, next(clips)) for _ in range(cfg.sessions))
            if base_clips is not None:
                yield from (cond.encode(next(base_clips)) for _ in range(cfg.base_accum))

    per_step = cfg.sessions + (cfg.base_accum if base_clips is not None else 0)
    with Ahead(partial(next, encoded()), steps_ahead(cfg, cond.caches) * per_step, name="student-inputs") as inputs:
        while True:
            for group in optimizer.param_groups:
                group["lr"] = group["peak"] * min(1.0, (state.step + 1) / cfg.warmup)
            clock = StepClock(device, on=(state.step + 1) % cfg.log_every == 0)
            optimizer.zero_grad(set_to_none=True)
            set_trainable(model, cfg.train_base and cfg.student_reaches_base, video)
            batch = SessionBatch([inputs.next() for _ in range(cfg.sessions)], device)
            rollout = bool(torch.rand((), generator=generator) < cfg.self_rollout)
            own, gaps = served_history(cfg, state.step, generator)
            clock.mark("sessions")
            loss = session_loss(model, batch, generator, rollout, cfg.first_phase_weight, own, gaps)
            clock.mark("student_forward")
            loss.total.backward()
            clock.mark("student_backward")
            if base_clips is not None:
                with adapter.suspended():  # the base's own objective, LoRA off
                    set_trainable(model, True)
                    docs = [document(inputs.next(), device) for _ in range(cfg.base_accum)]
                    base_loss, parts = document_losses(model, docs)
                    base_loss.backward()
                    base_window.extend(parts)
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


def export_saved(state_dir: Path, base: Path, out: Path, rank: int, base_out: Path | None = None,
                 video_weights: bool = False) -> Path:
    """`export` of the state saved in `state_dir`, without training (`base_out`: the base of a `--train-base` or,
    with `video_weights`, a `--video-weights` state)."""
    cfg = StudentRunConfig(rank=rank, train_base=base_out is not None and not video_weights,
                           video_weights=video_weights)
    model, adapter = build(base, torch.device("cpu"), cfg)
    state = TrainState(model, EMA(model, 0.0), torch.optim.AdamW(param_groups(model, cfg)))
    if state.load(state_dir, expect=dict(rank=rank, train_base=cfg.train_base, video_weights=video_weights),
                  before=dict(video_weights=False)) is None:
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
    for name in ("rank", "sessions", "lr", "warmup", "switch", "first_phase_weight", "self_commit", "sink_gap",
                 "served_from", "sound_spread", "spread_requests", "self_rollout", "minutes", "max_steps",
                 "save_every", "log_every", "distinct", "workers", "base_lr", "base_accum", "teacher_docs", "openings"):
        value = getattr(defaults, name)
        kind = float if isinstance(value, float) else int
        parser.add_argument("--" + name.replace("_", "-"), type=kind, default=value)
    parser.add_argument("--train-base", action="store_true", help="train the base weights too")
    parser.add_argument("--base-own-loss-only", action="store_true",
                        help="with --train-base: the base weights learn from their own objective only, the "
                             "student's loss reaching the LoRA alone (the audio teacher kept the base's)")
    parser.add_argument("--video-weights", action="store_true",
                        help="train the base's video-only weights with the student's loss, the rest of the base "
                             "(all the audio teacher reads) frozen")
    parser.add_argument("--export", type=Path, help="write the EMA's LoRA here at the end")
    parser.add_argument("--export-base", type=Path,
                        help="with --train-base or --video-weights: write the EMA's base weights here (a "
                             "FL2VA/transformer directory)")
    parser.add_argument("--export-only", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.export_only:
        if args.export is None:
            parser.error("--export-only needs --export")
        export_saved(args.state, args.base, args.export, args.rank, args.export_base, args.video_weights)
        return
    if args.train_base and args.video_weights:
        parser.error("--video-weights trains part of the base, --train-base all of it: choose one")
    if args.export_base is not None and not (args.train_base or args.video_weights):
        parser.error("--export-base needs --train-base or --video-weights (else the base is the one loaded)")
    if args.base_own_loss_only and not args.train_base:
        parser.error("--base-own-loss-only needs --train-base (without it the base is frozen)")
    if args.vae_root is None or args.encoder_root is None:
        parser.error("training needs --vae-root and --encoder-root")
    if not 1 <= args.spread_requests <= REQUESTS:
        parser.error(f"--spread-requests {args.spread_requests}: a session has {REQUESTS} requests; set aside the "
                     f"sound of 1 to {REQUESTS} of them")
    torch.set_float32_matmul_precision("high")
    cfg = StudentRunConfig(rank=args.rank, sessions=args.sessions, lr=args.lr, warmup=args.warmup,
                           switch=args.switch, first_phase_weight=args.first_phase_weight,
                           self_commit=args.self_commit, sink_gap=args.sink_gap, served_from=args.served_from,
                           sound_spread=args.sound_spread, spread_requests=args.spread_requests,
                           self_rollout=args.self_rollout, minutes=args.minutes,
                           max_steps=args.max_steps, save_every=args.save_every, log_every=args.log_every,
                           distinct=args.distinct, workers=args.workers, train_base=args.train_base,
                           base_lr=args.base_lr, base_accum=args.base_accum, teacher_docs=args.teacher_docs,
                           openings=args.openings, student_reaches_base=not args.base_own_loss_only,
                           video_weights=args.video_weights)
    cond = Conditioner(args.vae_root, args.encoder_root, torch.device(args.device), SESSION_FRAMES,
                       cache=args.distinct is not None)
    state, adapter = train(cfg, args.base, cond, args.state)
    if args.export is not None:
        export(state, adapter, args.export, args.export_base)


if __name__ == "__main__":
    main()
