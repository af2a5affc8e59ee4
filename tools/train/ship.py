"""Assemble trained weights into a checkpoint tree the services load, with a manifest, and verify such a tree.

    python -m tools.train.ship --out models/tiny --encoder-root checkpoints/tiny/MiniMax-H3 \
        --vae-root /work/train_ckpt/run2/trained --base out/base --lora out/lora --note "joint run 2, step 350"
    python -m tools.train.ship --verify models/tiny

The tree has the layout `services.checkpoints` writes (MiniMax-H3/{FL2VA/transformer, text_encoder, tokenizer,
vae, audio_vae}, TaoMate-H3/). Every part goes through the product's own loader before the tree is marked complete:
the DiT shards against the `tiny` preset, the adapter against the DiT's targets, both VAEs, and the text encoder
on a caption. `MANIFEST.json` lists every file with its size and SHA-256 and the notes given, so a shipped tree
that lost or changed a byte is named file by file. `COMPLETE` is written last, as `services.checkpoints` does.
The text encoder must be the one the DiT was trained with (docs/training.md).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import shutil
import sys
from pathlib import Path

import torch

from services.dit.model.checkpoint import validate_checkpoint
from services.dit.model.lora import load_adapter
from services.dit.model.network import PRESETS
from services.encoder.model import TextEncoder
from services.vae.checkpoint import load_audio_vae, load_video_vae

log = logging.getLogger("tools.train.ship")

PRESET = "tiny"
MANIFEST = "MANIFEST.json"
COMPLETE = "COMPLETE"
PROBE_CAPTION = "a red circle standing still on a dark blue background, a low hum"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _copy_dir(src: Path, dst: Path, what: str) -> None:
    if not src.is_dir():
        raise FileNotFoundError(f"{what}: {src} is not a directory")
    shutil.copytree(src, dst)


def check_loads(tree: Path) -> None:
    """Load every part of `tree` through the services' loaders; raises the loader's error naming the part."""
    args = PRESETS[PRESET]
    root = tree / "MiniMax-H3"
    validate_checkpoint(root / "FL2VA" / "transformer", args)
    load_adapter(tree / "TaoMate-H3", args)
    load_video_vae(root, "cpu")
    load_audio_vae(root, "cpu")
    hidden = TextEncoder.load(root, PRESET, "cpu", dtype=torch.float32).encode(PROBE_CAPTION)
    if hidden.shape[-1] != args.text_dim:
        raise ValueError(f"the text encoder gives {hidden.shape[-1]}-wide states; the DiT takes {args.text_dim}")


def files_of(tree: Path) -> dict[str, dict]:
    """Every file of `tree` but the manifest and the completion mark: relative path -> size and SHA-256."""
    out = {}
    for path in sorted(p for p in tree.rglob("*") if p.is_file()):
        rel = path.relative_to(tree).as_posix()
        if rel not in (MANIFEST, COMPLETE):
            out[rel] = {"bytes": path.stat().st_size, "sha256": sha256(path)}
    return out


def assemble(out: Path, encoder_root: Path, vae_root: Path, base: Path, lora: Path, notes: list[str]) -> Path:
    """Copy the parts into a fresh tree at `out`, check that each loads, write the manifest, mark it complete."""
    staging = out.with_name(out.name + ".partial")
    if staging.exists():
        shutil.rmtree(staging)
    root = staging / "MiniMax-H3"
    try:
        _copy_dir(encoder_root / "text_encoder", root / "text_encoder", "--encoder-root")
        _copy_dir(encoder_root / "tokenizer", root / "tokenizer", "--encoder-root")
        for part in ("vae", "audio_vae"):
            _copy_dir(vae_root / part, root / part, "--vae-root")
        _copy_dir(base, root / "FL2VA" / "transformer", "--base")
        _copy_dir(lora, staging / "TaoMate-H3", "--lora")
        check_loads(staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)  # never leave a half-made tree behind
        raise
    manifest = {"preset": PRESET, "notes": notes, "files": files_of(staging)}
    (staging / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    (staging / COMPLETE).write_text(f"preset={PRESET} trained\n")
    for path in staging.rglob("*"):  # a tree for every reader (parts made where the umask is 077 come as 0600)
        path.chmod(0o755 if path.is_dir() else 0o644)
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)
    size = sum(f["bytes"] for f in manifest["files"].values())
    log.info("shipped %d files, %.1f MB, to %s", len(manifest["files"]), size / 1e6, out)
    return out


def verify(tree: Path) -> list[str]:
    """What is wrong with a shipped tree against its manifest (empty: nothing)."""
    if not (tree / MANIFEST).is_file():
        return [f"{tree / MANIFEST} is missing"]
    if not (tree / COMPLETE).is_file():
        return [f"{tree / COMPLETE} is missing: the tree was never finished"]
    want = json.loads((tree / MANIFEST).read_text())["files"]
    have = files_of(tree)
    problems = [f"{rel}: missing" for rel in sorted(set(want) - set(have))]
    problems += [f"{rel}: not in the manifest" for rel in sorted(set(have) - set(want))]
    for rel in sorted(set(want) & set(have)):
        if have[rel] != want[rel]:
            problems.append(f"{rel}: {have[rel]['bytes']} bytes, sha256 {have[rel]['sha256'][:12]}…; the manifest "
                            f"says {want[rel]['bytes']} bytes, {want[rel]['sha256'][:12]}…")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verify", type=Path, metavar="TREE", help="check a shipped tree against its manifest")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--encoder-root", type=Path, help="a MiniMax-H3 directory with text_encoder/, tokenizer/")
    parser.add_argument("--vae-root", type=Path, help="a directory with vae/, audio_vae/ (tools.train.vae export)")
    parser.add_argument("--base", type=Path, help="the DiT's FL2VA/transformer directory")
    parser.add_argument("--lora", type=Path, help="the TaoMate adapter directory")
    parser.add_argument("--note", action="append", default=[], help="provenance kept in the manifest (repeatable)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.verify is not None:
        problems = verify(args.verify)
        for p in problems:
            print(p)
        print(f"{args.verify}: {'OK' if not problems else f'{len(problems)} problem(s)'}")
        return 1 if problems else 0
    missing = [f"--{n.replace('_', '-')}" for n in ("out", "encoder_root", "vae_root", "base", "lora")
               if getattr(args, n) is None]
    if missing:
        parser.error(f"assembling needs {', '.join(missing)}")
    assemble(args.out, args.encoder_root, args.vae_root, args.base, args.lora, args.note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
