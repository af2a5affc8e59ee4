"""Where the audio teacher puts a still shape's sound, request after request: its one-step lean and its walk.

    python -m tools.train.teacher_probe --tree models/tiny [--places 80 160 240] [--seeds 0 1000 ...] [--requests 4]
        [--colour red] [--seconds 1] [--json out/teacher.json]

A served session's sound is the audio teacher's alone (`services.dit.stream.teacher`: the tree's base DiT with no
LoRA, from the caption and the previous request's last second of its own audio). A still shape's sound should keep
the balance it opened with. This probe runs that teacher on the CPU, outside the services, for a still circle at
each `--places` x (px; the world's constant-power pan puts 160 at 0 dB), over requests 1 .. `--requests`, two ways
(at the centre, where a session opens, from request 0, the opening, which has no tail):

- **world tail**: each request continues from the world's own last second before it (the tail the base trains on).
  The new audio's balance less the world's is the teacher's **one-step lean**: what one request adds to a true tail.
- **own tail**: request 1 continues from the world's tail, each later one from the teacher's previous request, as a
  served stream does. The balance less the world's, request by request, is the **walk**.

Each request's balance is right-minus-left energy in dB of its decoded audio (`sample.sound_of`), per second
(`--seconds`) and whole. A lean that is there from true tails is the model's own; a walk that grows only from its
own tails is its exposure to its errors. The noise is a served session's at that seed, the same in both ways
(`runtime.request_noise`: request k's audio from generator seed + k, as the official sampler draws it), so the
own-tail rows at the centre are the sound a session of the caption at that seed plays. Consecutive seeds share
draws, shifted by one request: seeds for a spread must lie at least `--requests` + 1 apart (the defaults are 1,000
apart). Knows nothing of serving beyond the DiT's forward, the teacher's steps, the request noise and the VAEs.
"""
from __future__ import annotations

import argparse
import json
import logging
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from services.dit.model.checkpoint import load_dit
from services.dit.model.network import PRESETS
from services.dit.stream.geometry import TEACHER_TAIL_LATENTS, plan_request
from services.dit.stream.runtime import request_noise
from services.dit.stream.session import CancelToken
from services.dit.stream.teacher import AudioTeacher
from services.dit.stream.timeline import Timeline
from services.vae.model import AudioDecoder
from tools.train import world
from tools.train.dit import Conditioner, render_teacher
from tools.train.documents import WORLD_CANVAS
from tools.train.sample import sound_of

log = logging.getLogger("tools.train.teacher_probe")


@dataclass(frozen=True)
class RequestBalance:
    """One request's sound against the world's, in dB of right-minus-left energy."""

    place: float
    seed: int
    request: int
    way: str
    """"world" (from the world's tail) or "own" (from the teacher's previous request)."""
    world_db: float
    """The world's balance for the shape at `place` (constant: it stands still)."""
    seconds_db: list[float]
    """The teacher's balance over each second of the request's new audio."""
    whole_db: float

    @property
    def lean_db(self) -> float:
        return self.whole_db - self.world_db


def still_scene(colour: str, place: float) -> world.Scene:
    """A still circle of the opening's size at x = `place` on black, its sound a hum."""
    return replace(world.opening_scene("circle", colour, "black", "still"), x0=place)


class Probe:
    """The tree's base as the served teacher, its text encoder and audio VAE, on the CPU."""

    def __init__(self, tree: Path, vae_root: Path | None = None) -> None:
        cpu = torch.device("cpu")
        base = tree / "MiniMax-H3"
        model = load_dit(base / "FL2VA" / "transformer", PRESETS["tiny"], cpu, torch.float32).eval()
        self.teacher = AudioTeacher(model, None)
        self.conditioner = Conditioner(vae_root or base, base, cpu)
        self.decoder = AudioDecoder(self.conditioner.audio_vae)
        self.timeline = Timeline(WORLD_CANVAS, 0.0)

    def world_latents(self, scene: world.Scene, request: int) -> tuple[torch.Tensor, float]:
        """The world's `[2, n_tail + A, 32]` latents of request `request`'s teacher document (no tail at request 0),
        and its balance."""
        clip = render_teacher(0, scene, 0, request)
        _, balance = sound_of(clip.wave.numpy(), world.SAMPLE_RATE)
        return self.conditioner.encode_wave(clip.wave), balance

    def request(self, text: torch.Tensor, request: int, tail: torch.Tensor | None, seed: int) -> torch.Tensor:
        """The teacher's clean `[2, A, 32]` latents of request `request` for the encoded caption `text`, after
        `tail` `[2, 40, 32]` (None: request 0), from the noise of a served session at `seed` (`noise`: `[2, A, 32]`)."""
        plan = plan_request(request)
        model = self.teacher.model
        _, noise = request_noise(seed, plan, WORLD_CANVAS, model.args.video_channels, model.args.audio_channels)
        return self.teacher.run(text, plan, self.timeline, noise, tail, CancelToken())[-1]

    def balances(self, latents: torch.Tensor, seconds: float) -> tuple[list[float], float]:
        """Per `seconds` and whole-request balance (dB) of `[2, A, 32]` latents, decoded."""
        wave = self.decoder.decode(latents).numpy()  # [2, A * 800]
        step = int(seconds * world.SAMPLE_RATE)
        parts = [sound_of(wave[:, i:i + step], world.SAMPLE_RATE)[1] for i in range(0, wave.shape[1] - step + 1, step)]
        return parts, sound_of(wave, world.SAMPLE_RATE)[1]


