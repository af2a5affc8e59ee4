"""How well trained VAEs reconstruct held-out clips of the synthetic world, through the service's own decoders.

    python -m tools.train.vae_eval --root out/trained --clips 16 --json out/vae_metrics.json --preview out/p.png

Knows nothing about training: it loads `<root>/vae` and `<root>/audio_vae` with the service's loaders
(`services.vae.checkpoint`), encodes each held-out clip (`tools.train.vae.encode_video`, the audio posterior mean),
normalises the latents with the checkpoint's own statistics and decodes them with `VideoDecoder` / `AudioDecoder`,
as the VAE service decodes what the DiT sends. Figures (a mean over the clips unless named otherwise):

- video: PSNR over whole frames (uint8), PSNR inside the shape and 3 px around it, the shape's colour error (the
  mean RGB of the pixels the original paints solid, 0-255 units, largest channel difference), the shape's IoU
  (a pixel is the shape's where it is nearer the shape's colour than the background's) and its centroid error (px, in the middle frame; `shape_lost` counts the clips whose
  decode has no shape pixel there);
- audio: log-spectral distance (dB, STFT 1024 / 256), the multi-resolution STFT loss the trainer uses, the share
  of clips whose loudest frequency is the colour's pitch (within 3%), and the error of the L/R balance (dB).
"""
from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import numpy as np
import torch

from services.vae.checkpoint import load_audio_vae, load_video_vae
from services.vae.model import AudioDecoder, VideoDecoder
from tools.train import world
from tools.train.vae import HELD_OUT_SEED, dilate_mask, encode_video, mr_stft_loss, to_model_space

log = logging.getLogger("tools.train.vae_eval")

EVAL_SEED = HELD_OUT_SEED + 10_000  # apart from the windows `export` measures its statistics on


def eval_seed(i: int) -> int:
    return EVAL_SEED + i


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return 99.0 if mse == 0 else 10 * np.log10(255.0 ** 2 / mse)


def _nearer_shape(frames: np.ndarray, rgb: np.ndarray, bg: np.ndarray) -> np.ndarray:
    """Pixels nearer the shape's colour than the background's: `[F, H, W]` bool."""
    f = frames.astype(np.float32)
    return ((f - rgb) ** 2).sum(-1) < ((f - bg) ** 2).sum(-1)


def _centroid(mask: np.ndarray) -> np.ndarray:
    ys, xs = np.nonzero(mask)
    return np.array([xs.mean(), ys.mean()]) if xs.size else np.array([np.nan, np.nan])


@torch.no_grad()
def reconstruct_video(decoder: VideoDecoder, frames: np.ndarray) -> np.ndarray:
    """uint8 `[F, H, W, 3]` (F = 17k + 5) -> the service decode of its normalised posterior-mean latents."""
    vae = decoder.vae
    x = to_model_space(torch.from_numpy(frames)[None].to(decoder.device))
    mean = encode_video(vae, x).mean[0].float()  # [C, L, h, w]
    stats = dict(device=mean.device, dtype=torch.float32)
    mu = torch.tensor(vae.config.latents_mean, **stats).view(-1, 1, 1, 1)
    sd = torch.tensor(vae.config.latents_std, **stats).view(-1, 1, 1, 1)
    latents = ((mean - mu) / sd).permute(1, 0, 2, 3)  # [L, C, h, w], what the DiT emits
    return decoder.decode(latents).numpy()


@torch.no_grad()
def reconstruct_audio(decoder: AudioDecoder, audio: np.ndarray) -> np.ndarray:
    """float32 `[2, N]` (N a multiple of 800) -> the service decode of its normalised posterior-mean latents."""
    vae = decoder.vae
    mono = torch.from_numpy(audio).to(decoder.device)[:, None]  # [2, 1, N]
    mean = vae.encode(mono).latent_dist.mean.float()  # [2, C, A]
    stats = dict(device=mean.device, dtype=torch.float32)
    mu = torch.tensor(vae.config.latents_mean, **stats).view(1, -1, 1)
    sd = torch.tensor(vae.config.latents_std, **stats).view(1, -1, 1)
    return decoder.decode(((mean - mu) / sd).transpose(1, 2)).numpy()  # [2, A * 800]


