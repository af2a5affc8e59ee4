"""What a training step computes, counted on the CPU: the figures behind the job's caches and packed forwards.

    python -m tools.train.cost [--student-sessions 2] [--json out.json]

Prints, with torch's FLOP counter and a dispatch hook (device-independent counts; random weights at the trained
dims, since what is counted does not depend on the values):
- the video VAE's encode and decode of one 22-frame window, and the encode of one 124-frame base clip;
- the audio VAE's encode of one mono window;
- the matmul FLOPs of the tiny DiT's forward and backward on one 124-frame clip (attention not counted);
- the operations one base step of 8 examples dispatches, packed in one forward and as 8 forwards;
- the operations one student step of `--student-sessions` sessions dispatches (its 32 forwards and the backward;
  the GPU runs train 16);
- the time `teacher_layout` takes to build one teacher step's layout (the served teacher builds the same).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from services.dit.model.network import PRESETS, build_random
from tools.train import session_batch, student, student_weights, vae, world
from tools.train.dit import REQUEST_FRAMES, audio_latents
from tools.train.documents import Example, TeacherExample, document, document_losses, tail_latents, teacher_layout

TEXT_ROWS = 30  # a caption's tokens, about what the world's captions tokenize to


class _Ops(TorchDispatchMode):
    """Counts the operations dispatched while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _gflop(fn) -> float:
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops() / 1e9


def _examples(n: int, frames: int) -> list[Example | TeacherExample]:
    """Half clips, half teacher documents (request 0 and a later one), random latents of the real shapes."""
    gen = torch.Generator().manual_seed(0)
    lat = (frames - 5) // 17 * 5 + 2  # video latents of 17k + 5 frames
    out: list[Example | TeacherExample] = []
    for i in range(n):
        text = torch.randn(TEXT_ROWS, PRESETS["tiny"].text_dim, generator=gen)
        if i % 2 == 0:
            out.append(Example("a clip", text, torch.randn(lat, 24, 12, 20, generator=gen),
                               torch.randn(2, audio_latents(frames), 32, generator=gen)))
        else:
            request = 0 if i % 4 == 1 else 3
            new = 207 if request == 0 else 199
            out.append(TeacherExample("a teacher document", text, request,
                                      torch.randn(2, tail_latents(request) + new, 32, generator=gen)))
    return out


def _step_ops(model, examples, packed: bool) -> int:
    docs = [document(ex, torch.device("cpu"), torch.Generator().manual_seed(i)) for i, ex in enumerate(examples)]
    with _Ops() as ops:
        if packed:
            loss, _ = document_losses(model, docs)
            loss.backward()
        else:
            for d in docs:
                loss, _ = document_losses(model, [d])
                (loss / len(docs)).backward()
    return ops.count


def measure(student_sessions: int = 2) -> dict[str, float]:
    torch.manual_seed(0)
    video_vae, audio_vae = vae.build("video", "trained").eval(), vae.build("audio", "trained").eval()
    window = vae.to_model_space(torch.from_numpy(world.make_clip(3, vae.VIDEO_WINDOW_FRAMES).video)[None])
    clip = vae.to_model_space(torch.from_numpy(world.make_clip(3, REQUEST_FRAMES).video)[None])
    with torch.no_grad():
        latents = vae.encode_video(video_vae, window).mean
    mono = vae.AudioWindows()[0][:1][None]  # [1, 1, N]
    figures = {
        "video_encode_window_gflop": _gflop(lambda: vae.encode_video(video_vae, window)),
        "video_decode_window_gflop": _gflop(lambda: vae.decode_video(video_vae, latents)),
        "video_encode_clip_gflop": _gflop(lambda: vae.encode_video(video_vae, clip)),
        "audio_encode_window_gflop": _gflop(lambda: audio_vae.encode(mono)),
    }
    model = build_random(PRESETS["tiny"], "cpu", torch.float32, 0).requires_grad_(True)
    [one] = _examples(1, REQUEST_FRAMES)
    with FlopCounterMode(display=False) as counter:
        loss, _ = document_losses(model, [document(one, torch.device("cpu"))])
        loss.backward()
    figures["dit_clip_matmul_gflop"] = counter.get_total_flops() / 1e9
    examples = _examples(8, vae.VIDEO_WINDOW_FRAMES)
    figures["base_step_ops_packed"] = _step_ops(model, examples, packed=True)
    figures["base_step_ops_separate"] = _step_ops(model, examples, packed=False)
    gen = torch.Generator().manual_seed(1)
    sessions = [session_batch.Session(tuple(torch.randn(TEXT_ROWS, PRESETS["tiny"].text_dim, generator=gen)
                                            for _ in range(student.REQUESTS)),
                                      torch.randn(72, 24, 12, 20, generator=gen),
                                      torch.randn(2, 405, 32, generator=gen))
                for _ in range(student_sessions)]
    student_weights.student_adapter(model, rank=32, seed=0)
    with _Ops() as ops:
        loss = student.session_loss(model, session_batch.SessionBatch(sessions, torch.device("cpu")),
                                    torch.Generator().manual_seed(0), self_rollout=False)
        loss.total.backward()
    figures["student_step_ops"] = ops.count
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(20):
            teacher_layout(TEXT_ROWS, 3, 0.4)
        best = min(best, (time.perf_counter() - started) / 20)
    figures["teacher_layout_ms"] = best * 1e3
    return figures


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--student-sessions", type=int, default=2, help="sessions of the counted student step")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    figures = measure(args.student_sessions)
    for name, value in figures.items():
        print(f"{name:32s} {value:12.2f}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
