"""The synthetic world the tiny model is trained on: one shape on a flat background, with the sound it makes.

Knows nothing about models, tokenizers or training. A `Scene` is a point of a small grammar (shape, colour,
background, motion) plus its continuous nuisance values (size, start position, bounce phase); every pixel and every
audio sample is a closed-form function of the scene and the absolute time, so any window of a scene can be rendered
on its own (`render_video`, `render_audio`), consecutive windows join without a seam, and a seed gives the same
clip on every machine (numpy only, `np.random.default_rng(seed)`).

Grammar (each value is named in the caption):

- shapes: circle, square, triangle (pointing up); size 40-56 px half-extent, not captioned (large
  against the 16 px latent grid, so that each shape keeps its outline through the VAE: see `SIZE_RANGE`);
- colours, each with the pitch of its tone and the word the caption uses for it: purple 160 Hz "deep",
  red 240 Hz "low", green 320 Hz "soft", blue 440 Hz "clear", yellow 640 Hz "high", white 880 Hz "bright".
  Every pitch is a multiple of 40 Hz, the audio VAE's latent rate: a tone then starts each 800-sample latent at the
  same phase, so a steady tone has the same latent at every step (the first GPU run, with pitches off that grid,
  left the audio decoder emitting one latent-rate buzz for every input);
- backgrounds: black, dark blue, dark green, grey, brown (flat colour);
- motions, each with its rhythm: moving left / moving right (64 px/s, one lap of the 320 px canvas per 5 s,
  wrapping around the edge; a "beat" of 2 pulses a second), moving up / moving down (38.4 px/s, one lap of the
  192 px canvas per 5 s; a "flutter", a 6 Hz tremolo), bouncing (on a floor, one bounce a second; a "thump" at
  every landing), standing still (a steady "hum").

Sound: the colour's tone (its fundamental plus a quarter-strength second harmonic), shaped by the motion's rhythm,
panned by the shape's x position (constant-power: hard left at x = 0, hard right at x = 320; while a wrapping shape
straddles the edge each visible part pulls the balance its way, so the balance never jumps).

Caption: "a {colour} {shape} {motion} on a {background} background, a {pitch word} {rhythm}", e.g.
"a red circle moving left on a dark blue background, a low beat".

Canvas: 320x192 at 24 fps (the tiny preset's default canvas), audio 32 kHz stereo.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

WIDTH, HEIGHT = 320, 192
FPS = 24
SAMPLE_RATE = 32000


@dataclass(frozen=True)
class Colour:
    """A shape colour of the grammar and the tone it sounds."""

    name: str
    rgb: tuple[int, int, int]
    pitch_hz: float
    """Fundamental of the tone."""
    pitch_word: str
    """How the caption names the tone."""


@dataclass(frozen=True)
class Motion:
    """A motion of the grammar and the rhythm that goes with it."""

    name: str
    phrase: str
    """How the caption says it ("moving left")."""
    rhythm: str
    """How the caption names the rhythm ("beat")."""


SHAPES = ("circle", "square", "triangle")
COLOURS = (
    Colour("purple", (150, 70, 210), 160.0, "deep"),
    Colour("red", (220, 40, 40), 240.0, "low"),
    Colour("green", (50, 190, 70), 320.0, "soft"),
    Colour("blue", (60, 110, 240), 440.0, "clear"),
    Colour("yellow", (240, 210, 50), 640.0, "high"),
    Colour("white", (235, 235, 235), 880.0, "bright"),
)
BACKGROUNDS: dict[str, tuple[int, int, int]] = {
    "black": (10, 10, 12),
    "dark blue": (18, 28, 88),
    "dark green": (18, 64, 32),
    "grey": (105, 105, 110),
    "brown": (88, 58, 32),
}
MOTIONS = (
    Motion("left", "moving left", "beat"),
    Motion("right", "moving right", "beat"),
    Motion("up", "moving up", "flutter"),
    Motion("down", "moving down", "flutter"),
    Motion("bounce", "bouncing", "thump"),
    Motion("still", "standing still", "hum"),
)
COLOUR_BY_NAME = {c.name: c for c in COLOURS}
MOTION_BY_NAME = {m.name: m for m in MOTIONS}

HORIZONTAL_SPEED = WIDTH / 5.0  # px/s: one lap per 5 s request
VERTICAL_SPEED = HEIGHT / 5.0
BOUNCE_PERIOD = 1.0  # s between landings
BEAT_HZ, FLUTTER_HZ = 2.0, 6.0
THUMP_DECAY, THUMP_ATTACK = 0.12, 0.008  # s
AMPLITUDE = 0.4  # peak of the tone before panning; the audio VAE's decoder clamps at 1
SIZE_RANGE = (40.0, 56.0)
"""Half-extent in px. At the 26-40 px of run C's world the trained VAE gave a circle back as a square (IoU 0.84
against the square, 0.83 against the circle itself): their difference lies inside the corner cells of the 16 px
latent grid. From about 48 px the corners are cells of their own, and the decode tells the shapes apart
(docs/training.md, "Shapes")."""
_MARGIN = 6.0  # px kept between a non-wrapping shape and the canvas edge
# How far each shape reaches from its centre, per unit of size: (left/right, above, below).
_REACH = {"circle": (1.0, 1.0, 1.0), "square": (1.0, 1.0, 1.0), "triangle": (1.25 * math.sqrt(3) / 2, 1.25, 0.625)}


@dataclass(frozen=True)
class Scene:
    """One point of the grammar plus its nuisance values; renders at any time t >= 0 (seconds)."""

    shape: str
    colour: str
    background: str
    motion: str
    size: float
    """Half-extent in px: the circle's radius; the square's half-side equals it, the triangle's circumradius 1.25x."""
    x0: float
    """Centre at t = 0 (px from the left edge; for a bounce, its x throughout)."""
    y0: float
    """Centre at t = 0 (px from the top); unused for a bounce, which starts at its `phase`."""
    phase: float = 0.0
    """Bounce only: seconds since the last landing at t = 0, in [0, BOUNCE_PERIOD)."""

    def __post_init__(self) -> None:
        if self.shape not in SHAPES:
            raise ValueError(f"shape={self.shape!r}: use one of {SHAPES}")
        if self.colour not in COLOUR_BY_NAME:
            raise ValueError(f"colour={self.colour!r}: use one of {sorted(COLOUR_BY_NAME)}")
        if self.background not in BACKGROUNDS:
            raise ValueError(f"background={self.background!r}: use one of {sorted(BACKGROUNDS)}")
        if self.motion not in MOTION_BY_NAME:
            raise ValueError(f"motion={self.motion!r}: use one of {sorted(MOTION_BY_NAME)}")
        side, above, below = self.reach
        if not (self.size > 0 and 2 * side < WIDTH / 2 and above + below + 2 * _MARGIN < HEIGHT):
            raise ValueError(f"size={self.size}: a {self.shape} must be narrower than half the canvas (so that the "
                             f"copies of a wrapping shape never overlap) and leave room to bounce; the world draws "
                             f"sizes in {SIZE_RANGE}")

    @property
    def caption(self) -> str:
        colour, motion = COLOUR_BY_NAME[self.colour], MOTION_BY_NAME[self.motion]
        return (f"a {self.colour} {self.shape} {motion.phrase} on a {self.background} background, "
                f"a {colour.pitch_word} {motion.rhythm}")

    @property
    def reach(self) -> tuple[float, float, float]:
        """How far the shape reaches from its centre (px): sideways, above, below."""
        side, above, below = _REACH[self.shape]
        return side * self.size, above * self.size, below * self.size

    @property
    def floor(self) -> float:
        """Bounce only: the centre's y when the shape touches the floor."""
        return HEIGHT - _MARGIN - self.reach[2]

    @property
    def bounce_height(self) -> float:
        """Bounce only: how far above the floor the centre rises (px)."""
        return min(100.0, self.floor - self.reach[1] - _MARGIN)

    def centre(self, t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Centre `(x, y)` in px at times `t` (seconds), x in [0, WIDTH) and y in [0, HEIGHT) where it wraps."""
        t = np.asarray(t, dtype=np.float64)
        x, y = np.full_like(t, self.x0), np.full_like(t, self.y0)
        if self.motion == "left":
            x = np.mod(self.x0 - HORIZONTAL_SPEED * t, WIDTH)
        elif self.motion == "right":
            x = np.mod(self.x0 + HORIZONTAL_SPEED * t, WIDTH)
        elif self.motion == "up":
            y = np.mod(self.y0 - VERTICAL_SPEED * t, HEIGHT)
        elif self.motion == "down":
            y = np.mod(self.y0 + VERTICAL_SPEED * t, HEIGHT)
        elif self.motion == "bounce":
            y = self.floor - self.bounce_height * np.abs(np.sin(math.pi * (t + self.phase) / BOUNCE_PERIOD))
        return x, y

    def envelope(self, t: np.ndarray) -> np.ndarray:
        """The rhythm: the tone's amplitude in [0, 1] at times `t`."""
        t = np.asarray(t, dtype=np.float64)
        if self.motion in ("left", "right"):
            return 0.15 + 0.85 * (0.5 + 0.5 * np.cos(2 * math.pi * BEAT_HZ * t)) ** 4
        if self.motion in ("up", "down"):
            return 0.55 + 0.45 * np.cos(2 * math.pi * FLUTTER_HZ * t)
        if self.motion == "bounce":
            since = np.mod(t + self.phase, BOUNCE_PERIOD)  # seconds since the last landing
            return 0.15 + 0.85 * (1.0 - np.exp(-since / THUMP_ATTACK)) * np.exp(-since / THUMP_DECAY)
        return np.ones_like(t)


def sample_scene(rng: np.random.Generator) -> Scene:
    """Draw a scene: every grammar value equally likely, nuisance values uniform where the shape fits."""
    shape = SHAPES[rng.integers(len(SHAPES))]
    colour = COLOURS[rng.integers(len(COLOURS))].name
    background = list(BACKGROUNDS)[rng.integers(len(BACKGROUNDS))]
    motion = MOTIONS[rng.integers(len(MOTIONS))].name
    size = float(rng.uniform(*SIZE_RANGE))
    half, top, bottom = Scene(shape, colour, background, motion, size, 0.0, 0.0).reach
    x_inside = float(rng.uniform(half + _MARGIN, WIDTH - half - _MARGIN))
    y_inside = float(rng.uniform(top + _MARGIN, HEIGHT - bottom - _MARGIN))
    x0 = float(rng.uniform(0, WIDTH)) if motion in ("left", "right") else x_inside
    y0 = float(rng.uniform(0, HEIGHT)) if motion in ("up", "down") else y_inside
    phase = float(rng.uniform(0, BOUNCE_PERIOD)) if motion == "bounce" else 0.0
    return Scene(shape, colour, background, motion, size, x0, y0, phase)


def scene_from_seed(seed: int) -> Scene:
    """The scene of `seed` (the same on every machine)."""
    return sample_scene(np.random.default_rng(seed))


# Pixel centres, shared by every render.
_XS = np.arange(WIDTH, dtype=np.float32) + 0.5
_YS = np.arange(HEIGHT, dtype=np.float32) + 0.5


def _signed_distance(scene: Scene, dx: np.ndarray, dy: np.ndarray) -> np.ndarray:
    """Distance (px) outside the shape's edge, negative inside; dx: [1, w], dy: [h, 1] from its centre."""
    if scene.shape == "circle":
        return np.sqrt(dx * dx + dy * dy) - scene.size
    if scene.shape == "square":
        return np.maximum(np.abs(dx), np.abs(dy)) - _REACH["square"][0] * scene.size
    inradius = 0.625 * scene.size  # half the 1.25x circumradius; the triangle points up (image y grows downwards)
    c, s = math.sqrt(3) / 2, 0.5
    return np.maximum(np.maximum(dy, c * dx - s * dy), -c * dx - s * dy) - inradius


def _paint(frame: np.ndarray, scene: Scene, x: float, y: float, bg: np.ndarray, rgb: np.ndarray) -> None:
    """Draw one copy of the shape centred at (x, y) into `frame` [H, W, 3] uint8 (background there), anti-aliased
    over 1 px; copies of a shape never overlap (it is narrower than half the canvas)."""
    side, above, below = scene.reach
    x_lo, x_hi = max(int(math.floor(x - side - 1)), 0), min(int(math.ceil(x + side + 1)), WIDTH)
    y_lo, y_hi = max(int(math.floor(y - above - 1)), 0), min(int(math.ceil(y + below + 1)), HEIGHT)
    if x_lo >= x_hi or y_lo >= y_hi:
        return
    dx = (_XS[x_lo:x_hi] - x)[None, :]
    dy = (_YS[y_lo:y_hi] - y)[:, None]
    cover = np.clip(0.5 - _signed_distance(scene, dx, dy), 0.0, 1.0)[..., None]  # [h, w, 1]
    frame[y_lo:y_hi, x_lo:x_hi] = np.rint(bg + cover * (rgb - bg))


def _copies(scene: Scene, x: float, y: float) -> list[tuple[float, float]]:
    """The centres to draw: a wrapping shape near an edge also shows on the opposite side."""
    xs = (x - WIDTH, x, x + WIDTH) if scene.motion in ("left", "right") else (x,)
    ys = (y - HEIGHT, y, y + HEIGHT) if scene.motion in ("up", "down") else (y,)
    return [(cx, cy) for cx in xs for cy in ys]


def render_video(scene: Scene, start_frame: int, num_frames: int) -> np.ndarray:
    """Frames `start_frame .. start_frame + num_frames - 1` of `scene` as uint8 `[F, H, W, 3]`."""
    if start_frame < 0 or num_frames < 1:
        raise ValueError(f"start_frame={start_frame}, num_frames={num_frames}: need start >= 0 and at least 1 frame")
    t = (start_frame + np.arange(num_frames)) / FPS
    xs, ys = scene.centre(t)
    bg = np.asarray(BACKGROUNDS[scene.background], dtype=np.float32)
    rgb = np.asarray(COLOUR_BY_NAME[scene.colour].rgb, dtype=np.float32)
    video = np.empty((num_frames, HEIGHT, WIDTH, 3), dtype=np.uint8)
    video[...] = np.asarray(BACKGROUNDS[scene.background], dtype=np.uint8)
    for frame, x, y in zip(video, xs, ys):
        for cx, cy in _copies(scene, float(x), float(y)):
            _paint(frame, scene, cx, cy, bg, rgb)
    return video


def _balance(scene: Scene, t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Left and right gains at times `t` (constant power), each visible part of the shape pulling its way."""
    x, _ = scene.centre(t)
    half = scene.reach[0]
    left, right = np.zeros_like(x), np.zeros_like(x)
    offsets = (-WIDTH, 0, WIDTH) if scene.motion in ("left", "right") else (0,)
    for offset in offsets:
        cx = x + offset
        visible = np.clip((np.minimum(cx + half, WIDTH) - np.maximum(cx - half, 0)) / (2 * half), 0.0, 1.0)
        angle = np.clip(cx / WIDTH, 0.0, 1.0) * (math.pi / 2)
        left += visible * np.cos(angle)
        right += visible * np.sin(angle)
    return left, right


def render_audio(scene: Scene, start_sample: int, num_samples: int) -> np.ndarray:
    """Samples `start_sample .. start_sample + num_samples - 1` of `scene`'s sound as float32 `[2, N]` (L, R)."""
    if start_sample < 0 or num_samples < 1:
        raise ValueError(f"start_sample={start_sample}, num_samples={num_samples}: need start >= 0 and >= 1 sample")
    t = (start_sample + np.arange(num_samples)) / SAMPLE_RATE
    phase = 2 * math.pi * COLOUR_BY_NAME[scene.colour].pitch_hz * t
    tone = (np.sin(phase) + 0.25 * np.sin(2 * phase)) / 1.25
    mono = AMPLITUDE * scene.envelope(t) * tone
    left, right = _balance(scene, t)
    return np.stack([mono * left, mono * right]).astype(np.float32)


@dataclass(frozen=True)
class Clip:
    """A rendered window of a scene, with its caption."""

    scene: Scene
    caption: str
    video: np.ndarray
    """uint8 `[F, H, W, 3]` at FPS."""
    audio: np.ndarray
    """float32 `[2, N]` at SAMPLE_RATE, N = F * SAMPLE_RATE / FPS (rounded down)."""
    start_frame: int


def audio_samples(num_frames: int) -> int:
    """Audio samples that cover `num_frames` video frames."""
    return num_frames * SAMPLE_RATE // FPS


def render_clip(scene: Scene, start_frame: int = 0, num_frames: int = 5 * FPS) -> Clip:
    """Render `num_frames` frames of `scene` from `start_frame` and the audio over the same time span."""
    start_sample = start_frame * SAMPLE_RATE // FPS
    return Clip(scene, scene.caption, render_video(scene, start_frame, num_frames),
                render_audio(scene, start_sample, audio_samples(num_frames)), start_frame)


def make_clip(seed: int, num_frames: int = 5 * FPS, start_frame: int = 0) -> Clip:
    """The clip of `seed`: its scene (`scene_from_seed`) rendered from `start_frame`."""
    return render_clip(scene_from_seed(seed), start_frame, num_frames)


def all_captions() -> list[str]:
    """Every caption the grammar can produce (one per shape x colour x background x motion)."""
    return [Scene(shape, colour.name, background, motion.name, SIZE_RANGE[0], 0.0, 0.0).caption
            for shape in SHAPES for colour in COLOURS for background in BACKGROUNDS for motion in MOTIONS]


OPENING_SIZE = 48.0
"""Half-extent of the shapes of a streamed session (`opening_scene`), the middle of `SIZE_RANGE`."""


def _inside(scene: Scene, x: float, y: float) -> tuple[float, float]:
    """(x, y) moved the least distance that keeps a shape on an axis it does not wrap on inside the canvas."""
    side, above, below = scene.reach
    if scene.motion not in ("left", "right"):
        x = min(max(x, side + _MARGIN), WIDTH - side - _MARGIN)
    if scene.motion not in ("up", "down"):
        y = min(max(y, above + _MARGIN), HEIGHT - below - _MARGIN)
    return x, y


def moved_sideways(scene: Scene, dx: float) -> Scene:
    """`scene` with its centre `dx` px to the right, kept inside the canvas on an axis it does not wrap on (so its
    sound moves in the balance and keeps its loudness)."""
    x, _ = _inside(scene, scene.x0 + dx, scene.y0)
    return replace(scene, x0=x)


def opening_scene(shape: str, colour: str, background: str, motion: str, size: float = OPENING_SIZE) -> Scene:
    """The scene a streamed session opens on: its caption alone decides every pixel (centred, `OPENING_SIZE`, a
    bounce just landed), so a model given only the caption has one right answer for the first frames. `size`: the
    opening size of another world's model (a test of a model trained before the sizes changed)."""
    return Scene(shape, colour, background, motion, size, WIDTH / 2, HEIGHT / 2)


def continued_scene(previous: Scene, at: float, shape: str, colour: str, background: str, motion: str) -> Scene:
    """The scene a prompt switch at time `at` (seconds) leads to: the new grammar values, with the shape's centre at
    `at` where `previous` had it (moved inside the canvas on an axis the new motion does not wrap on; a bounce at
    the height the shape had, rising)."""
    px, py = (float(v[0]) for v in previous.centre(np.array([at])))
    probe = Scene(shape, colour, background, motion, OPENING_SIZE, 0.0, 0.0)
    x, y = _inside(probe, px, py)
    x0, y0, phase = x, y, 0.0
    if motion == "left":
        x0 = (x + HORIZONTAL_SPEED * at) % WIDTH
    elif motion == "right":
        x0 = (x - HORIZONTAL_SPEED * at) % WIDTH
    elif motion == "up":
        y0 = (y + VERTICAL_SPEED * at) % HEIGHT
    elif motion == "down":
        y0 = (y - VERTICAL_SPEED * at) % HEIGHT
    elif motion == "bounce":  # |sin(pi (at + phase))| = height above the floor / bounce height
        lift = min(max((probe.floor - y) / probe.bounce_height, 0.0), 1.0)
        phase = (math.asin(lift) / math.pi * BOUNCE_PERIOD - at) % BOUNCE_PERIOD
    return Scene(shape, colour, background, motion, OPENING_SIZE, x0, y0, phase)


def sample_grammar(rng: np.random.Generator) -> tuple[str, str, str, str]:
    """(shape, colour, background, motion), each value equally likely."""
    return (SHAPES[rng.integers(len(SHAPES))], COLOURS[rng.integers(len(COLOURS))].name,
            list(BACKGROUNDS)[rng.integers(len(BACKGROUNDS))], MOTIONS[rng.integers(len(MOTIONS))].name)
