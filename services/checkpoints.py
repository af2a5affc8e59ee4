"""Write a random-weight checkpoint tree of a preset in the real on-disk layouts:
`python -m services.checkpoints --preset tiny --out checkpoints/tiny`.

Tree (what the services load):
  <out>/MiniMax-H3/FL2VA/transformer/   original DiT layout: 13 shards + index, grouped QKV, config.json
  <out>/MiniMax-H3/text_encoder/        Qwen3-VL shards + index (+ <out>/MiniMax-H3/tokenizer/ for tiny)
  <out>/MiniMax-H3/vae/, audio_vae/     diffusers video and audio VAEs
  <out>/TaoMate-H3/                     the native TaoMate LoRA adapter directory
  <out>/COMPLETE                        written last, so a half-written tree is never used
"""
from __future__ import annotations

import argparse
import logging
import pathlib
import shutil

from services.dit.model.checkpoint import write_random_checkpoint as write_dit
from services.dit.model.lora import write_random_adapter
from services.dit.model.network import PRESETS
from services.encoder.checkpoint import write_random_checkpoint as write_encoder
from services.vae.checkpoint import write_random_checkpoint as write_vaes

log = logging.getLogger("services.checkpoints")


def write_tree(preset: str, out: pathlib.Path, seed: int = 0) -> pathlib.Path:
    """Write every component of `preset` under `out` and mark the tree complete."""
    if preset not in PRESETS:
        raise ValueError(f"preset={preset!r}: use one of {sorted(PRESETS)}")
    if out.exists():
        shutil.rmtree(out)
    root = out / "MiniMax-H3"
    args = PRESETS[preset]
    write_dit(args, root / "FL2VA" / "transformer", layout="original", seed=seed)
    write_encoder(preset, root, seed=seed)
    write_vaes(preset, root, seed=seed)
    write_random_adapter(args, out / "TaoMate-H3", seed=seed)
    (out / "COMPLETE").write_text(f"preset={preset} seed={seed}\n")
    log.info("wrote the %s checkpoint tree to %s", preset, out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", required=True, choices=sorted(PRESETS))
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    write_tree(args.preset, pathlib.Path(args.out), args.seed)


if __name__ == "__main__":
    main()
