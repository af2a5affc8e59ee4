"""Streaming geometry of a TaoMate-H3 session: requests, phases, frame/latent/audio counts and canvases.

A request is 5 s of 24 fps video with 32 kHz stereo audio: request 0 has 124 pixel frames (37 latents, a 5-frame
2-latent prefix plus seven 17-frame clips), later requests 119 frames (35 latents). Each request runs as 4 causal
phases of (2, 2, 2, 1) clips. Audio latents run at 40 Hz on the global pixel-frame grid: the audio boundary of
pixel frame f is round_half_even(f * 40 / 24), so phase audio counts follow from the frame boundaries.

Pure arithmetic: knows nothing about tensors, the model, the KV cache or RoPE.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from services.common.media import AUDIO_SAMPLE_RATE, FIRST_REQUEST_FRAMES, LATER_REQUEST_FRAMES, VIDEO_FPS
from services.dit.api import InvalidCanvas

AUDIO_LATENT_RATE = 40
"""Audio latents per second per channel (32 kHz / 800)."""
SAMPLES_PER_AUDIO_LATENT = AUDIO_SAMPLE_RATE // AUDIO_LATENT_RATE
FRAMES_PER_CLIP = 17
LATENTS_PER_CLIP = 5
PREFIX_FRAMES = 5
PREFIX_LATENTS = 2
PHASE_CLIPS = (2, 2, 2, 1)
CLIPS_PER_REQUEST = sum(PHASE_CLIPS)
VAE_SPATIAL = 16
"""Pixels per video latent along h and w."""
PATCH = 2
"""DiT patch (1, 2, 2): one video row covers 2x2 latents, i.e. 32x32 pixels."""
SIDE_MULTIPLE = VAE_SPATIAL * PATCH
TEACHER_TAIL_LATENTS = 40
"""1 s of clean teacher audio per channel carried into the next request's teacher document."""


def audio_boundary(frame: int) -> int:
    """Audio latent index (per channel) at global pixel frame boundary `frame`, rounded half to even."""
    return round(Fraction(frame * AUDIO_LATENT_RATE, VIDEO_FPS))


def request_frame_start(request_index: int) -> int:
    """Global pixel frame where request `request_index` starts."""
    if request_index < 0:
        raise ValueError(f"request_index={request_index} must be >= 0")
    if request_index == 0:
        return 0
    return FIRST_REQUEST_FRAMES + (request_index - 1) * LATER_REQUEST_FRAMES


def request_latent_start(request_index: int) -> int:
    """Index within the session of request `request_index`'s first video latent (0, 37, 72, ...)."""
    if request_index < 0:
        raise ValueError(f"request_index={request_index} must be >= 0")
    if request_index == 0:
        return 0
    first = PREFIX_LATENTS + CLIPS_PER_REQUEST * LATENTS_PER_CLIP
    return first + (request_index - 1) * CLIPS_PER_REQUEST * LATENTS_PER_CLIP


@dataclass(frozen=True)
class PhasePlan:
    """One causal phase of a request."""

    request_index: int
    phase_index: int
    frame_start: int
    """Global pixel frame of the phase's first frame."""
    num_frames: int
    latent_offset: int
    """Index of the phase's first video latent within its request."""
    num_latents: int
    audio_start: int
    """Global audio latent index (per channel) of the phase's first audio latent."""
    audio_offset: int
    """Index of the phase's first audio latent within its request."""
    num_audio_latents: int

    @property
    def num_audio_samples(self) -> int:
        """Audio samples per channel the phase's latents decode to."""
        return self.num_audio_latents * SAMPLES_PER_AUDIO_LATENT

    def media_rows(self, canvas: Canvas) -> int:
        """Packed media rows of the phase on `canvas`: its video latents' rows and two audio channels' latents."""
        return self.num_latents * canvas.rows_per_frame + 2 * self.num_audio_latents


@dataclass(frozen=True)
class RequestPlan:
    """One 5 s request: its frames, latents, audio latents and its 4 phases."""

    request_index: int
    frame_start: int
    num_frames: int
    num_latents: int
    audio_start: int
    num_audio_latents: int
    phases: tuple[PhasePlan, ...]