def video_figures(decoder: VideoDecoder, clips: int, frames: int) -> tuple[dict, list[tuple[np.ndarray, ...]]]:
    """Figures over `clips` held-out clips of `frames` frames; also each clip's middle (original, decoded) frame."""
    rows, previews = [], []
    for i in range(clips):
        clip = world.make_clip(eval_seed(i), frames, start_frame=int(np.random.default_rng(i).integers(0, 120)))
        out = reconstruct_video(decoder, clip.video)
        rgb = np.asarray(world.COLOUR_BY_NAME[clip.scene.colour].rgb, np.float32)
        bg = np.asarray(world.BACKGROUNDS[clip.scene.background], np.float32)
        painted = np.abs(clip.video.astype(np.int16) - bg.astype(np.int16)).sum(-1) > 0
        near = dilate_mask(painted, 3)
        solid = np.all(clip.video == rgb.astype(np.uint8), axis=-1)
        shape_in, shape_out = _nearer_shape(clip.video, rgb, bg), _nearer_shape(out, rgb, bg)
        iou = (shape_in & shape_out).sum() / max((shape_in | shape_out).sum(), 1)
        mid = frames // 2
        rows.append(dict(
            psnr=_psnr(out, clip.video), psnr_shape=_psnr(out[near], clip.video[near]),
            colour_error=float(np.abs(out[solid].astype(np.float32).mean(0) - rgb).max()),
            iou=float(iou), centroid_error=float(np.linalg.norm(_centroid(shape_out[mid]) - _centroid(shape_in[mid])))))
        previews.append((clip.video[mid], out[mid]))
    figures = {k: float(np.nanmean([r[k] for r in rows])) for k in rows[0]}  # centroid: clips that kept a shape
    figures.update(shape_lost=sum(bool(np.isnan(r["centroid_error"])) for r in rows), psnr_min=float(min(r["psnr"] for r in rows)), iou_min=float(min(r["iou"] for r in rows)),
                   clips=clips, frames=frames)
    return figures, previews


def _log_spectrum(x: np.ndarray) -> np.ndarray:
    spec = torch.stft(torch.from_numpy(x), 1024, 256, window=torch.hann_window(1024), return_complex=True).abs()
    return 20 * np.log10(spec.numpy() + 1e-5)


def _dominant_hz(mono: np.ndarray) -> float:
    spectrum = np.abs(np.fft.rfft(mono * np.hanning(mono.size)))
    return float(np.fft.rfftfreq(mono.size, 1 / world.SAMPLE_RATE)[spectrum.argmax()])


def audio_figures(decoder: AudioDecoder, clips: int, seconds: float) -> dict:
    """Figures over `clips` held-out clips of `seconds` (rounded down to whole latents)."""
    rows = []
    frames = int(seconds * world.FPS) // 3 * 3  # a multiple of 3 frames is a whole number of 800-sample latents
    for i in range(clips):
        clip = world.make_clip(eval_seed(i), frames)
        out = reconstruct_audio(decoder, clip.audio)[:, : clip.audio.shape[1]]
        lsd = np.sqrt(((_log_spectrum(out) - _log_spectrum(clip.audio)) ** 2).mean(axis=1)).mean()
        pitch = world.COLOUR_BY_NAME[clip.scene.colour].pitch_hz
        rms_in, rms_out = (np.sqrt((a ** 2).mean(1)) + 1e-9 for a in (clip.audio, out))
        rows.append(dict(
            lsd_db=float(lsd),
            mr_stft=float(mr_stft_loss(torch.from_numpy(out), torch.from_numpy(clip.audio))),
            pitch_match=float(abs(_dominant_hz(out.sum(0)) - pitch) < 0.03 * pitch),
            balance_error_db=float(abs(20 * np.log10(rms_out[1] / rms_out[0]) - 20 * np.log10(rms_in[1] / rms_in[0])))))
    figures = {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}
    figures.update(clips=clips, seconds=frames / world.FPS)
    return figures


def write_preview(previews: list[tuple[np.ndarray, ...]], path: Path, rows: int = 4) -> None:
    """Originals (left) beside their decodes (right), one clip a row, as a PNG."""
    from PIL import Image

    grid = np.concatenate([np.concatenate(pair, axis=1) for pair in previews[:rows]], axis=0)
    Image.fromarray(grid).save(path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", required=True, type=Path, help="MiniMax-H3 root holding vae/ and audio_vae/")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--clips", type=int, default=16)
    parser.add_argument("--frames", type=int, default=124, help="video frames per clip, 17k + 5")
    parser.add_argument("--seconds", type=float, default=5.0, help="audio seconds per clip")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--preview", type=Path, help="write originals beside decodes here (PNG)")
    parser.add_argument("--only", choices=("video", "audio"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    figures = {}
    if args.only != "audio":
        video = VideoDecoder(load_video_vae(args.root, args.device), tile_overlap=64)
        figures["video"], previews = video_figures(video, args.clips, args.frames)
        if args.preview:
            write_preview(previews, args.preview)
    if args.only != "video":
        figures["audio"] = audio_figures(AudioDecoder(load_audio_vae(args.root, args.device)), args.clips,
                                         args.seconds)
    text = json.dumps(figures, indent=2)
    if args.json:
        args.json.write_text(text + "\n")
    log.info("figures:\n%s", text)


if __name__ == "__main__":
    main()
