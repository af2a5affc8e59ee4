"""What the shipped tiny model (`models/tiny`, the default demo's weights) shows and sounds like, streamed through
the whole system on the CPU: the typed colour and outline where the typed shape is, its tone, a prompt update that
takes effect at the acknowledged request and not before, and a scene that goes on across phase and request
boundaries.

Measured by `tools.train.sample`'s functions on the fMP4 the client received. Every threshold sits beside the value
measured on the shipped weights (2 CPU cores, 2026-12-06; docs/training.md, "Run D"), with a margin.

A retrained model is held to the same thresholds before it ships: `VITASCOPE_MEANING_TREE=<the tree
tools.train.ship wrote> pytest tests/e2e/test_meaning.py` (docs/training.md, "Run E").
"""
from __future__ import annotations

import os
import pathlib

import numpy as np
import pytest

from tools.train import judge, world
from tools.train.judge import first_phase_speed, path_iou, world_speed
from tools.train.sample import Look, Stream, looks, nearest_colour, sample, shape_mask

pytestmark = [pytest.mark.cpu, pytest.mark.e2e]

TREE = pathlib.Path(os.environ.get("VITASCOPE_MEANING_TREE")
                    or pathlib.Path(__file__).resolve().parents[2] / "models" / "tiny")
RED, BLUE = (world.opening_scene(*g) for g in judge.UPDATE)  # the judge streams these at more seeds
RED_ON_BLACK = world.opening_scene("circle", "red", "black", "still")
YELLOW_ON_GREY = world.opening_scene("square", "yellow", "grey", "still")
HOLD_S = judge.HOLD_S


@pytest.fixture(scope="module")
def updated(tmp_path_factory) -> Stream:
    """Three requests of the red circle, "a blue square ..." sent during request 0 so that it applies from 1."""
    log = tmp_path_factory.mktemp("meaning") / "services.log"
    return sample(TREE, RED.caption, [(1, BLUE.caption)], requests=3, seed=0, service_log=str(log))


@pytest.fixture(scope="module")
def recoloured(tmp_path_factory) -> Stream:
    """Two requests of a red circle on black, then "a yellow square ... on a grey background" from request 1: every
    colour of the picture changes (the renormalisation's anchor moves to the new prompt, docs/decisions.md)."""
    log = tmp_path_factory.mktemp("meaning") / "services.log"
    return sample(TREE, RED_ON_BLACK.caption, [(1, YELLOW_ON_GREY.caption)], requests=2, seed=0,
                  service_log=str(log))


@pytest.fixture(scope="module")
def held(tmp_path_factory) -> Stream:
    """Three requests of the red circle and no update, holding HOLD_S for a prompt at each request boundary."""
    log = tmp_path_factory.mktemp("meaning") / "services.log"
    return sample(TREE, RED.caption, [], requests=3, seed=0, service_log=str(log), hold_s=HOLD_S)


def shape_iou(frames: np.ndarray, scene: world.Scene) -> float:
    """Mean over `frames` of the IoU between the shape pixels shown and the scene's own shape (first frame)."""
    truth, _ = shape_mask(world.render_video(scene, 0, 1)[0])
    ious = []
    for frame in frames:
        shown, _ = shape_mask(frame)
        ious.append((shown & truth).sum() / max((shown | truth).sum(), 1))
    return float(np.mean(ious))


