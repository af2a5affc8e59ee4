"""The sampling tool's measures (tools/train/sample.py), on media rendered by the synthetic world: the colour and
place of the shape, the pitch and balance of the sound, and the frame spans of the stream's chunks."""

import numpy as np
import pytest

from services.client import ChunkStat, ClientResult
from tools.train import sample, world

pytestmark = pytest.mark.cpu


def _span_media(scene: world.Scene, frames: int = 34):
    video = world.render_video(scene, 0, frames)
    audio = world.render_audio(scene, 0, frames * world.SAMPLE_RATE // world.FPS)
    return video, audio, sample.Span(0, 0, 0, frames)


@pytest.mark.parametrize("colour", world.COLOURS, ids=lambda c: c.name)
def test_look_reads_the_shapes_colour_and_the_colours_pitch(colour):
    scene = world.opening_scene("circle", colour.name, "dark blue", "still")
    video, audio, span = _span_media(scene)
    lk = sample.look(video, audio, world.SAMPLE_RATE, span)
    assert np.abs(np.subtract(lk.colour, colour.rgb)).max() <= 3
    assert np.abs(np.subtract(lk.background, world.BACKGROUNDS["dark blue"])).max() <= 3
    assert abs(lk.pitch_hz - colour.pitch_hz) <= 1.0 / (34 / world.FPS)  # one FFT bin of the 34-frame span
    assert lk.centroid == pytest.approx((world.WIDTH / 2, world.HEIGHT / 2), abs=1.0)
    assert abs(lk.balance_db) < 0.5  # centred: both channels alike


def test_look_follows_the_shape_to_the_right_and_the_balance_with_it():
    left = world.Scene("square", "red", "grey", "still", 44.0, 60.0, 96.0)
    right = world.Scene("square", "red", "grey", "still", 44.0, 260.0, 96.0)
    looks = [sample.look(*_span_media(s)[:2], world.SAMPLE_RATE, sample.Span(0, 0, 0, 34)) for s in (left, right)]
    assert looks[0].centroid[0] == pytest.approx(60.0, abs=1.0) and looks[1].centroid[0] == pytest.approx(260, abs=1)
    assert looks[0].balance_db < -3.0 < 3.0 < looks[1].balance_db


def test_a_frame_without_a_shape_reports_none():
    video = np.full((10, world.HEIGHT, world.WIDTH, 3), 40, np.uint8)
    lk = sample.look(video, np.zeros((2, 10 * world.SAMPLE_RATE // world.FPS), np.float32), world.SAMPLE_RATE,
                     sample.Span(0, 0, 0, 10))
    assert lk.colour == (-1, -1, -1) and lk.coverage == 0.0


def test_spans_merge_the_chunks_of_one_phase_and_the_trailer_into_the_last():
    def chunk(i, kind, r, p, n):
        return ChunkStat(i, kind, r, p, n, 1, 0.0, 0.0, ())
    result = ClientResult(chunks=[chunk(0, "init", 0, 0, 0), chunk(1, "media", 0, 0, 13), chunk(2, "media", 0, 0, 26),
                                  chunk(3, "media", 0, 1, 34), chunk(4, "media", 1, 0, 34),
                                  chunk(5, "trailer", 1, 0, 5)])
    assert sample.spans_of(result) == [sample.Span(0, 0, 0, 39), sample.Span(0, 1, 39, 73),
                                       sample.Span(1, 0, 73, 112)]


def _sample_processes() -> list[int]:
    """Pids of services started on a sampling profile (their command lines name its temporary directory)."""
    import pathlib
    pids = []
    for proc in pathlib.Path("/proc").glob("[0-9]*"):
        try:
            if b"vitascope-sample-" in (proc / "cmdline").read_bytes():
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


@pytest.mark.slow
def test_sampling_a_tree_streams_its_first_request_and_leaves_no_service_running(tmp_path):
    from services.checkpoints import write_tree
    tree = write_tree("tiny", tmp_path / "tree")
    s = sample.sample(tree, "a red circle standing still on a dark blue background, a low hum", [], 1, 0,
                      str(tmp_path / "services.log"))
    assert len(s.frames) >= 124 and s.frames.shape[1:] == (world.HEIGHT, world.WIDTH, 3)
    assert [(sp.request, sp.phase) for sp in s.spans][:4] == [(0, 0), (0, 1), (0, 2), (0, 3)]
    assert s.spans[-1].stop == len(s.frames) and s.sample_rate == world.SAMPLE_RATE
    assert s.audio.shape[0] == 2 and s.audio.shape[1] >= 124 * world.SAMPLE_RATE // world.FPS * 0.95
    assert _sample_processes() == []



def _staircase(cells_per_row: list[int]) -> np.ndarray:
    """A mask drawn on the 16 px latent grid, centred: row r of cells is `cells_per_row[r]` cells wide."""
    mask = np.zeros((world.HEIGHT, world.WIDTH), bool)
    for r, n in enumerate(cells_per_row):
        mask[48 + 16 * r:64 + 16 * r, 160 - 8 * n:160 + 8 * n] = True
    return mask


@pytest.mark.parametrize("shape", world.SHAPES)
@pytest.mark.parametrize("size", [world.SIZE_RANGE[0], world.OPENING_SIZE, world.SIZE_RANGE[1]])
def test_outline_reads_each_shape_drawn_sharp_anywhere(shape, size):
    for x, y in ((160.0, 96.0), (150.0, 100.0), (171.0, 85.0)):
        frame = world.render_video(world.Scene(shape, "red", "black", "still", size, x, y), 0, 1)[0]
        mask, _ = sample.shape_mask(frame)
        assert sample.outline(mask) == shape, f"{shape} of size {size} at ({x}, {y})"


@pytest.mark.parametrize("shape, cells", [("circle", [4, 6, 6, 6, 6, 4]), ("square", [6] * 6),
                                          ("triangle", [2, 4, 4, 6, 6])])
def test_outline_reads_the_staircases_the_trained_vae_draws_at_the_opening_size(shape, cells):
    # the cells each shape's decode covered at OPENING_SIZE (the trained VAE, 2026-12-04, docs/training.md)
    assert sample.outline(_staircase(cells)) == shape


@pytest.mark.parametrize("shape", world.SHAPES)
def test_a_stray_cell_of_another_colour_beside_the_shape_does_not_change_the_outline_read(shape):
    scene = world.opening_scene(shape, "white", "black", "still")
    video, audio, span = _span_media(scene, frames=4)
    mask, _ = sample.shape_mask(video[0])
    rows = np.flatnonzero(mask.any(axis=1))
    cols = np.flatnonzero(mask[rows[-1]])
    video[:, rows[-1] + 1:rows[-1] + 17, cols[0]:cols[0] + 16] = (230, 110, 30)  # an orange cell under its foot
    assert sample.outline(sample.shape_mask(video[0])[0]) != shape  # read whole, the cell changes the outline
    assert sample.look(video, audio, world.SAMPLE_RATE, span).shape == shape


def test_outline_of_nothing_and_of_a_shape_split_by_the_edge():
    assert sample.outline(np.zeros((world.HEIGHT, world.WIDTH), bool)) == "none"
    frame = world.render_video(world.Scene("square", "red", "black", "left", 48.0, 0.0, 96.0), 0, 1)[0]
    mask, _ = sample.shape_mask(frame)
    assert sample.outline(mask) == "square"  # both halves span the same rows: its widths are read whole
    mask[:, :] = False
    mask[40:60, 10:200] = True
    mask[60:150, 100:110] = True  # a T: wide at the top, narrow below
    assert sample.outline(mask) == "unclear"
