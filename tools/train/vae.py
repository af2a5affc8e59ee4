"""Train the tiny video and audio VAEs as autoencoders on the synthetic world, in resumable time-boxed runs.

    python -m tools.train.vae --kind video --state /work/train_ckpt/video --export out/trained --minutes 10
    python -m tools.train.vae --kind audio --state /work/train_ckpt/audio --export out/trained --minutes 10

Knows nothing about serving: it builds the project's VAE classes (`services.vae.model`, the diffusers
`AutoencoderKLMiniMaxH3` / `AutoencoderKLMiniMaxH3Audio`) at the dims of `DIMS`, trains them on windows of
`tools.train.world`, and writes the EMA weights with `save_pretrained` into `<export>/vae` or `<export>/audio_vae`,
the layout `services.vae.checkpoint` loads. A run resumes from `<state>/state.pt` when it exists
(`train_state.TrainState`: model, EMA, optimizer, step, RNGs) and saves it every `--save-every` steps and when its
`--minutes` are up.

Video: a window is 22 frames (one 17-frame encoder clip plus the 5 frames of the next one), which the encoder turns
into 7 latents (5 + 2, `token_drop` 3) and the decoder turns back into the same 22 frames: one decoder clip, decoded
with the service's spatial tiles (two 192x256 tiles across the 320 px canvas) so the decoder learns what it will be
asked. The encoder runs on whole frames, clip by clip, as the DiT trainer will encode its clips. Loss: L1 in [0, 1]
RGB, pixels of the shape (and 3 px around it) weighted 5x since it covers only ~3-8% of a frame, plus `beta` x the
KL of the diagonal-Gaussian posterior (per element, against N(0, 1)); the decoder sees a posterior sample.

Audio: a window is 64 latents (1.6 s, 51,200 samples) of each stereo channel as its own mono item (the audio VAE
is mono; the service decodes L and R as two batch rows). Loss: multi-resolution STFT (spectral convergence + L1 of
log(1 + magnitude), FFT sizes 256-2048) + waveform L1 of the decode of the posterior MEAN, + `beta` x half its
square. The pipeline only ever decodes the mean (the log-std head is never evaluated), and decoding a sample
collapsed the first GPU run: the posterior noise (std ~1 at the start) drowned the means (~0.01), the decoder learnt
one buzz for every input, and the KL then pulled the means to nothing (latent std 0.002-0.017).

`--freeze-encoder` continues a run on the decoder alone: the encoder side takes its EMA weights and stops
learning, so the latents (and their statistics) stay those of the export a DiT is already training on, while the
decoder goes on improving beside it.

Export sets `latents_mean` / `latents_std` in the written config to the per-channel statistics of the posterior
mean on held-out windows, so the normalised latents the DiT works in have zero mean and unit variance per channel.
"""
from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio
from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler

from services.vae.checkpoint import AUDIO_SUBDIR, VIDEO_SUBDIR
from services.vae.model import _IMAGENET_MEAN, _IMAGENET_STD, AUDIO_PRESETS, VIDEO_PRESETS
from tools.train import world
from tools.train.train_state import EMA, TrainState, run_over

log = logging.getLogger("tools.train.vae")

# Dims: `tiny` is the product preset as it is; `trained` is what this trainer ships. The video encoder (never run
# by the service) is wider, the ViT decoder 64 wide instead of 32, the audio decoder starts at 256 channels instead
# of 128 (the 128-wide one ends in single-channel stages at 16 and 32 kHz). Together they take the VAE stage from
# 0.39 to 0.49 s a chunk on 2 CPU cores (docs/performance.md).
DIMS: dict[str, dict[str, dict]] = {
    "video": {
        "tiny": dict(VIDEO_PRESETS["tiny"]),
        "trained": dict(VIDEO_PRESETS["tiny"], block_out_channels=(16, 32, 64, 64, 64, 64), norm_num_groups=8,
                        decoder_num_attention_heads=2, decoder_attention_head_dim=32),
    },
    "audio": {
        "tiny": dict(AUDIO_PRESETS["tiny"]),
        "trained": dict(AUDIO_PRESETS["tiny"], encoder_dim=8, decoder_dim=256),
    },
}
VIDEO_WINDOW_FRAMES = 22  # clip_length + frame_overlap: 7 latents
AUDIO_WINDOW_LATENTS = 64
HOP = 800  # audio samples per latent
ENCODER_SIDE = {  # parameter-name prefixes of what makes the latents (the rest decodes them)
    "video": ("encoder.", "quant_conv."),
    "audio": ("encoder.", "pre_block.", "mean_proj.", "logs_proj."),
}
TRAIN_SEED, HELD_OUT_SEED = 0, 1 << 30  # sample i of a run uses seed base + i; held-out seeds never meet training
_STFT_SIZES = (2048, 1024, 512, 256)