def assert_shows(lk: Look, scene: world.Scene) -> None:
    """The span shows the scene's colour at its place over its background, and sounds its tone."""
    where = f"request {lk.request} phase {lk.phase}"
    assert lk.colour != (-1, -1, -1), f"{where}: no shape shows (no 20 pixels stand out of the background)"
    name, distance, runner_up = nearest_colour(lk.colour)
    # measured: red 1-4 from (220, 40, 40), the next colour 173 away; blue 3-5 from (60, 110, 240), the next
    # colour (purple) 101-102 away; yellow 2-3 from its own, the next 169 away
    assert name == scene.colour and distance < 85 and runner_up > distance + 25, (
        f"{where}: the shape is {lk.colour}, nearest {name} at {distance:.0f} (next at {runner_up:.0f}); "
        f"{scene.colour} was typed")
    background = world.BACKGROUNDS[scene.background]
    assert np.abs(np.subtract(lk.background, background)).max() < 20, (  # measured: at most 7 off
        f"{where}: background {lk.background}, typed {scene.background} {background}")
    cx, cy = scene.centre(np.array([0.0]))
    assert abs(lk.centroid[0] - cx[0]) < 8 and abs(lk.centroid[1] - cy[0]) < 8, (  # measured: within 2.1 px
        f"{where}: the shape is at {lk.centroid}, the scene puts it at ({cx[0]:.0f}, {cy[0]:.0f})")
    pitch = world.COLOUR_BY_NAME[scene.colour].pitch_hz
    assert abs(lk.pitch_hz - pitch) < 4, (  # measured: within 0.5 Hz (the FFT bins of one phase are ~0.7 Hz)
        f"{where}: the loudest tone is {lk.pitch_hz:.1f} Hz, {scene.colour} sounds {pitch:.0f} Hz")


def test_a_red_circle_shows_red_where_the_circle_is_and_sounds_its_tone(updated):
    request_0 = [lk for lk in looks(updated) if lk.request == 0]
    assert len(request_0) == 4, f"request 0 came in {len(request_0)} phases"
    for lk in request_0:
        assert_shows(lk, RED)
    frames = updated.frames[:updated.spans[len(request_0) - 1].stop]
    # the shown shape against the circle itself: measured 0.88 (run C's square of the circle's size: 0.82)
    assert shape_iou(frames, RED) > 0.75


def test_an_update_changes_colour_shape_and_pitch_at_the_acknowledged_request_and_not_before(updated):
    for lk in looks(updated):
        scene = RED if lk.request == 0 else BLUE
        assert_shows(lk, scene)
        assert lk.shape == scene.shape, f"request {lk.request} phase {lk.phase} reads as a {lk.shape}"
    first_of_request_1 = next(sp for sp in updated.spans if sp.request == 1)
    # request 1's frames after its first span (which opens on the decoder's last red frames) against the square:
    # measured 0.96
    assert shape_iou(updated.frames[first_of_request_1.stop:], BLUE) > 0.75
    # the update was acknowledged on request 1's first chunk: the viewer is told when the change shows
    [acked_at] = updated.result.applied_at.values()
    first_of_1 = next(c for c in updated.result.chunks if c.request_index == 1)
    assert acked_at == first_of_1.index


def test_an_update_of_every_colour_shows_from_the_acknowledged_request(recoloured):
    # with the renormalisation anchored at the session's first phase this stayed red on black after the update
    seen = looks(recoloured)
    assert {0, 1} <= {lk.request for lk in seen}
    for lk in seen:
        assert_shows(lk, RED_ON_BLACK if lk.request == 0 else YELLOW_ON_GREY)


@pytest.mark.parametrize("shape", ["circle", "square", "triangle"])
def test_each_typed_shape_shows_its_own_outline(shape, tmp_path):
    """A circle, a square and a triangle, each standing still, each phase of the first request: the outline a person
    reads (`sample.outline`: widths near the top and the bottom against the widest) is the typed shape's."""
    scene = world.opening_scene(shape, "white", "black", "still")
    stream = sample(TREE, scene.caption, [], requests=1, seed=0, service_log=str(tmp_path / "services.log"))
    shown = [(lk.phase, lk.shape) for lk in looks(stream) if lk.request == 0]
    assert len(shown) == 4 and all(s == shape for _, s in shown), f"typed a {shape}, the phases show {shown}"


