"""The synthetic world (tools/train/world.py): deterministic from a seed, and every caption says what the clip shows
and sounds like: colour and shape in the pixels, motion in the centroid, pitch, rhythm and balance in the audio."""

import math
import re
import time
from pathlib import Path

import numpy as np
import pytest

from tools.train import world
from tools.train.world import (BACKGROUNDS, COLOUR_BY_NAME, COLOURS, FPS, HEIGHT, MOTIONS, SAMPLE_RATE, SHAPES,
                               WIDTH, Scene, make_clip, render_audio, render_video)

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parents[2]
CAPTION = re.compile(
    r"a (?P<colour>{}) (?P<shape>{}) (?P<motion>{}) on a (?P<background>{}) background, a (?P<pitch>\w+) "
    r"(?P<rhythm>\w+)$".format("|".join(c.name for c in COLOURS), "|".join(SHAPES),
                               "|".join(m.phrase for m in MOTIONS), "|".join(BACKGROUNDS)))


def shape_mask(frame: np.ndarray, background: str) -> np.ndarray:
    """Pixels that are not the background colour: the shape, its anti-aliased rim included."""
    return np.abs(frame.astype(int) - BACKGROUNDS[background]).sum(-1) > 0


def coverage(frame: np.ndarray, background: str, colour: str) -> np.ndarray:
    """How much of each pixel the shape covers, read back from the blend of the two colours."""
    bg, rgb = np.asarray(BACKGROUNDS[background], float), np.asarray(COLOUR_BY_NAME[colour].rgb, float)
    return np.clip((frame - bg) @ (rgb - bg) / ((rgb - bg) @ (rgb - bg)), 0.0, 1.0)


def centroid(weights: np.ndarray) -> tuple[float, float]:
    ys, xs = np.indices(weights.shape)
    return float((xs * weights).sum() / weights.sum()), float((ys * weights).sum() / weights.sum())


def inside_edges(mask: np.ndarray) -> bool:
    return not (mask[0].any() or mask[-1].any() or mask[:, 0].any() or mask[:, -1].any())


def dominant_hz(signal: np.ndarray) -> float:
    spectrum = np.abs(np.fft.rfft(signal * np.hanning(signal.size)))
    return float(np.fft.rfftfreq(signal.size, 1 / SAMPLE_RATE)[spectrum.argmax()])