def probe(p: Probe, colour: str, places: list[float], seeds: list[int], requests: int,
          seconds: float) -> list[RequestBalance]:
    rows: list[RequestBalance] = []
    for place in places:
        scene = still_scene(colour, place)
        text = p.conditioner.encode_caption(scene.caption)
        # the world's latents of each request, the same at every seed: [2, n_tail + A, 32] and the balance
        worlds = {k: p.world_latents(scene, k) for k in range(0 if place == world.WIDTH / 2 else 1, requests + 1)}
        for seed in seeds:
            own: torch.Tensor | None = None
            for k, (latents, world_db) in worlds.items():
                true_tail = latents[:, :TEACHER_TAIL_LATENTS]
                tails = {"own": None} if k == 0 else {"world": true_tail, "own": true_tail if own is None else own}
                for way, tail in tails.items():
                    new = p.request(text, k, tail, seed)  # [2, A, 32]
                    parts, whole = p.balances(new, seconds)
                    rows.append(RequestBalance(place, seed, k, way, world_db, parts, whole))
                    log.info("x %.0f seed %d request %d %s tail: %+.2f dB (world %+.2f)", place, seed, k, way,
                             whole, world_db)
                    if way == "own":
                        own = new[:, -TEACHER_TAIL_LATENTS:].clone()
    return rows


def summary(rows: list[RequestBalance], over_db: float = 6.0) -> list[str]:
    """Per place: the one-step lean (world tails, over seeds and requests) and the walk by request (own tails; from
    request 0 at the centre), each as mean +- standard deviation over what it gathers, in dB from the world's; then
    the mean of each seed's worst second and how many seeds pass `over_db`."""
    def spread(values: list[float]) -> str:
        return f"{np.mean(values):+.2f} +- {np.std(values, ddof=1) if len(values) > 1 else 0.0:.2f}"

    lines = []
    for place in sorted({r.place for r in rows}):
        here = [r for r in rows if r.place == place]
        lean = [r.lean_db for r in here if r.way == "world"]
        walk = [spread([r.lean_db for r in here if r.way == "own" and r.request == k])
                for k in sorted({r.request for r in here})]
        worst = walk_of(worst_seconds(rows, place), over_db)
        lines.append(f"x {place:.0f} (world {here[0].world_db:+.1f} dB): one-step lean {spread(lean)} dB; "
                     f"own-tail walk from request {min(r.request for r in here)}: " + ", ".join(walk)
                     + f"; worst second of a session off the world's: mean {worst['worst_mean']:.2f} dB, over "
                     f"{over_db:g} dB in {worst['over']} of {worst['seeds']} seeds")
    return lines


def walk_of(worst: list[float], over_db: float) -> dict:
    """The walk from each seed's worst second (dB): their mean, how many pass `over_db`, and how many seeds."""
    return dict(worst_mean=float(np.mean(worst)), over=sum(w > over_db for w in worst), seeds=len(worst))


def worst_seconds(rows: list[RequestBalance], place: float) -> list[float]:
    """Each seed's worst second (dB off the world's balance) over the session at `place` as served (own tails)."""
    own = [r for r in rows if r.place == place and r.way == "own"]
    return [max(abs(v - r.world_db) for r in own if r.seed == seed for v in r.seconds_db)
            for seed in sorted({r.seed for r in own})]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", type=Path, required=True, help="a checkpoint tree (MiniMax-H3/ with FL2VA/, VAEs, text)")
    ap.add_argument("--vae-root", type=Path, help="the audio VAE's root, when not the tree's MiniMax-H3/")
    ap.add_argument("--places", type=float, nargs="+", default=[80.0, 160.0, 240.0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1_000 * i for i in range(8)])
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--colour", default="red", choices=sorted(world.COLOUR_BY_NAME))
    ap.add_argument("--seconds", type=float, default=1.0, help="span of each partial balance")
    ap.add_argument("--over", type=float, default=6.0,
                    help="count the seeds whose worst second strays further (dB; the meaning test holds seed 0 to 6)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.requests < 1:
        ap.error(f"--requests {args.requests}: at least 1 (request 0 has no tail)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    rows = probe(Probe(args.tree, args.vae_root), args.colour, args.places, args.seeds, args.requests, args.seconds)
    for line in summary(rows, args.over):
        print(line)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) | {"lean_db": r.lean_db} for r in rows], indent=1))


if __name__ == "__main__":
    main()
