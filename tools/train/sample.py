"""Stream a session from a checkpoint tree through the whole system and measure what it shows and sounds like.

`python -m tools.train.sample --tree models/tiny --prompt "a red circle ..." --update 1:"a blue square ..." \
    --requests 3 --sheet sheet.png --json figures.json`

Brings the four services up on a copy of the tiny CPU profile whose model directory is `--tree` (free ports,
service output to a log file), streams one session through the client library, decodes the fMP4 it received and
prints, for every request and every phase: the colour of the shape (the pixels that differ most from the frame's
background, which is taken as the median colour), where it is, and the loudest frequency of the sound with its
left/right balance. `--update K:PROMPT` sends PROMPT so that it applies from request K. `--sheet` writes a
contact sheet: one row per request, frames across it.

The measuring functions are meant for the meaning tests on the shipped weights as well (docs/training.md).
"""
from __future__ import annotations

import argparse
import asyncio
import io
import json
import pathlib
import sys
import tempfile
from dataclasses import asdict, dataclass

import av
import numpy as np

from services.client import ClientOptions, ClientResult, PromptUpdate, stream
from tools.bench_tiny import FPS, bring_up_logged, media_seconds_of, request_start_s, write_profile
from tools.train import world

ROOT = pathlib.Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Span:
    """Frames [start, stop) of the stream, and the request and phase of the chunks that delivered them."""

    request: int
    phase: int
    start: int
    stop: int


@dataclass(frozen=True)
class Look:
    """What a span of frames and its sound show."""

    request: int
    phase: int
    colour: tuple[int, int, int]
    """Median RGB of the shape's pixels (0-255)."""
    background: tuple[int, int, int]
    centroid: tuple[float, float]
    """(x, y) of the shape's pixels, in pixels, mean over the span's frames."""
    coverage: float
    """Fraction of the frame the shape covers."""
    shape: str
    """The outline most of the span's frames show (`outline`)."""
    pitch_hz: float
    """Loudest frequency of the span's sound (both channels summed)."""
    balance_db: float
    """Right minus left channel energy, in dB."""


@dataclass
class Stream:
    frames: np.ndarray
    """(T, H, W, 3) uint8."""
    audio: np.ndarray
    """(2, S) float32 in [-1, 1]."""
    sample_rate: int
    spans: list[Span]
    result: ClientResult


def decode(data: bytes) -> tuple[np.ndarray, np.ndarray, int]:
    """fMP4 bytes -> (frames (T, H, W, 3) uint8, audio (2, S) float32, sample rate)."""
    with av.open(io.BytesIO(data)) as container:
        frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
    with av.open(io.BytesIO(data)) as container:
        parts, rate = [], 0
        for f in container.decode(audio=0):
            rate = f.sample_rate
            a = f.to_ndarray()  # planar float: (channels, n); packed: (1, n * channels)
            if not f.format.is_planar:
                a = a.reshape(-1, len(f.layout.channels)).T
            parts.append(a.astype(np.float32))
    return frames, np.concatenate(parts, axis=1), rate


def spans_of(result: ClientResult) -> list[Span]:
    """The frames each phase's chunks delivered, in stream order (chunks of one phase merged; the closing trailer,
    the decoder's last frames, joins the phase it follows). A span is what a viewer sees between two chunks, so it
    runs a few frames behind the phase's own frames (the video decoder holds back the last frames of each decode
    until the next one)."""
    spans: list[Span] = []
    at = 0
    for c in result.chunks:
        if c.kind not in ("media", "trailer") or c.num_frames == 0:
            continue
        if spans and (spans[-1].request, spans[-1].phase) == (c.request_index, c.phase_index):
            last = spans.pop()
            spans.append(Span(last.request, last.phase, last.start, at + c.num_frames))
        else:
            spans.append(Span(c.request_index, c.phase_index, at, at + c.num_frames))
        at += c.num_frames
    return spans


def nearest_colour(rgb: tuple[int, int, int]) -> tuple[str, float, float]:
    """(name of the grammar colour nearest to `rgb`, its distance, the distance to the next nearest), RGB 0-255."""
    ranked = sorted((float(np.linalg.norm(np.subtract(rgb, c.rgb))), c.name) for c in world.COLOURS)
    return ranked[0][1], ranked[0][0], ranked[1][0]