def build(kind: str, dims: str) -> nn.Module:
    """The VAE of `kind` ("video" or "audio") at `dims`, with the library's initialisation."""
    if kind not in DIMS or dims not in DIMS[kind]:
        raise ValueError(f"kind={kind!r}, dims={dims!r}: use kind in {sorted(DIMS)} and dims in {sorted(DIMS['video'])}")
    cls = AutoencoderKLMiniMaxH3 if kind == "video" else AutoencoderKLMiniMaxH3Audio
    return cls(**DIMS[kind][dims])


# ---------------------------------------------------------------------------------------------------------- data


def dilate_mask(mask: np.ndarray, radius: int) -> np.ndarray:
    """Grow a boolean mask `[..., H, W]` by `radius` px (4-neighbour steps)."""
    out = mask
    for _ in range(radius):
        grown = out.copy()
        grown[..., 1:, :] |= out[..., :-1, :]
        grown[..., :-1, :] |= out[..., 1:, :]
        grown[..., :, 1:] |= out[..., :, :-1]
        grown[..., :, :-1] |= out[..., :, 1:]
        out = grown
    return out


def _scene_pair(rng: np.random.Generator, cut_prob: float, length: int) -> tuple[world.Scene, world.Scene, int]:
    """A window's scene, and with probability `cut_prob` a second one it cuts to at index `cut` (else cut=length)."""
    first = world.sample_scene(rng)
    if rng.random() < cut_prob:
        return first, world.sample_scene(rng), int(rng.integers(1, length))
    return first, first, length