@pytest.mark.parametrize("motion", ["left", "right"])
def test_a_shape_moving_left_or_right_keeps_to_the_worlds_path_across_phases_and_requests(motion, tmp_path):
    """The first phase (its first 34 frames, 1.4 s) follows the typed motion: a line fitted to the shape's x over its
    frames has the motion's sign and about its speed (64 px/s, 2.67 px a frame). Then the shape keeps to the world's
    path through both requests, wrapping round the edge as the world does (`judge.path_iou`: the shape shown against
    the world's at the same time, every 12th frame)."""
    scene = world.opening_scene("circle", "red", "black", motion)
    stream = sample(TREE, scene.caption, [], requests=2, seed=0, service_log=str(tmp_path / "services.log"))
    slope, want = first_phase_speed(stream, motion), world_speed(motion)
    assert not np.isnan(slope), "the shape shows in under 80% of the first phase's frames"
    # measured: -2.9 (left) and +2.5 (right) px a frame; run B's model kept the shape at the centre (0)
    assert np.sign(slope) == np.sign(want) and 0.5 * abs(want) < abs(slope) < 1.5 * abs(want), (
        f"moving {motion}: the shape's x changes {slope:+.2f} px a frame, the world {want:+.2f}")
    # measured: 0.65 (left), 0.59 (right); a shape that stops where it opened scores 0.21, run C's model (which lost
    # the shape after the first phase) 0.30 and 0.22 on the shapes of its own world
    followed = path_iou(stream, scene)
    assert followed > 0.45, f"moving {motion}: the shape keeps to the world's path with IoU {followed:.2f}"


def test_the_scene_goes_on_across_phase_and_request_boundaries(held):
    """No frame-to-frame change at a phase boundary larger than the largest inside a phase, and the shape's place,
    colour and tone steady from the first phase to the last (the history the KV cache keeps carries the scene; on
    this model, whose still scenes the caption decides, a cache that kept nothing would look the same: see
    docs/training.md, "Run B")."""
    f = held.frames.astype(np.float32)
    step = np.abs(f[1:] - f[:-1]).mean(axis=(1, 2, 3))  # step[i]: frame i -> i + 1, mean |RGB| change
    at_boundary = max(step[sp.start - 1] for sp in held.spans[1:])
    inside = max(step[sp.start:sp.stop - 1].max() for sp in held.spans)
    assert at_boundary <= inside, (  # measured: 4.3 at a boundary, 4.9 inside
        f"a jump of {at_boundary:.2f} at a phase boundary, at most {inside:.2f} inside a phase")
    seen = looks(held)
    assert len({lk.request for lk in seen}) >= 3
    xs, ys = [lk.centroid[0] for lk in seen], [lk.centroid[1] for lk in seen]
    assert max(xs) - min(xs) < 6 and max(ys) - min(ys) < 6, f"the shape wandered: x {xs}, y {ys}"  # measured: 1 px
    for lk in seen:
        assert_shows(lk, RED)
    # the centred shape's sound stays centred (R - L): measured at most 1.7 dB over four requests at this seed (run C:
    # 10 dB). The audio teacher's walk is a draw of the seed's noise: the same model strays 1.3 / 5.7 / 5.0 dB at
    # seeds 1-3, and past 6 dB at 5 of 24 independent seeds (docs/training.md, "Run F at 3,214"), which the judge
    # holds a retraining to (`judge.teacher_walk`)
    worst = max(abs(lk.balance_db) for lk in seen)
    assert worst <= judge.HELD_BALANCE_LIMIT, f"the balance drifted: {[lk.balance_db for lk in seen]}"


def test_a_hold_that_ends_without_a_prompt_keeps_the_last_prompts_scene(held):
    later = [c for c in held.result.chunks if c.kind == "media" and c.request_index > 0 and c.phase_index == 0]
    assert len(later) >= 2
    for c in later:  # the session did hold: the first chunk of each later request waited at least the hold
        assert c.interval_s >= HOLD_S, f"request {c.request_index} came {c.interval_s:.2f} s after the last chunk"
    for lk in looks(held):
        if lk.request > 0:
            assert_shows(lk, RED)