def shape_mask(frame: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(mask (H, W) bool of the shape's pixels, background RGB). The background is the frame's median colour; the
    shape is every pixel more than 60 (of 255, largest channel) away from it."""
    background = np.median(frame.reshape(-1, 3), axis=0)
    distance = np.abs(frame.astype(np.float32) - background).max(axis=-1)
    return distance > 60, background


def outline(mask: np.ndarray) -> str:
    """Which of the world's shapes a mask `[H, W]` bool draws, as a person tells them apart: a square is as wide at
    the top and the bottom as at its widest; a triangle is narrow at the top and wide at the bottom; a circle is
    narrower at both. The widths are read at 1/8 and 7/8 of the mask's height, against its widest row, so that the
    16 px staircase a decode draws for an outline reads as the shape it steps around (`circle`, `square`,
    `triangle`; `none` under 20 pixels; `unclear` for anything else, e.g. a shape split by the canvas's edge)."""
    if mask.sum() < 20:
        return "none"
    rows = np.flatnonzero(mask.any(axis=1))
    widths = mask[rows[0]:rows[-1] + 1].sum(axis=1)  # [h] pixels a row
    h, widest = len(widths), widths.max()
    top, bottom = widths[h // 8] / widest, widths[(7 * h) // 8] / widest
    if top > 0.85 and bottom > 0.85:
        return "square"
    if bottom - top > 0.3:
        return "triangle"
    if top < 0.85 and bottom < 0.85 and abs(top - bottom) <= 0.25:
        return "circle"
    return "unclear"


def own_colour(frame: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """The pixels of `mask` within 60 (largest channel) of their median colour: the shape's own, without the stray
    latent cells of other colours a decode may put beside it (a 16 px block of orange at a white square's edge would
    otherwise lengthen its rows or columns and change the outline read)."""
    if mask.sum() < 20:
        return mask
    colour = np.median(frame[mask], axis=0)
    return mask & (np.abs(frame.astype(np.float32) - colour).max(axis=-1) < 60)


def look(frames: np.ndarray, audio: np.ndarray, rate: int, span: Span) -> Look:
    """Measure one span: the frames [start, stop) and the sound over the same media time."""
    colours, backgrounds, xs, ys, cover, shapes = [], [], [], [], [], []
    for frame in frames[span.start:span.stop]:
        mask, background = shape_mask(frame)
        backgrounds.append(background)
        cover.append(mask.mean())
        shapes.append(outline(own_colour(frame, mask)))
        if mask.sum() >= 20:
            colours.append(np.median(frame[mask], axis=0))
            yy, xx = np.nonzero(mask)
            xs.append(xx.mean())
            ys.append(yy.mean())
    colour = tuple(int(v) for v in np.median(colours, axis=0)) if colours else (-1, -1, -1)
    lo, hi = span.start * rate // FPS, span.stop * rate // FPS
    pitch, balance = sound_of(audio[:, lo:hi], rate)
    return Look(span.request, span.phase, colour, tuple(int(v) for v in np.median(backgrounds, axis=0)),
                (float(np.mean(xs)) if xs else -1.0, float(np.mean(ys)) if ys else -1.0), float(np.mean(cover)),
                max(set(shapes), key=shapes.count), pitch, balance)


def sound_of(audio: np.ndarray, rate: int) -> tuple[float, float]:
    """(loudest frequency in Hz between 60 and 2000 Hz, right-minus-left energy in dB) of (2, n) audio."""
    mono = audio.sum(axis=0)
    if mono.size < rate // 10:
        return 0.0, 0.0
    spectrum = np.abs(np.fft.rfft(mono * np.hanning(mono.size)))
    freqs = np.fft.rfftfreq(mono.size, 1.0 / rate)
    band = (freqs >= 60) & (freqs <= 2000)
    pitch = float(freqs[band][np.argmax(spectrum[band])])
    energy = (audio.astype(np.float64) ** 2).sum(axis=1) + 1e-12
    return pitch, float(10 * np.log10(energy[1] / energy[0]))


def sample(tree: pathlib.Path, prompt: str, updates: list[tuple[int, str]], requests: int, seed: int,
           service_log: str, hold_s: float | None = None) -> Stream:
    """Bring the system up on `tree`, stream `requests` requests from `prompt`, each update (k, text) sent so that it
    applies from request k, and decode what came back. `hold_s`: the session holds for a prompt at each request
    boundary for that long (`hold_for_prompt`, `hold_max_seconds`), then goes on with the prompt it has."""
    with tempfile.TemporaryDirectory(prefix="vitascope-sample-") as tmp:
        profile, port = write_profile(ROOT / "configs" / "tiny_cpu.yaml", pathlib.Path(tmp), model_dir=tree)
        supervisor = bring_up_logged(profile, service_log)
        try:
            # An update sent during request k-1 (just after its first chunk arrives) applies from request k.
            sent = tuple(PromptUpdate(at_s=request_start_s(k - 1) + 0.01, prompt=text) for k, text in updates)
            result = asyncio.run(stream(ClientOptions(
                url=f"ws://127.0.0.1:{port}/v1/realtime/video", prompt=prompt,
                seconds=media_seconds_of(requests) - 0.01, updates=sent, seed=seed, width=320, height=192,
                hold=hold_s is not None, hold_max_seconds=hold_s)))
        finally:
            supervisor.stop_all()
    if result.errors:
        raise RuntimeError(f"the session reported errors: {result.errors}")
    frames, audio, rate = decode(bytes(result.data))
    return Stream(frames, audio, rate, spans_of(result), result)


def looks(s: Stream) -> list[Look]:
    """What every span of a stream shows and sounds like, in stream order."""
    return [look(s.frames, s.audio, s.sample_rate, sp) for sp in s.spans]


def contact_sheet(s: Stream, path: pathlib.Path, per_row: int = 6) -> None:
    """One row per request: `per_row` frames spread evenly over it, scaled to half size."""
    from PIL import Image
    rows = []
    for r in sorted({sp.request for sp in s.spans}):
        spans = [sp for sp in s.spans if sp.request == r]
        lo, hi = spans[0].start, spans[-1].stop
        picks = np.linspace(lo, hi - 1, per_row).astype(int)
        rows.append(np.concatenate([s.frames[i, ::2, ::2] for i in picks], axis=1))
    Image.fromarray(np.concatenate(rows, axis=0)).save(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", type=pathlib.Path, required=True, help="a checkpoint tree (MiniMax-H3/, TaoMate-H3/)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--update", action="append", default=[], metavar="K:PROMPT",
                   help="apply PROMPT from request K (repeatable)")
    p.add_argument("--requests", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sheet", type=pathlib.Path)
    p.add_argument("--json", type=pathlib.Path)
    p.add_argument("--service-log", default="/tmp/vitascope-sample.log")
    args = p.parse_args(argv)
    updates = []
    for u in args.update:
        k, _, text = u.partition(":")
        if not k.isdigit() or int(k) < 1 or not text.strip():
            p.error(f"--update {u!r} must look like 1:\"a blue square ...\" (K >= 1)")
        updates.append((int(k), text.strip()))
    s = sample(args.tree, args.prompt, updates, args.requests, args.seed, args.service_log)
    print(f"{len(s.frames)} frames, {s.audio.shape[1] / s.sample_rate:.2f} s of sound at {s.sample_rate} Hz; "
          f"updates applied at chunks {s.result.applied_at}")
    print("req phase  colour          background      centroid (x, y)   cover  shape     pitch Hz  R-L dB")
    for lk in looks(s):
        print(f"{lk.request:3d} {lk.phase:5d}  {str(lk.colour):15s} {str(lk.background):15s} "
              f"({lk.centroid[0]:6.1f}, {lk.centroid[1]:6.1f})  {lk.coverage:5.3f}  {lk.shape:8s}  {lk.pitch_hz:8.1f}  "
              f"{lk.balance_db:6.2f}")
    if args.sheet:
        contact_sheet(s, args.sheet)
    if args.json:
        args.json.write_text(json.dumps([asdict(lk) for lk in looks(s)], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