class VideoWindows(Dataset):
    """Sample i: a 22-frame window of the scene of seed `base + i % distinct`, sometimes cut to a second scene
    (a prompt switch); returns uint8 frames `[F, H, W, 3]` and the uint8 loss-weight mask `[F, H, W]`."""

    def __init__(self, base: int = TRAIN_SEED, distinct: int | None = None, cut_prob: float = 0.1,
                 crop: tuple[int, int] | None = None, frames: int = VIDEO_WINDOW_FRAMES) -> None:
        self.base, self.distinct, self.cut_prob, self.crop, self.frames = base, distinct, cut_prob, crop, frames

    def __len__(self) -> int:
        return 1 << 40

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng(self.base + (i % self.distinct if self.distinct else i))
        first, second, cut = _scene_pair(rng, self.cut_prob, self.frames)
        start = int(rng.integers(0, 10 * world.FPS))
        video = world.render_video(first, start, self.frames)
        shape = np.abs(video.astype(np.int16) - np.asarray(world.BACKGROUNDS[first.background])).sum(-1) > 0
        if cut < self.frames:
            video[cut:] = world.render_video(second, start + cut, self.frames - cut)
            bg = np.asarray(world.BACKGROUNDS[second.background])
            shape[cut:] = np.abs(video[cut:].astype(np.int16) - bg).sum(-1) > 0
        weight = dilate_mask(shape, 3)
        if self.crop is not None:  # a 16-px-aligned crop (CPU tests)
            h, w = self.crop
            y = 16 * int(rng.integers(0, (world.HEIGHT - h) // 16 + 1))
            x = 16 * int(rng.integers(0, (world.WIDTH - w) // 16 + 1))
            video, weight = video[:, y:y + h, x:x + w], weight[:, y:y + h, x:x + w]
        return torch.from_numpy(np.ascontiguousarray(video)), torch.from_numpy(weight.astype(np.uint8))


class AudioWindows(Dataset):
    """Sample i: 64 latents' worth of stereo audio of the scene of seed `base + i % distinct` (sometimes cut to a
    second scene), float32 `[2, N]`."""

    def __init__(self, base: int = TRAIN_SEED, distinct: int | None = None, cut_prob: float = 0.1,
                 latents: int = AUDIO_WINDOW_LATENTS) -> None:
        self.base, self.distinct, self.cut_prob, self.samples = base, distinct, cut_prob, latents * HOP

    def __len__(self) -> int:
        return 1 << 40

    def __getitem__(self, i: int) -> torch.Tensor:
        rng = np.random.default_rng(self.base + (i % self.distinct if self.distinct else i))
        first, second, cut = _scene_pair(rng, self.cut_prob, self.samples)
        start = int(rng.integers(0, 10 * world.SAMPLE_RATE))
        audio = world.render_audio(first, start, self.samples)
        if cut < self.samples:
            audio[:, cut:] = world.render_audio(second, start + cut, self.samples - cut)
        return torch.from_numpy(audio)


class IndexRange(Sampler):
    """Sample numbers start, start + 1, ...: a resumed run picks the data up where the last one stopped."""

    def __init__(self, start: int) -> None:
        self.start = start

    def __iter__(self) -> Iterator[int]:
        i = self.start
        while True:
            yield i
            i += 1

    def __len__(self) -> int:
        return 1 << 40


# ------------------------------------------------------------------------------------------------- model paths


def to_model_space(frames: torch.Tensor) -> torch.Tensor:
    """uint8 `[B, F, H, W, 3]` -> ImageNet-normalised float `[B, 3, F, H, W]` (the video VAE's pixel space)."""
    mean = torch.tensor(_IMAGENET_MEAN, device=frames.device).view(1, 3, 1, 1, 1)
    std = torch.tensor(_IMAGENET_STD, device=frames.device).view(1, 3, 1, 1, 1)
    return (frames.permute(0, 4, 1, 2, 3).float() / 255.0 - mean) / std


def to_rgb01(sample: torch.Tensor) -> torch.Tensor:
    """Model-space `[B, 3, F, H, W]` -> RGB in [0, 1] units (not clamped)."""
    mean = torch.tensor(_IMAGENET_MEAN, device=sample.device).view(1, 3, 1, 1, 1)
    std = torch.tensor(_IMAGENET_STD, device=sample.device).view(1, 3, 1, 1, 1)
    return sample.float() * std + mean


def encode_video(vae: AutoencoderKLMiniMaxH3, x: torch.Tensor) -> DiagonalGaussianDistribution:
    """Posterior of model-space video `[B, 3, F, H, W]`, F = 17k + 5, over 5k + 2 latents: every 17-frame clip
    encoded on whole frames (no spatial tiles), all clips in one batch, then `token_drop` latents dropped.
    Equals `AutoencoderKLMiniMaxH3._encode` with tiling off."""
    clip = vae.config.clip_length
    b, c, f = x.shape[:3]
    pad = (-f) % clip
    if pad:
        x = torch.cat([x, x[:, :, -1:].expand(-1, -1, pad, -1, -1)], dim=2)
    n = x.shape[2] // clip
    clips = x.unflatten(2, (n, clip)).transpose(1, 2).flatten(0, 1)  # [B * n, 3, 17, H, W]
    moments = vae.quant_conv(vae.encoder(clips))  # [B * n, 2C, 5, h, w]
    moments = moments.unflatten(0, (b, n)).transpose(1, 2).flatten(2, 3)  # [B, 2C, 5n, h, w]
    if vae.config.token_drop > 0:
        moments = moments[:, :, : -vae.config.token_drop]
    return DiagonalGaussianDistribution(moments)


def decode_video(vae: AutoencoderKLMiniMaxH3, z: torch.Tensor) -> torch.Tensor:
    """Model-space video from unnormalised latents `[B, C, 5k + 2, h, w]` through the library's decode, spatially
    tiled as the service decodes (the library's default tiles; `VideoDecoder` uses the same grid)."""
    return vae.decode(z).sample


def kl_per_element(mean: torch.Tensor, log_std: torch.Tensor) -> torch.Tensor:
    """KL(N(mean, std^2) || N(0, 1)) averaged over every element."""
    return (0.5 * (mean.square() + torch.exp(2 * log_std) - 1.0) - log_std).mean()


def mr_stft_loss(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Multi-resolution STFT loss of mono waveforms `[B, N]`: spectral convergence + L1 of log(1 + magnitude),
    averaged over FFT sizes 2048, 1024, 512 and 256 (hop a quarter of the size, Hann window).

    log(1 + |S|), not log(max(|S|, 1e-5)): with the tiny floor, the near-empty bins (almost all of them: the world's
    sounds are one tone and its octave) made any sound outside the tone cost far more than the tone itself earns,
    and the first GPU run's decoder settled on silence (loss 1.8, every output the same DC level)."""
    total = pred.new_zeros(())
    for size in _STFT_SIZES:
        window = torch.hann_window(size, device=pred.device)
        spec = [torch.stft(w.float(), size, size // 4, window=window, return_complex=True).abs() for w in (pred, target)]
        convergence = torch.linalg.vector_norm(spec[1] - spec[0]) / torch.linalg.vector_norm(spec[1]).clamp_min(1e-7)
        log_mag = (torch.log1p(spec[0]) - torch.log1p(spec[1])).abs().mean()
        total = total + convergence + log_mag
    return total / len(_STFT_SIZES)


@dataclass(frozen=True)
class Losses:
    total: torch.Tensor
    reconstruction: float
    kl: float


class PosteriorBank:
    """The frozen encoder's posterior of each of `distinct` windows, encoded once and kept on the device.

    With `--freeze-encoder` the encoder no longer changes, so a window's posterior is the same at every visit; with
    `--distinct` the windows recur. A decoder-only run then pays the encoder once per window instead of once per
    step, and the encoder is almost all of the cost: a 22-frame window takes 150.7 GFLOP to encode and 1.5 GFLOP to
    decode (`python -m tools.train.cost`, `DIMS["trained"]`). Each window is encoded on its own, so what the bank
    holds does not depend on which windows shared a batch, and a resumed run refills it with the same values."""

    def __init__(self, distinct: int) -> None:
        self.distinct = distinct
        self.moments: dict[int, torch.Tensor] = {}  # window -> [2C, L, h, w]

    @torch.no_grad()
    def posterior(self, vae: AutoencoderKLMiniMaxH3, x: torch.Tensor, first: int) -> DiagonalGaussianDistribution:
        """The posterior of model-space video `x` `[B, 3, F, H, W]`, samples `first .. first + B - 1` of the run."""
        windows = [(first + j) % self.distinct for j in range(x.shape[0])]
        for j, window in enumerate(windows):
            if window not in self.moments:
                self.moments[window] = encode_video(vae, x[j:j + 1]).parameters[0]
        return DiagonalGaussianDistribution(torch.stack([self.moments[w] for w in windows]))


def video_loss(vae: AutoencoderKLMiniMaxH3, frames: torch.Tensor, weight: torch.Tensor, beta: float,
               bank: PosteriorBank | None = None, first: int = 0) -> Losses:
    """Weighted L1 in [0, 1] RGB of the round trip of `frames` (uint8 `[B, F, H, W, 3]`, samples `first ..` of the
    run) + beta x KL; the posterior from `bank` where one is given."""
    x = to_model_space(frames)
    posterior = encode_video(vae, x) if bank is None else bank.posterior(vae, x, first)
    sample = decode_video(vae, posterior.sample())
    w = 1.0 + 4.0 * weight.float()[:, None]  # [B, 1, F, H, W]
    rec = (w * (to_rgb01(sample) - to_rgb01(x)).abs()).mean() / w.mean()
    kl = kl_per_element(posterior.mean.float(), 0.5 * posterior.logvar.float())
    return Losses(rec + beta * kl, rec.item(), kl.item())


def audio_loss(vae: AutoencoderKLMiniMaxH3Audio, audio: torch.Tensor, beta: float) -> Losses:
    """MR-STFT + waveform L1 of the round trip of stereo `audio` `[B, 2, N]` (each channel mono) through the
    posterior mean, + beta x half the mean's square (the mean's part of the KL; the log-std head is not trained)."""
    mono = audio.flatten(0, 1)[:, None]  # [2B, 1, N]
    mean = vae.encode(mono).latent_dist.mean
    wave = vae.decode(mean).sample[:, 0]  # [2B, N]
    rec = mr_stft_loss(wave, mono[:, 0]) + (wave - mono[:, 0]).abs().mean()
    pull = 0.5 * mean.float().square().mean()
    return Losses(rec + beta * pull, rec.item(), pull.item())


# ---------------------------------------------------------------------------------------------------- training


@dataclass(frozen=True)
class RunConfig:
    """One run's settings (saved in the state's meta)."""

    kind: str
    dims: str = "trained"
    batch: int = 8
    lr: float = 2e-4
    beta: float = 1e-4
    warmup: int = 300
    ema_decay: float = 0.999
    minutes: float = 10.0
    max_steps: int | None = None
    save_every: int = 500
    log_every: int = 25
    workers: int = 4
    distinct: int | None = None
    """Train on only this many distinct samples (tests: a loss that must fall). With `freeze_encoder`, a video run
    keeps each window's posterior (`PosteriorBank`)."""
    crop: tuple[int, int] | None = None
    """Video only: train on 16-px-aligned crops of this (height, width) instead of whole frames (tests)."""
    audio_latents: int = AUDIO_WINDOW_LATENTS
    seed: int = 0
    """Seeds the initial weights (and the first run's posterior noise)."""
    freeze_encoder: bool = False
    """Train the decoder only, the encoder side held at its EMA weights (`freeze_encoder`)."""


def _dataset(cfg: RunConfig) -> Dataset:
    if cfg.kind == "video":
        return VideoWindows(distinct=cfg.distinct, crop=cfg.crop)
    return AudioWindows(distinct=cfg.distinct, latents=cfg.audio_latents)


def _step_loss(cfg: RunConfig, model: nn.Module, batch, device: torch.device, bank: PosteriorBank | None,
               first: int) -> Losses:
    if cfg.kind == "video":
        frames, weight = (t.to(device, non_blocking=True) for t in batch)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            return video_loss(model, frames, weight, cfg.beta, bank, first)
    return audio_loss(model, batch.to(device, non_blocking=True), cfg.beta)


def load_state(cfg: RunConfig, state_dir: Path, device: str | torch.device) -> TrainState:
    """The freshly initialised model, EMA and optimizer of `cfg`, resumed from `state_dir` where it holds a state."""
    torch.manual_seed(cfg.seed)
    model = build(cfg.kind, cfg.dims).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.99), weight_decay=1e-4)
    state = TrainState(model, EMA(model, cfg.ema_decay), optimizer)
    state.load(state_dir, expect=dict(kind=cfg.kind, dims=cfg.dims))
    return state


@torch.no_grad()
def freeze_encoder(state: TrainState, kind: str) -> None:
    """Hold the encoder side of `state.model` at its EMA weights from now on: the live weights take the EMA's and
    stop taking gradients (AdamW skips them), and the EMA's lerp towards equal weights then leaves them as they are.
    The exported encoder, and so the latents a DiT trains on, no longer change."""
    for name, param in state.model.named_parameters():
        if name.startswith(ENCODER_SIDE[kind]):
            param.copy_(state.ema.shadow[name].to(param.dtype))
            param.requires_grad_(False)


def train(cfg: RunConfig, state_dir: Path, device: str | torch.device) -> TrainState:
    """Run (or resume) training until `cfg.minutes` or `cfg.max_steps`; save the state; return it."""
    device = torch.device(device)
    state = load_state(cfg, state_dir, device)
    if cfg.freeze_encoder:
        freeze_encoder(state, cfg.kind)
    frozen_windows = cfg.freeze_encoder and cfg.distinct is not None and cfg.kind == "video"
    bank = PosteriorBank(cfg.distinct) if frozen_windows else None
    model, optimizer = state.model, state.optimizer
    loader = DataLoader(_dataset(cfg), batch_size=cfg.batch, sampler=IndexRange(state.step * cfg.batch),
                        num_workers=cfg.workers, pin_memory=device.type == "cuda", drop_last=True,
                        prefetch_factor=4 if cfg.workers else None,
                        generator=torch.Generator())  # its own: iterating must not draw from the resumed RNG
    state_dir.mkdir(parents=True, exist_ok=True)
    log_path = state_dir / "log.jsonl"
    started, first_step = time.monotonic(), state.step
    seconds_before = state.seconds
    window: list[tuple[float, float, float]] = []
    for batch in loader:
        for group in optimizer.param_groups:
            group["lr"] = cfg.lr * min(1.0, (state.step + 1) / cfg.warmup)
        losses = _step_loss(cfg, model, batch, device, bank, state.step * cfg.batch)
        optimizer.zero_grad(set_to_none=True)
        losses.total.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        optimizer.step()
        state.step += 1
        state.ema.update(model, state.step)
        elapsed = time.monotonic() - started
        state.seconds = seconds_before + elapsed
        window.append((losses.total.item(), losses.reconstruction, losses.kl))
        if state.step % cfg.log_every == 0:
            mean = np.mean(window, axis=0)
            record = dict(step=state.step, loss=float(mean[0]), rec=float(mean[1]), kl=float(mean[2]),
                          grad_norm=grad_norm, lr=optimizer.param_groups[0]["lr"], seconds=round(state.seconds, 1),
                          samples_per_s=round((state.step - first_step) * cfg.batch / max(elapsed, 1e-9), 2))
            with log_path.open("a") as fh:
                fh.write(json.dumps(record) + "\n")
            log.info("%s step %d loss %.5f rec %.5f kl %.3f (%.1f samples/s)", cfg.kind, state.step, mean[0],
                     mean[1], mean[2], record["samples_per_s"])
            window.clear()
        done = run_over(state_dir, elapsed, cfg.minutes, state.step, cfg.max_steps)
        if done or state.step % cfg.save_every == 0:
            state.save(state_dir, dict(vars(cfg)))
        if done:
            break
    return state


# ------------------------------------------------------------------------------------------------------ export


@torch.no_grad()
def latent_statistics(kind: str, model: nn.Module, device: torch.device, windows: int = 32, batch: int = 4,
                      crop: tuple[int, int] | None = None) -> tuple[list[float], list[float]]:
    """Per-channel mean and std of the posterior mean over `windows` held-out windows."""
    model.eval()
    chunks = []
    dataset = VideoWindows(HELD_OUT_SEED, cut_prob=0.0, crop=crop) if kind == "video" else \
        AudioWindows(HELD_OUT_SEED, cut_prob=0.0)
    for start in range(0, windows, batch):
        items = [dataset[i] for i in range(start, min(start + batch, windows))]
        if kind == "video":
            x = to_model_space(torch.stack([v for v, _ in items]).to(device))
            mean = encode_video(model, x).mean  # [B, C, L, h, w]
            chunks.append(mean.transpose(0, 1).flatten(1))
        else:
            mono = torch.stack(items).to(device).flatten(0, 1)[:, None]
            chunks.append(model.encode(mono).latent_dist.mean.transpose(0, 1).flatten(1))  # [C, B * A]
    values = torch.cat(chunks, dim=1).double()
    return values.mean(1).tolist(), values.std(1).clamp_min(1e-6).tolist()


def export(kind: str, dims: str, ema: EMA, out_root: Path, device: str | torch.device, windows: int = 32,
           crop: tuple[int, int] | None = None) -> Path:
    """Write the EMA weights of a `kind` VAE with its latent statistics (over `windows` held-out windows) to
    `out_root/vae` or `out_root/audio_vae`."""
    device = torch.device(device)
    model = build(kind, dims).to(device)
    ema.copy_to(model)
    mean, std = latent_statistics(kind, model, device, windows, crop=crop)
    model.register_to_config(latents_mean=mean, latents_std=std)
    target = out_root / (VIDEO_SUBDIR if kind == "video" else AUDIO_SUBDIR)
    model.to("cpu").save_pretrained(str(target), safe_serialization=True)
    log.info("exported the %s VAE to %s (latent std %.3f..%.3f)", kind, target, min(std), max(std))
    return target


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", required=True, choices=sorted(DIMS))
    parser.add_argument("--dims", default="trained", choices=sorted(DIMS["video"]))
    parser.add_argument("--state", required=True, type=Path, help="directory of the resumable state")
    parser.add_argument("--export", required=True, type=Path, help="MiniMax-H3 root the weights are written under")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--max-steps", type=int)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--beta", type=float, default=1e-4)
    parser.add_argument("--warmup", type=int, default=300, help="steps of linear learning-rate warm-up")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--save-every", type=int, default=500)
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--distinct", type=int)
    parser.add_argument("--crop", type=int, nargs=2, metavar=("H", "W"))
    parser.add_argument("--audio-latents", type=int, default=AUDIO_WINDOW_LATENTS)
    parser.add_argument("--stat-windows", type=int, default=32, help="held-out windows for the latent statistics")
    parser.add_argument("--export-only", action="store_true", help="export the saved state's EMA weights, no training")
    parser.add_argument("--freeze-encoder", action="store_true",
                        help="train the decoder only; the encoder keeps its EMA weights, so the latents stay put")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    cfg = RunConfig(kind=args.kind, dims=args.dims, batch=args.batch, lr=args.lr, beta=args.beta, warmup=args.warmup,
                    minutes=args.minutes, max_steps=args.max_steps, save_every=args.save_every,
                    log_every=args.log_every, workers=args.workers, distinct=args.distinct,
                    crop=tuple(args.crop) if args.crop else None, audio_latents=args.audio_latents,
                    freeze_encoder=args.freeze_encoder)
    state = load_state(cfg, args.state, args.device) if args.export_only else train(cfg, args.state, args.device)
    export(args.kind, args.dims, state.ema, args.export, args.device, args.stat_windows, cfg.crop)


if __name__ == "__main__":
    main()
