"""The teacher probe measures a still shape's sound against the world's, from true tails and from its own."""
from __future__ import annotations

import pathlib

import pytest

from tools.train import teacher_probe, world
from tools.train.teacher_probe import RequestBalance

pytestmark = pytest.mark.cpu

REPO = pathlib.Path(__file__).resolve().parents[2]
TREE = REPO / "models" / "tiny"  # the shipped model: its base, audio VAE and text encoder


@pytest.fixture(scope="module")
def probe():
    return teacher_probe.Probe(TREE)


@pytest.mark.parametrize("place", [80.0, 160.0, 240.0])
def test_the_worlds_own_latents_read_back_as_the_worlds_balance(probe, place):
    latents, world_db = probe.world_latents(teacher_probe.still_scene("red", place), 1)
    assert world_db == pytest.approx({80.0: -7.7, 160.0: 0.0, 240.0: 7.7}[place], abs=0.1)  # constant-power pan
    seconds, whole = probe.balances(latents[:, 40:], 1.0)
    assert len(seconds) == 4  # 198 latents of 800 samples at 32 kHz: four whole seconds
    assert whole == pytest.approx(world_db, abs=1.0), "the audio VAE's round trip moved the balance"


def test_a_centred_session_opens_without_a_tail_and_goes_on_from_its_own(probe):
    rows = teacher_probe.probe(probe, "red", [world.WIDTH / 2], [0], requests=1, seconds=1.0)
    assert [(r.request, r.way) for r in rows] == [(0, "own"), (1, "world"), (1, "own")]
    _, world_after, own_after = rows
    assert own_after.whole_db != world_after.whole_db, "request 1 took the world's tail in both ways"
    line, = teacher_probe.summary(rows)
    assert "own-tail walk from request 0" in line


def test_off_centre_both_ways_start_from_the_worlds_tail(probe):
    rows = teacher_probe.probe(probe, "red", [240.0], [0], requests=1, seconds=1.0)
    assert [(r.request, r.way) for r in rows] == [(1, "world"), (1, "own")]
    assert rows[0].whole_db == rows[1].whole_db  # the same tail and noise


def test_the_lean_is_the_balance_less_the_worlds():
    row = RequestBalance(240.0, 0, 1, "world", 7.7, [8.0], 9.0)
    assert row.lean_db == pytest.approx(1.3)