def modulation_hz(mono: np.ndarray) -> float:
    """Strongest rate at which the tone's loudness varies (RMS over 10 ms windows, 0.5-20 Hz)."""
    window = SAMPLE_RATE // 100
    rms = np.sqrt((mono[: mono.size // window * window].reshape(-1, window) ** 2).mean(1))
    spectrum = np.abs(np.fft.rfft(rms - rms.mean()))
    freqs = np.fft.rfftfreq(rms.size, 1 / 100)
    band = (freqs >= 0.5) & (freqs <= 20)
    return float(freqs[band][spectrum[band].argmax()])


def test_a_seed_gives_the_same_clip_every_time_and_other_seeds_other_clips():
    a, b, c = make_clip(11, 24), make_clip(11, 24), make_clip(12, 24)
    assert a.caption == b.caption and a.scene == b.scene
    assert np.array_equal(a.video, b.video) and np.array_equal(a.audio, b.audio)
    assert a.scene != c.scene and not np.array_equal(a.video, c.video)


def test_clips_have_the_tiny_canvas_rate_and_dtypes():
    clip = make_clip(5)
    assert clip.video.shape == (5 * FPS, HEIGHT, WIDTH, 3) == (120, 192, 320, 3) and clip.video.dtype == np.uint8
    assert clip.audio.shape == (2, 5 * SAMPLE_RATE) == (2, 160_000) and clip.audio.dtype == np.float32
    assert np.abs(clip.audio).max() <= 1.0


def test_the_caption_names_the_scene():
    scene = Scene("circle", "red", "dark blue", "left", 44.0, 200.0, 96.0)
    assert scene.caption == "a red circle moving left on a dark blue background, a low beat"
    assert Scene("square", "white", "grey", "still", 44.0, 100.0, 90.0).caption == \
        "a white square standing still on a grey background, a bright hum"


@pytest.mark.parametrize("shape, fill", [("circle", math.pi / 4), ("square", 1.0), ("triangle", 0.5)])
def test_the_shape_is_drawn_in_its_colour_with_its_outline(shape, fill):
    scene = Scene(shape, "red", "dark blue", "still", 48.0, 160.0, 96.0)
    frame = render_video(scene, 0, 1)[0]
    solid = np.all(frame == COLOUR_BY_NAME["red"].rgb, axis=-1)
    ys, xs = np.nonzero(solid)
    box = (xs.max() - xs.min() + 1) * (ys.max() - ys.min() + 1)
    assert solid.sum() / box == pytest.approx(fill, abs=0.06)
    assert solid[96, 160]  # the centre is the shape's colour, the corners the background's
    assert np.array_equal(frame[0, 0], BACKGROUNDS["dark blue"]) and np.array_equal(frame[-1, -1],
                                                                                   BACKGROUNDS["dark blue"])


@pytest.mark.parametrize("motion, dx, dy", [("left", -32.0, 0.0), ("right", 32.0, 0.0), ("up", 0.0, -19.2),
                                            ("down", 0.0, 19.2), ("still", 0.0, 0.0)])
def test_the_centroid_moves_as_the_caption_says(motion, dx, dy):
    scene = Scene("circle", "green", "black", motion, 44.0, 160.0, 96.0)
    video = render_video(scene, 0, 13)  # half a second
    (x0, y0), (x1, y1) = (centroid(coverage(f, "black", "green")) for f in (video[0], video[12]))
    assert (x0, y0) == pytest.approx((160.0, 96.0), abs=0.5)
    assert (x1 - x0, y1 - y0) == pytest.approx((dx, dy), abs=0.5)


def test_a_bouncing_shape_lands_on_the_floor_once_a_second_and_the_thump_comes_with_it():
    scene = Scene("square", "yellow", "grey", "bounce", 44.0, 160.0, 0.0, phase=0.25)
    video = render_video(scene, 0, 2 * FPS)
    ys = np.array([centroid(coverage(f, "grey", "yellow"))[1] for f in video])
    lowest = np.flatnonzero(ys > ys.max() - 0.5)  # frames on the floor: t = 0.75 s and 1.75 s
    assert list(lowest) == [18, 42]
    assert ys.max() - ys.min() > 60
    mono = render_audio(scene, 0, 2 * SAMPLE_RATE).sum(0)
    loudest = np.maximum.reduceat(np.abs(mono), np.arange(2 * FPS) * SAMPLE_RATE // FPS)  # per frame
    assert {int(i) for i in np.argsort(loudest)[-2:]} == {18, 42}


@pytest.mark.parametrize("colour", [c.name for c in COLOURS])
def test_the_tone_is_the_colours_pitch(colour):
    scene = Scene("triangle", colour, "brown", "still", 44.0, 160.0, 96.0)
    mono = render_audio(scene, 0, SAMPLE_RATE).sum(0)
    assert dominant_hz(mono) == pytest.approx(COLOUR_BY_NAME[colour].pitch_hz, abs=1.5)


@pytest.mark.parametrize("motion, rate", [("left", 2.0), ("up", 6.0), ("bounce", 1.0)])
def test_the_rhythm_follows_the_motion(motion, rate):
    scene = Scene("circle", "blue", "black", motion, 44.0, 160.0, 96.0)
    assert modulation_hz(render_audio(scene, 0, 4 * SAMPLE_RATE).sum(0)) == pytest.approx(rate, abs=0.3)


def test_a_still_shape_hums_at_a_constant_loudness():
    mono = render_audio(Scene("circle", "blue", "black", "still", 44.0, 160.0, 96.0), 0, SAMPLE_RATE).sum(0)
    window = SAMPLE_RATE // 20  # 50 ms: 22 periods of the 440 Hz tone
    rms = np.sqrt((mono.reshape(-1, window) ** 2).mean(1))
    assert rms.std() / rms.mean() < 0.01


@pytest.mark.parametrize("x", [64.0, 160.0, 256.0])
def test_the_balance_follows_the_shapes_x(x):
    audio = render_audio(Scene("square", "red", "black", "still", 44.0, x, 96.0), 0, SAMPLE_RATE)
    left, right = np.sqrt((audio ** 2).mean(1))
    assert right / left == pytest.approx(math.tan(x / WIDTH * math.pi / 2), rel=0.01)


def test_the_balance_moves_right_with_a_shape_moving_right_and_never_jumps_as_it_wraps():
    scene = Scene("circle", "white", "black", "right", 44.0, 60.0, 96.0)
    audio = render_audio(scene, 0, 5 * SAMPLE_RATE)
    quarter = SAMPLE_RATE // 4
    rms = np.sqrt((audio[:, : 16 * quarter].reshape(2, 16, quarter) ** 2).mean(-1))  # [2, 16] per 0.25 s
    ratio = rms[1] / rms[0]
    assert np.all(np.diff(ratio[:12]) > 0)  # rightwards until it reaches the right edge (x = 60 + 64 t)
    t = np.arange(5 * SAMPLE_RATE) / SAMPLE_RATE
    left, right = world._balance(scene, t)
    assert np.abs(np.diff(left)).max() < 1e-3 and np.abs(np.diff(right)).max() < 1e-3


def test_a_shape_moved_sideways_keeps_its_loudness_and_stays_inside_unless_it_wraps():
    still = Scene("square", "red", "black", "still", 44.0, 160.0, 96.0)
    assert world.moved_sideways(still, 40.0) == Scene("square", "red", "black", "still", 44.0, 200.0, 96.0)
    pushed = world.moved_sideways(still, 500.0)  # as far right as it fits, its sound as loud as at the centre
    assert pushed.x0 + pushed.reach[0] <= WIDTH
    loudness = [np.sqrt((render_audio(s, 0, SAMPLE_RATE) ** 2).sum(0).mean()) for s in (still, pushed)]
    assert loudness[1] == pytest.approx(loudness[0], rel=0.01)
    moving = Scene("circle", "white", "black", "left", 44.0, 300.0, 96.0)
    assert world.moved_sideways(moving, 40.0).x0 == 340.0  # wraps: its centre goes on from the left edge


def test_consecutive_windows_join_without_a_seam():
    scene = world.scene_from_seed(3)
    assert np.array_equal(render_video(scene, 0, 30), np.concatenate([render_video(scene, 0, 13),
                                                                      render_video(scene, 13, 17)]))
    assert np.array_equal(render_audio(scene, 0, 9000), np.concatenate([render_audio(scene, 0, 4000),
                                                                        render_audio(scene, 4000, 5000)], axis=1))


@pytest.mark.parametrize("seed", range(40))
def test_random_clips_show_and_sound_what_their_caption_says(seed):
    clip = make_clip(seed, num_frames=3 * FPS)
    words = CAPTION.match(clip.caption)
    assert words, clip.caption
    colour = COLOUR_BY_NAME[words["colour"]]
    masks = [shape_mask(f, words["background"]) for f in clip.video]
    solid = np.all(clip.video[0] == colour.rgb, axis=-1)  # the shape's pixels bar its anti-aliased rim
    assert masks[0].sum() > 1000 and solid.sum() > 0.8 * masks[0].sum()
    covers = [coverage(f, words["background"], words["colour"]) for f in clip.video]
    steps = [np.subtract(centroid(b), centroid(a)) for a, b in zip(covers, covers[1:]) if inside_edges(a > 0)
             and inside_edges(b > 0)]
    h, v = world.HORIZONTAL_SPEED / FPS, world.VERTICAL_SPEED / FPS  # px per frame
    expected = {"moving left": (-h, 0), "moving right": (h, 0), "moving up": (0, -v), "moving down": (0, v),
                "standing still": (0, 0)}.get(words["motion"])
    if expected is not None:
        assert steps  # the shape is inside the canvas in at least two consecutive frames
        for step in steps:
            assert tuple(step) == pytest.approx(expected, abs=0.05), words["motion"]
    if words["motion"] == "bouncing":
        xs = np.array([centroid(c)[0] for c in covers])
        ys = np.array([centroid(c)[1] for c in covers])
        assert np.ptp(xs) < 0.05 and np.ptp(ys) > 1.0
    mono = clip.audio.sum(0)
    assert dominant_hz(mono) == pytest.approx(colour.pitch_hz, abs=2.0)
    assert words["pitch"] == colour.pitch_word


def test_every_caption_tokenizes_with_the_tiny_tokenizer_within_max_tokens(tmp_path):
    from services.common.config import load_profile
    from services.encoder.checkpoint import write_tiny_tokenizer
    from services.encoder.model import load_tokenizer
    from services.encoder.preset import get_preset

    write_tiny_tokenizer(tmp_path, get_preset("tiny").vocab_size)
    tokenizer = load_tokenizer(tmp_path)
    max_tokens = load_profile(ROOT / "configs" / "tiny_cpu.yaml").encoder.max_tokens
    captions = world.all_captions()
    assert len(captions) == len(set(captions)) == 3 * 6 * 5 * 6
    lengths = []
    for caption in captions:
        ids = tokenizer(caption, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == caption
        lengths.append(len(ids))
    assert max(lengths) <= max_tokens


def test_a_5_second_clip_renders_in_well_under_a_second():
    best = min(_timed(lambda: make_clip(seed)) for seed in range(3))
    assert best < 0.5


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def test_a_shape_too_large_for_the_canvas_is_refused_and_a_smaller_world_s_size_is_drawn():
    with pytest.raises(ValueError, match="triangle must be narrower than half the canvas"):
        Scene("triangle", "red", "black", "left", 80.0, 160.0, 96.0)
    with pytest.raises(ValueError, match="size=0"):
        Scene("circle", "red", "black", "still", 0.0, 160.0, 96.0)
    # run C's world opened at 33 px, below today's SIZE_RANGE: its scenes still render, for the tests of its model
    frame = render_video(world.opening_scene("square", "red", "black", "still", size=33.0), 0, 1)[0]
    solid = np.all(frame == COLOUR_BY_NAME["red"].rgb, axis=-1)
    assert solid.sum() == pytest.approx((2 * 33.0) ** 2, rel=0.05)
    assert world.opening_scene("square", "red", "black", "still").size == world.OPENING_SIZE


def test_the_readme_lists_the_words_of_the_worlds_grammar_and_an_example_from_it():
    """The README tells a user which sentences the default model knows: its table must follow the world's slots,
    and its example must be one of the world's captions."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    rhythms: dict[str, list[str]] = {}
    for m in world.MOTIONS:
        rhythms.setdefault(m.rhythm, []).append(m.phrase)
    rows = {
        "colour and its pitch word": ", ".join(f"{c.name} {c.pitch_word}" for c in world.COLOURS),
        "shape": ", ".join(world.SHAPES),
        "motion and its rhythm": "; ".join(f"{' or '.join(p)}: {r}" for r, p in rhythms.items()),
        "background": ", ".join(world.BACKGROUNDS),
    }
    for slot, words in rows.items():
        assert f"| {slot} | {words} |" in readme, f"the README's row for {slot} is not: {words}"
    example = re.search(r'For example "([^"]+)"', readme)
    assert example and example.group(1) in world.all_captions(), "the README's example is not a caption"
