"""Train the tiny DiT base (the teacher) on the synthetic world's clips and audio teacher documents (flow matching).

    python -m tools.train.dit --vae-root out/trained --encoder-root checkpoints/tiny/MiniMax-H3 \
        --state /work/train_ckpt/dit --minutes 10 --workers 12 [--teacher-docs 0.5] [--export out/trained]

Knows nothing about serving or streaming. An example is one of two documents the base model meets, under full
attention, both opening with the caption's unnormalised layer hidden states from the tiny text encoder
(`TextEncoder`, frozen):

- a request-0 clip: then the left and right audio latents, then the video latents, on the session timeline
  (`stream.timeline`: text at t = 0 .. L-1, media from t = L; 5/3 units per pixel frame, 40 per second);
- an audio teacher document (`--teacher-docs`, a fraction of the examples), as `stream.teacher` builds one for
  each request from text alone: [text | audio-L: tail, new | audio-R: tail, new], no video rows, at the positions
  `Timeline.teacher` gives. Half are request 0's (no tail, 207 new latents a channel), half a later request's
  (request 1 .. 4, every (previous, new) pair of audio counts a session meets: the 40-latent clean tail of the
  same scene's audio just before, then 198 or 199 new latents).
- an opening clip (`--openings`, a fraction of the clips): a request-0 clip of a session's opening scene
  (`world.opening_scene`: the caption alone decides every pixel) from frame 0, its video given as pure noise
  (sigma 1, the student's first state in a session's first phase). Only the text can tell what it shows; without
  such clips the video rows learn to read the noisy video and leave the text alone (docs/training.md).

The media latents come from the trained VAEs (`tools.train.vae`), posterior means normalised with each
checkpoint's own statistics, exactly as the VAE service will denormalise them.

Objective (rectified flow, `stream.schedule`'s convention): for clean latents x0 and noise e, x_s = (1 - s) x0 + s e
and the model, given t = 1 - s, predicts v with x0_hat = x_s + s v, so the target is v = x0 - e. Noise levels are
uniform draws u ~ U(0, 1) time-shifted as the sampler's grids are, s = k u / (1 + (k - 1) u). In a clip, video
(k = 12) and audio (k = 3) draw their own u and the text rows share the video's t; the loss is the mean squared
velocity error over the video rows plus that over the audio rows. In a teacher document one u gives the new audio
rows s = shift3(u) and the text rows s = shift12(u), the teacher's paired grids (`TEACHER_SIGMAS`,
`TEACHER_TEXT_SIGMAS`: one grid index, two shifts) made continuous; the tail rows stay clean at t = 1, and the
loss is the velocity error over the new rows only. `--accum` examples, of either kind, make one optimizer step, in
one forward, each attending only to its own rows (`tools.train.documents`, which holds the objective).

Resumable like the VAE trainer (`train_state.TrainState`); example i of a run is world seed i.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, TypeVar

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from services.dit.model.checkpoint import write_trained_checkpoint
from services.dit.model.network import PRESETS, build_random
from services.dit.stream.geometry import plan_request, plans_of_every_shape
from services.encoder.model import TextEncoder
from services.vae.checkpoint import load_audio_vae, load_video_vae
from tools.train import world
from tools.train.documents import Example, TeacherExample, document, document_losses, tail_latents, window_means
from tools.train.train_state import EMA, TrainState, run_over
from tools.train.vae import HOP, TRAIN_SEED, IndexRange, encode_video, to_model_space

T = TypeVar("T")

log = logging.getLogger("tools.train.dit")

REQUEST_FRAMES = 124  # request 0: 37 video latents, 207 audio latents a channel
TEACHER_LATER_REQUESTS = tuple(range(1, len(plans_of_every_shape()) + 1))
"""The later requests a teacher document takes the shape of: request 1 (after request 0's 207 latents) and one
period of the 198/199 cycle after it, so every (previous, new) pair of audio latent counts of a session."""
TEACHER_SWITCH = 0.3
"""Of a later request's teacher documents, those after a prompt switch: the tail is the previous prompt's sound,
the text and the new latents the new prompt's (a served switch asks the teacher for exactly that)."""


def audio_latents(frames: int) -> int:
    """Audio latents a channel that cover `frames` video frames (124 -> 207)."""
    return math.ceil(frames * 40 / world.FPS)


@dataclass(frozen=True)
class Clip:
    """One rendered clip of the world, before any model sees it (what a DataLoader worker makes)."""

    seed: int
    caption: str
    frames: torch.Tensor
    """[F, H, W, 3] uint8."""
    wave: torch.Tensor
    """[2, A * HOP] float32 stereo."""
    opening: bool = False
    """A session's opening scene from frame 0, whose video is trained from pure noise (see `render_example`)."""

    def pin_memory(self) -> "Clip":
        """The DataLoader's pinning hook: the same clip in page-locked memory."""
        return Clip(self.seed, self.caption, self.frames.pin_memory(), self.wave.pin_memory(), self.opening)


@dataclass(frozen=True)
class TeacherClip:
    """One rendered audio teacher document of the world: the caption and the audio of request `request_index`."""

    seed: int
    caption: str
    request_index: int
    wave: torch.Tensor
    """[2, (n_tail + A) * HOP] float32 stereo: the tail's audio, then the new latents'."""
    opening: bool = False
    """Request 0 of a session's opening scene, from its first sample (see `render_example`)."""

    def pin_memory(self) -> "TeacherClip":
        """The DataLoader's pinning hook: the same clip in page-locked memory."""
        return TeacherClip(self.seed, self.caption, self.request_index, self.wave.pin_memory(), self.opening)


def _draw(seed: int, teacher_docs: float) -> tuple[world.Scene, int, int | None, world.Scene | None]:
    """Scene, start frame and, for a teacher document, its request index (None: a clip) of world seed `seed`; and
    for a later request's document that follows a prompt switch (`TEACHER_SWITCH` of them), the new prompt's scene
    (`world.continued_scene` at the request's first new latent), the tail staying the first scene's."""
    rng = np.random.default_rng(seed)
    scene = world.sample_scene(rng)
    start = int(rng.integers(0, 10 * world.FPS))
    if rng.random() >= teacher_docs:
        return scene, start, None, None
    request = 0 if rng.random() < 0.5 else int(rng.choice(TEACHER_LATER_REQUESTS))
    switched = None
    if request and rng.random() < TEACHER_SWITCH:
        at = (start * world.SAMPLE_RATE // world.FPS + plan_request(request).audio_start * HOP) / world.SAMPLE_RATE
        switched = world.continued_scene(scene, at, *world.sample_grammar(rng))
    return scene, start, request, switched


def teacher_request(seed: int, teacher_docs: float) -> int | None:
    """The request whose teacher document world seed `seed` is at this fraction of teacher documents (None: a
    clip); what `render_example` renders, without rendering."""
    return _draw(seed, teacher_docs)[2]


def _render_clip(seed: int, scene: world.Scene, start: int, frames: int) -> Clip:
    video = world.render_video(scene, start, frames)
    wave = world.render_audio(scene, start * world.SAMPLE_RATE // world.FPS, audio_latents(frames) * HOP)
    return Clip(seed, scene.caption, torch.from_numpy(np.ascontiguousarray(video)), torch.from_numpy(wave))


def render_teacher(seed: int, scene: world.Scene, start: int, request_index: int,
                    switched: world.Scene | None = None) -> TeacherClip:
    """The scene's audio from its start frame as a session's request `request_index` meets it: its tail latents and
    its new ones (every window of the world is closed-form, so a later request is a later start). After a switch
    the new latents and the caption are `switched`'s."""
    plan, n_tail = plan_request(request_index), tail_latents(request_index)
    first = start * world.SAMPLE_RATE // world.FPS + (plan.audio_start - n_tail) * HOP
    if switched is None:
        wave = world.render_audio(scene, first, (n_tail + plan.num_audio_latents) * HOP)
        return TeacherClip(seed, scene.caption, request_index, torch.from_numpy(wave))
    wave = np.concatenate([world.render_audio(scene, first, n_tail * HOP),
                           world.render_audio(switched, first + n_tail * HOP, plan.num_audio_latents * HOP)], axis=1)
    return TeacherClip(seed, switched.caption, request_index, torch.from_numpy(wave))


def _opening_grammar(seed: int, openings: float) -> tuple[str, str, str, str] | None:
    """The grammar of world seed `seed`'s opening clip at this fraction of openings, None when its clip is not one.
    Drawn from a stream of the seed's own, so its clip and teacher document do not depend on the fraction."""
    rng = np.random.default_rng([seed, 1])
    return world.sample_grammar(rng) if rng.random() < openings else None


def render_example(seed: int, frames: int = REQUEST_FRAMES, teacher_docs: float = 0.0,
                   openings: float = 0.0) -> Clip | TeacherClip:
    """What world seed `seed` renders to (numpy only): its scene from a random start frame in the first 10 s, as a
    clip of `frames` frames or, for a `teacher_docs` fraction of the seeds, as an audio teacher document. Of the
    request-0 documents, clips and teacher documents alike, an `openings` fraction instead opens a session: its
    opening scene (`world.opening_scene`, which the caption alone decides) from frame 0, an opening clip's video to
    be trained from pure noise. A served session's request 0 is always an opening, and only there does the caption
    alone decide the balance (centred) and the rhythm's phase (the beat's and the bounce's from t = 0), which a
    random place and start average away. A seed's documents are the same whatever the fractions, its opening draw
    coming from a stream of its own."""
    scene, start, request, switched = _draw(seed, teacher_docs)
    grammar = _opening_grammar(seed, openings)
    if request is not None:
        if request == 0 and grammar is not None:
            return replace(render_teacher(seed, world.opening_scene(*grammar), 0, 0), opening=True)
        return render_teacher(seed, scene, start, request, switched)
    if grammar is not None:
        return replace(_render_clip(seed, world.opening_scene(*grammar), 0, frames), opening=True)
    return _render_clip(seed, scene, start, frames)


@dataclass(frozen=True)
class Seen:
    """A sample whose seed this run has already encoded: nothing rendered, the conditioner's cache holds it."""

    seed: int
    request_index: int | None
    """Its teacher document's request (None: a clip)."""
    opening: bool
    """An opening clip, or request 0's teacher document of an opening scene (`render_example`)."""


def seen(seed: int, teacher_docs: float, openings: float) -> Seen:
    """What `render_example` would render for `seed`, named without rendering it."""
    request = teacher_request(seed, teacher_docs)
    return Seen(seed, request, request in (None, 0) and _opening_grammar(seed, openings) is not None)


def render_clip(seed: int, frames: int = REQUEST_FRAMES) -> Clip:
    """The clip of world seed `seed`: its scene from a random start frame in the first 10 s (numpy only)."""
    scene, start, _, _ = _draw(seed, 0.0)
    return _render_clip(seed, scene, start, frames)


def render_teacher_clip(seed: int, request_index: int) -> TeacherClip:
    """Request `request_index`'s audio teacher document of world seed `seed`'s scene from its start frame."""
    scene, start, _, _ = _draw(seed, 0.0)
    return render_teacher(seed, scene, start, request_index)


def encoded_before(i: int, distinct: int | None, encoded_after: int | None) -> bool:
    """Whether sample i of a run over `distinct` seeds, whose conditioner caches from sample `encoded_after` on,
    has its seed encoded by an earlier sample of this process (then a worker names it instead of rendering it)."""
    return bool(distinct) and encoded_after is not None and i >= encoded_after + distinct


class Clips(Dataset):
    """Sample i: what seed `base + i` renders to (`base + i % distinct` when only `distinct` seeds are used), a
    teacher document for a `teacher_docs` fraction of the seeds and an opening clip for an `openings` fraction of
    the clips (`render_example`).

    `encoded_after`: a run whose conditioner caches, from its first sample on: past the first `distinct` samples
    every seed has been encoded, so the workers name it (`Seen`) instead of rendering it again."""

    def __init__(self, frames: int, base: int = TRAIN_SEED, distinct: int | None = None,
                 teacher_docs: float = 0.0, openings: float = 0.0, encoded_after: int | None = None) -> None:
        self.frames, self.base, self.distinct = frames, base, distinct
        self.teacher_docs, self.openings = teacher_docs, openings
        self.encoded_after = encoded_after

    def __len__(self) -> int:
        return 1 << 40

    def __getitem__(self, i: int) -> Clip | TeacherClip | Seen:
        seed = self.base + (i % self.distinct if self.distinct else i)
        if encoded_before(i, self.distinct, self.encoded_after):
            return seen(seed, self.teacher_docs, self.openings)
        return render_example(seed, self.frames, self.teacher_docs, self.openings)


class Conditioner:
    """Clips -> `Example`s: the frozen text encoder and VAE encoders (never trained here).

    The text of each caption is encoded once (the world has 540 captions and the encoder is frozen). With `cache`
    (a run over `--distinct` seeds) every encoded example is kept by its key: the video encoder is most of a
    step's cost (a 124-frame clip: 603 GFLOP to encode, against 3.6 GFLOP of matmuls for the DiT's forward and
    backward, `python -m tools.train.cost`), so a seed met again costs only the DiT. An opening clip's caption
    decides its every pixel and sample (`world.opening_scene`), so openings are kept by caption in any run: at
    most 540 are ever encoded (about 0.7 MB of latents each at 124 frames)."""

    def __init__(self, vae_root: Path, encoder_root: Path, device: torch.device, frames: int = REQUEST_FRAMES,
                 cache: bool = False) -> None:
        if frames % 17 != 5:
            raise ValueError(f"frames={frames}: a clip the video VAE encodes whole has 17k + 5 frames (124, 22, ...)")
        self.device, self.frames = device, frames
        self.video_vae = load_video_vae(vae_root, device).requires_grad_(False)
        self.audio_vae = load_audio_vae(vae_root, device).requires_grad_(False)
        self.text = TextEncoder.load(encoder_root, "tiny", device, dtype=torch.float32)
        self._texts: dict[str, torch.Tensor] = {}
        self._cache: dict[tuple, object] | None = {} if cache else None
        self._openings: dict[str, Example] = {}

    def _stats(self, vae, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        kw = dict(device=self.device, dtype=torch.float32)
        return (torch.tensor(vae.config.latents_mean, **kw).view(shape),
                torch.tensor(vae.config.latents_std, **kw).view(shape))

    @property
    def caches(self) -> bool:
        return self._cache is not None

    def cached(self, key: tuple, make: Callable[[], T]) -> T:
        """`make()`, kept under `key` when this conditioner caches."""
        if self._cache is None:
            return make()
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def held(self, seed: int, key: tuple) -> object:
        """What this conditioner keeps under `key`: seed `seed`, which a worker named as encoded instead of rendering
        it again."""
        if self._cache is None or key not in self._cache:
            raise KeyError(f"seed {seed} ({key}) was named as encoded, but this conditioner holds no such example: "
                           "only a caching conditioner's run from its first sample may skip rendering")
        return self._cache[key]

    def example(self, seed: int) -> Example:
        """The example of world seed `seed`."""
        return self.encode(render_clip(seed, self.frames))

    def teacher_example(self, seed: int, request_index: int) -> TeacherExample:
        """Request `request_index`'s audio teacher document of world seed `seed`."""
        return self.encode(render_teacher_clip(seed, request_index))

    def encode(self, clip: Clip | TeacherClip | Seen) -> Example | TeacherExample:
        """The example of a rendered clip or teacher document, or of one already encoded (`Seen`)."""
        if isinstance(clip, Seen):
            return self.held(clip.seed, (clip.seed, clip.request_index, clip.opening))
        if isinstance(clip, TeacherClip):
            return self.cached((clip.seed, clip.request_index, clip.opening), lambda: TeacherExample(
                clip.caption, self.encode_caption(clip.caption), clip.request_index, self.encode_wave(clip.wave)))
        make = self._opening if clip.opening else self._encoded
        return self.cached((clip.seed, None, clip.opening), lambda: make(clip))

    def _encoded(self, clip: Clip) -> Example:
        return Example(clip.caption, self.encode_caption(clip.caption), self.encode_frames(clip.frames),
                       self.encode_wave(clip.wave), clip.opening)

    def _opening(self, clip: Clip) -> Example:
        """The example of an opening clip: the one of its caption, encoded the first time the caption opens."""
        if clip.caption not in self._openings:
            self._openings[clip.caption] = self._encoded(clip)
        return self._openings[clip.caption]

    @torch.no_grad()
    def encode_frames(self, frames: torch.Tensor) -> torch.Tensor:
        """[F, C, h, w] normalised video latents (the posterior means) of uint8 frames `[F, H, W, 3]`, F = 17k + 5.
        On a GPU the encoder runs under bf16 autocast, as the VAE trainer trained it."""
        x = to_model_space(frames[None].to(self.device, non_blocking=True))
        mu, sd = self._stats(self.video_vae, (-1, 1, 1, 1))
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
            mean = encode_video(self.video_vae, x).mean[0]  # [C, F', h, w]
        return ((mean.float() - mu) / sd).transpose(0, 1).contiguous()

    @torch.no_grad()
    def encode_wave(self, wave: torch.Tensor) -> torch.Tensor:
        """[2, A, 32] normalised audio latents of a stereo wave `[2, A * HOP]`."""
        mono = wave.to(self.device, non_blocking=True)[:, None]  # [2, 1, N]
        mu, sd = self._stats(self.audio_vae, (1, -1, 1))
        return ((self.audio_vae.encode(mono).latent_dist.mean.float() - mu) / sd).transpose(1, 2).contiguous()

    def encode_caption(self, caption: str) -> torch.Tensor:
        """[L, text_dim] layer hidden states of `caption`, encoded once."""
        if caption not in self._texts:  # a normal tensor: the encoder runs in inference mode
            self._texts[caption] = self.text.encode(caption).float().clone()
        return self._texts[caption]


@dataclass(frozen=True)
class DiTRunConfig:
    """One run's settings (saved in the state's meta)."""

    dims: str = "tiny"
    frames: int = REQUEST_FRAMES
    accum: int = 4
    lr: float = 3e-4
    warmup: int = 200
    ema_decay: float = 0.999
    minutes: float = 10.0
    max_steps: int | None = None
    save_every: int = 200
    log_every: int = 10
    distinct: int | None = None
    """Train on only this many distinct clips, encoded once (tests: a loss that must fall)."""
    workers: int = 0
    """DataLoader processes that render the clips (0: in the training process)."""
    teacher_docs: float = 0.5
    """Fraction of the examples that are audio teacher documents instead of clips."""
    openings: float = 0.0
    """Fraction of the clips that are opening clips, their video trained from pure noise."""
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("teacher_docs", "openings"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name}={getattr(self, name)} is a fraction of the examples, in [0, 1]")


def train(cfg: DiTRunConfig, conditioner: Conditioner, state_dir: Path) -> TrainState:
    """Run (or resume) training until `cfg.minutes` or `cfg.max_steps`; save the state; return it."""
    device = conditioner.device
    model = build_random(PRESETS[cfg.dims], device, torch.float32, cfg.seed).requires_grad_(True).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.99), weight_decay=0.0)
    state = TrainState(model, EMA(model, cfg.ema_decay), optimizer)
    torch.manual_seed(cfg.seed)
    state.load(state_dir, expect=dict(dims=cfg.dims, frames=cfg.frames))
    state_dir.mkdir(parents=True, exist_ok=True)
    first = state.step * cfg.accum
    clips = iter(DataLoader(Clips(cfg.frames, TRAIN_SEED, cfg.distinct, cfg.teacher_docs, cfg.openings,
                                  encoded_after=first if conditioner.caches else None),
                            batch_size=None, sampler=IndexRange(first), num_workers=cfg.workers,
                            pin_memory=device.type == "cuda", prefetch_factor=4 if cfg.workers else None,
                            generator=torch.Generator()))  # its own: iterating must not draw from the resumed RNG
    started, seconds_before, window = time.monotonic(), state.seconds, []
    while True:
        for group in optimizer.param_groups:
            group["lr"] = cfg.lr * min(1.0, (state.step + 1) / cfg.warmup)
        optimizer.zero_grad(set_to_none=True)
        docs = [document(conditioner.encode(next(clips)), device) for _ in range(cfg.accum)]
        loss, parts = document_losses(model, docs)  # the step's examples in one packed forward
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        optimizer.step()
        state.step += 1
        state.ema.update(model, state.step)
        elapsed = time.monotonic() - started
        state.seconds = seconds_before + elapsed
        window.extend(parts)
        if state.step % cfg.log_every == 0:
            means = window_means(window)
            record = dict(step=state.step, **means, grad_norm=grad_norm, lr=optimizer.param_groups[0]["lr"],
                          seconds=round(state.seconds, 1))
            with (state_dir / "log.jsonl").open("a") as fh:
                fh.write(json.dumps(record) + "\n")
            log.info("dit step %d %s", state.step,
                     " ".join(f"{k} {'-' if v is None else f'{v:.4f}'}" for k, v in means.items()))
            window.clear()
        done = run_over(state_dir, elapsed, cfg.minutes, state.step, cfg.max_steps)
        if done or state.step % cfg.save_every == 0:
            state.save(state_dir, dict(vars(cfg)))
        if done:
            return state


def export(state: TrainState, dims: str, out: Path) -> Path:
    """Write the EMA weights of `state` to `out/FL2VA/transformer` in the shipped (original) layout, which
    `services.dit.model.checkpoint.load_dit` loads; returns that directory."""
    return write_trained_checkpoint(PRESETS[dims], state.ema.shadow, out / "FL2VA" / "transformer")


def export_saved(state_dir: Path, dims: str, out: Path) -> Path:
    """`export` of the state saved in `state_dir`, without training (the GPU call returns states, not weights)."""
    model = build_random(PRESETS[dims], "cpu", torch.float32, 0)
    state = TrainState(model, EMA(model, 0.0), torch.optim.AdamW(model.parameters()))
    if state.load(state_dir, expect=dict(dims=dims)) is None:
        raise FileNotFoundError(f"no saved state in {state_dir}")
    return export(state, dims, out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vae-root", type=Path, help="MiniMax-H3 root with the trained vae/, audio_vae/")
    parser.add_argument("--encoder-root", type=Path, help="MiniMax-H3 root with text_encoder/, tokenizer/")
    parser.add_argument("--state", required=True, type=Path)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dims", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--frames", type=int, default=REQUEST_FRAMES)
    parser.add_argument("--accum", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--max-steps", type=int)
    parser.add_argument("--save-every", type=int, default=200)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--distinct", type=int)
    parser.add_argument("--workers", type=int, default=0, help="DataLoader processes that render the clips")
    parser.add_argument("--teacher-docs", type=float, default=0.5, metavar="P",
                        help="fraction of the examples that are audio teacher documents (default 0.5)")
    parser.add_argument("--openings", type=float, default=0.0, metavar="P",
                        help="fraction of the clips that are opening clips, video from pure noise (default 0)")
    parser.add_argument("--export", type=Path, help="write the EMA weights to EXPORT/FL2VA/transformer at the end")
    parser.add_argument("--export-only", action="store_true", help="export the saved state without training")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.export_only:
        if args.export is None:
            parser.error("--export-only needs --export")
        export_saved(args.state, args.dims, args.export)
        return
    if args.vae_root is None or args.encoder_root is None:
        parser.error("training needs --vae-root and --encoder-root")
    for flag, value in (("--teacher-docs", args.teacher_docs), ("--openings", args.openings)):
        if not 0.0 <= value <= 1.0:
            parser.error(f"{flag} {value}: a fraction of the examples, in [0, 1]")
    torch.set_float32_matmul_precision("high")  # TF32 on CUDA; the bf16 path would take the serving Triton kernels
    cfg = DiTRunConfig(dims=args.dims, frames=args.frames, accum=args.accum, lr=args.lr, warmup=args.warmup,
                       minutes=args.minutes, max_steps=args.max_steps, save_every=args.save_every,
                       log_every=args.log_every, distinct=args.distinct, workers=args.workers,
                       teacher_docs=args.teacher_docs, openings=args.openings)
    conditioner = Conditioner(args.vae_root, args.encoder_root, torch.device(args.device), args.frames,
                              cache=args.distinct is not None)
    state = train(cfg, conditioner, args.state)
    if args.export is not None:
        export(state, cfg.dims, args.export)


if __name__ == "__main__":
    main()
