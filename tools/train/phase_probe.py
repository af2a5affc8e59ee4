"""The student's x0 loss by motion and phase, through its own training forward: which motions and which phases a
shipped tree has not learnt (docs/training.md, "What remains": the bounce).

    python -m tools.train.phase_probe --tree models/tiny [--sessions 2] [--json out.json]

For each of the world's motions, `--sessions` one-prompt sessions (an opening scene of that motion, its shape,
colour and background drawn from seed i) are rendered, encoded by the tree's own VAEs and text encoder, and run
through `student.session_loss` as the trainer runs them, but as served: each step from the student's own Euler
state, each phase committing the student's own output. Prints the mean x0 MSE of each phase (its three steps) for
each motion, and `--json` writes them. On the CPU; about 30 s a session on the 2-core machine.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

import numpy as np
import torch

from services.dit.model.checkpoint import load_dit
from services.dit.model.lora import LoRAAdapter
from services.dit.model.network import PRESETS
from tools.train import world
from tools.train.dit import Conditioner
from tools.train.session_batch import SessionBatch
from tools.train.student import REQUESTS, SESSION_FRAMES, encode_session, render_scenes, session_loss


def motion_sessions(motion: str, count: int) -> list[list[world.Scene]]:
    """`count` sessions of one prompt each: the opening scene of `motion`, the rest of its grammar from seed i."""
    sessions = []
    for i in range(count):
        shape, colour, background, _ = world.sample_grammar(np.random.default_rng(i))
        sessions.append([world.opening_scene(shape, colour, background, motion)] * REQUESTS)
    return sessions


@torch.no_grad()
def probe(tree: pathlib.Path, sessions: int, motions: tuple[str, ...] = tuple(m.name for m in world.MOTIONS)
          ) -> dict[str, list[float]]:
    """{motion: mean x0 MSE of each phase, in session order} for the tree's student, as served."""
    root, cpu = tree / "MiniMax-H3", torch.device("cpu")
    model = load_dit(root / "FL2VA" / "transformer", PRESETS["tiny"], cpu, torch.float32).eval()
    LoRAAdapter.load(model, tree / "TaoMate-H3", torch.float32)
    cond = Conditioner(root, root, cpu, SESSION_FRAMES)
    out = {}
    for motion in motions:
        per_session = []
        for i, scenes in enumerate(motion_sessions(motion, sessions)):
            batch = SessionBatch([encode_session(cond, render_scenes(i, scenes))], cpu)
            loss = session_loss(model, batch, torch.Generator().manual_seed(i), self_rollout=True, self_commit=True)
            per_session.append(loss.phases)
        out[motion] = np.mean(per_session, axis=0).round(4).tolist()
        print(f"{motion:>6}: " + " ".join(f"{v:.3f}" for v in out[motion]), flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", type=pathlib.Path, required=True, help="a checkpoint tree (MiniMax-H3/, TaoMate-H3/)")
    p.add_argument("--sessions", type=int, default=2, help="sessions a motion")
    p.add_argument("--json", type=pathlib.Path)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    figures = probe(args.tree, args.sessions)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
