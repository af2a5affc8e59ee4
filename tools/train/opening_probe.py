"""What a base DiT draws for a session's opening in one step from pure noise: the x0 a student's first step starts from.

    python -m tools.train.opening_probe --base out/base/FL2VA/transformer --vae-root tools/train/resume/vae \
        --encoder-root models/tiny/MiniMax-H3 [--background black] [--json out/probe.json]

For each colour and shape of the probe (three colours by the world's three shapes, still, on one background), the
opening is laid out as the student trainer lays it out, with its caption's text: the first phase of request 0
(`--layout phase`, 39 frames: 12 video latents, 65 audio latents a channel), what a student's first step sees, or
the whole of request 0 (`--layout request`, 124 frames: 37 latents, 207 audio latents), the clip the base trains
on. The video is pure noise (sigma 1), the audio too (the audio teacher's first state). One forward gives the
velocity v and the prediction x0 = noise + v. Figures per opening: the x0 MSE against the clean latents of the true
opening, and the middle frame of its decode through the service's decoder read as a person would
(`sample.shape_mask`, `sample.outline`, the shape's mean colour).

A base that tells the shapes apart draws each opening's outline here before any student trains on it; a blob that
reads the same for every shape says the base's opening prediction is not yet sharp enough (docs/training.md,
"Run D"). Knows nothing of serving beyond the DiT's forward and the VAE's decoder.
"""
from __future__ import annotations

import argparse
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from services.dit.model.checkpoint import load_dit
from services.dit.model.network import PRESETS, DiT
from services.dit.stream.geometry import PhasePlan, plan_request
from services.dit.stream.runtime import unpatchify
from services.dit.stream.schedule import AUDIO_SIGMAS
from services.vae.checkpoint import load_video_vae
from services.vae.model import VideoDecoder
from tools.train import world
from tools.train.dit import Conditioner
from tools.train.sample import nearest_colour, outline, shape_mask
from tools.train.session_batch import Session, SessionBatch, forward
from tools.train.vae import HOP

log = logging.getLogger("tools.train.opening_probe")

COLOURS = ("red", "blue", "yellow")
_REQUEST = plan_request(0)
LAYOUTS = {
    "phase": _REQUEST.phases[0],  # 39 frames = 17k + 5: the VAE encodes the phase's frames whole
    "request": PhasePlan(request_index=0, phase_index=0, frame_start=0, num_frames=_REQUEST.num_frames,
                         latent_offset=0, num_latents=_REQUEST.num_latents, audio_start=0, audio_offset=0,
                         num_audio_latents=_REQUEST.num_audio_latents),  # 124 frames
}

Predict = Callable[[SessionBatch, PhasePlan, torch.Tensor, torch.Tensor], torch.Tensor]
"""(batch, phase, video noise `[1, Tv, 96]`, audio noise `[1, 2A, 32]`) -> predicted clean video rows `[1, Tv, 96]`."""


@dataclass(frozen=True)
class OpeningDraw:
    caption: str
    shape: str
    colour: str
    mse: float
    """x0 MSE against the clean latents (normalised units)."""
    drawn: str
    """`sample.outline` of the decoded middle frame."""
    drawn_colour: str
    cover: float
    """The share of the frame's pixels `sample.shape_mask` counts as the shape's."""


def base_predictor(model: DiT) -> Predict:
    """x0 = noise + v of the base's one forward at sigma 1 (the audio at the audio teacher's first sigma)."""
    @torch.no_grad()
    def predict(batch: SessionBatch, ph: PhasePlan, noise_v: torch.Tensor, noise_a: torch.Tensor) -> torch.Tensor:
        texts = batch.refined_texts(model, ph.request_index)
        v, _ = forward(model, batch, ph, noise_v, noise_a, 1.0, AUDIO_SIGMAS[0], [], commit=False, texts=texts)
        return noise_v + v
    return predict


def opening(cond: Conditioner, scene: world.Scene, plan: PhasePlan) -> Session:
    """The encoded start of `scene`'s session that `plan` spans: its caption, its video and audio latents."""
    frames = torch.from_numpy(world.render_video(scene, 0, plan.num_frames))
    wave = torch.from_numpy(world.render_audio(scene, 0, plan.num_audio_latents * HOP))
    return Session((cond.encode_caption(scene.caption),), cond.encode_frames(frames), cond.encode_wave(wave))


def probe(predict: Predict, cond: Conditioner, decoder: VideoDecoder, background: str = "black",
          seed: int = 1, colours: tuple[str, ...] = COLOURS, plan: PhasePlan = LAYOUTS["phase"]
          ) -> list[OpeningDraw]:
    """The opening of each of `colours` by each shape through `predict`, each from the same noise (`seed`)."""
    draws = []
    for colour in colours:
        for shape in world.SHAPES:
            scene = world.opening_scene(shape, colour, background, "still")
            session = opening(cond, scene, plan)
            batch = SessionBatch([session], cond.device)
            clean_v, clean_a = batch.clean(plan)  # [1, Tv, 96], [1, 2A, 32]
            gen = torch.Generator().manual_seed(seed)
            noise_v = torch.randn(clean_v.shape, generator=gen).to(cond.device)
            noise_a = torch.randn(clean_a.shape, generator=gen).to(cond.device)
            x0 = predict(batch, plan, noise_v, noise_a)
            _, _, lh, lw = session.video.shape
            latents = unpatchify(x0[0].float().cpu(), plan.num_latents, lh, lw)  # [L, C, h, w]
            frames = np.asarray(decoder.decode(latents))  # [F, H, W, 3] uint8
            frame = frames[len(frames) // 2]
            mask, _ = shape_mask(frame)
            drawn_colour = nearest_colour(tuple(int(c) for c in frame[mask].mean(0)))[0] if mask.any() else "none"
            draws.append(OpeningDraw(scene.caption, shape, colour, float(((x0 - clean_v) ** 2).mean()),
                                     outline(mask), drawn_colour, float(mask.mean())))
    return draws


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, type=Path, help="the base DiT's FL2VA/transformer directory")
    parser.add_argument("--vae-root", required=True, type=Path, help="MiniMax-H3 root with the trained vae/, audio_vae/")
    parser.add_argument("--encoder-root", required=True, type=Path, help="MiniMax-H3 root with text_encoder/, tokenizer/")
    parser.add_argument("--background", default="black", choices=sorted(world.BACKGROUNDS))
    parser.add_argument("--layout", default="phase", choices=sorted(LAYOUTS))
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    device = torch.device("cpu")
    model = load_dit(args.base, PRESETS["tiny"], device, torch.float32).eval()
    plan = LAYOUTS[args.layout]
    cond = Conditioner(args.vae_root, args.encoder_root, device, plan.num_frames)
    decoder = VideoDecoder(load_video_vae(args.vae_root, device), tile_overlap=64)
    draws = probe(base_predictor(model), cond, decoder, args.background, args.seed, plan=plan)
    print(f"{'opening':<10} {'shape':<9} {'x0 mse':>7}  drawn     colour   cover")
    for d in draws:
        print(f"{d.colour:<10} {d.shape:<9} {d.mse:7.3f}  {d.drawn:<9} {d.drawn_colour:<8} {d.cover:.3f}")
    right = sum(d.drawn == d.shape for d in draws)
    print(f"outline right: {right} of {len(draws)}; colour right: "
          f"{sum(d.drawn_colour == d.colour for d in draws)} of {len(draws)}")
    if args.json:
        args.json.write_text(json.dumps([asdict(d) for d in draws], indent=2) + "\n")


if __name__ == "__main__":
    main()