def plan_request(request_index: int) -> RequestPlan:
    """Frame, latent and audio counts of request `request_index` and its phases."""
    start = request_frame_start(request_index)
    first = request_index == 0
    phases: list[PhasePlan] = []
    frame, latent = start, 0
    for p, clips in enumerate(PHASE_CLIPS):
        frames = clips * FRAMES_PER_CLIP + (PREFIX_FRAMES if first and p == 0 else 0)
        latents = clips * LATENTS_PER_CLIP + (PREFIX_LATENTS if first and p == 0 else 0)
        a0, a1 = audio_boundary(frame), audio_boundary(frame + frames)
        phases.append(PhasePlan(request_index, p, frame, frames, latent, latents, a0, a0 - audio_boundary(start),
                                a1 - a0))
        frame += frames
        latent += latents
    a_start = audio_boundary(start)
    return RequestPlan(request_index, start, frame - start, latent, a_start, audio_boundary(frame) - a_start,
                       tuple(phases))


def plans_of_every_shape() -> list[RequestPlan]:
    """Request 0 and one period of the later requests: between them, every phase size and audio split a session meets.

    Later requests differ only in where their first frame falls on the audio latent grid, which repeats every
    `(LATER_REQUEST_FRAMES * AUDIO_LATENT_RATE / VIDEO_FPS).denominator` requests (119 * 40 / 24 = 595 / 3: 3).
    """
    period = Fraction(LATER_REQUEST_FRAMES * AUDIO_LATENT_RATE, VIDEO_FPS).denominator
    return [plan_request(k) for k in range(1 + period)]


@dataclass(frozen=True)
class Canvas:
    """A validated pixel canvas and its latent/row grid."""

    width: int
    height: int

    @property
    def latent_height(self) -> int:
        return self.height // VAE_SPATIAL

    @property
    def latent_width(self) -> int:
        return self.width // VAE_SPATIAL

    @property
    def rows_per_frame(self) -> int:
        """DiT video rows per latent frame: (H/32)(W/32)."""
        return (self.height // SIDE_MULTIPLE) * (self.width // SIDE_MULTIPLE)


def check_canvas(width: int, height: int, short_edges: tuple[int, ...]) -> Canvas:
    """Validate a canvas against the allowed short edges; raise InvalidCanvas naming it and the allowed ones."""
    allowed = ", ".join(str(s) for s in short_edges)
    for name, side in (("width", width), ("height", height)):
        if not isinstance(side, int) or isinstance(side, bool) or side <= 0:
            raise InvalidCanvas(f"canvas {width}x{height}: {name} must be a positive int, got {side!r} (allowed: "
                                f"short edge one of {allowed}, sides multiples of {SIDE_MULTIPLE})")
        if side % SIDE_MULTIPLE:
            raise InvalidCanvas(f"canvas {width}x{height}: {name}={side} is not a multiple of {SIDE_MULTIPLE} "
                                f"(allowed: short edge one of {allowed}, sides multiples of {SIDE_MULTIPLE})")
    if min(width, height) not in short_edges:
        raise InvalidCanvas(f"canvas {width}x{height}: short edge {min(width, height)} is not one of the allowed "
                            f"short edges ({allowed})")
    return Canvas(width, height)


def max_phase_media_rows(canvas: Canvas) -> int:
    """Most media rows (2 audio channels + video) any phase of any request can hold."""
    best = 0
    for k in (0, 1, 2, 3):  # request 0 is the largest; later requests cycle 198/199 audio latents
        for ph in plan_request(k).phases:
            best = max(best, ph.media_rows(canvas))
    return best


def max_later_phase_media_rows(canvas: Canvas) -> int:
    """Most media rows of a phase after request 0's first phase (bounds every commit but the sink)."""
    best = 0
    for k in (0, 1, 2, 3):
        for ph in plan_request(k).phases:
            if (k, ph.phase_index) != (0, 0):
                best = max(best, ph.media_rows(canvas))
    return best
