"""The phase probe (tools/train/phase_probe.py): sessions of one motion each, and the shipped student's x0 loss by
phase through its training forward, as served."""
import pathlib

import numpy as np
import pytest

from tools.train import phase_probe, world
from tools.train.student import REQUESTS

pytestmark = pytest.mark.cpu

TREE = pathlib.Path(__file__).resolve().parents[2] / "models" / "tiny"


@pytest.mark.parametrize("motion", [m.name for m in world.MOTIONS])
def test_each_session_opens_on_one_prompt_of_the_asked_motion_and_the_sessions_differ(motion):
    sessions = phase_probe.motion_sessions(motion, 4)
    assert all(len(s) == REQUESTS and len(set(s)) == 1 for s in sessions)
    assert all(s[0].motion == motion and (s[0].x0, s[0].y0) == (world.WIDTH / 2, world.HEIGHT / 2) for s in sessions)
    assert len({(s[0].shape, s[0].colour, s[0].background) for s in sessions}) > 1


@pytest.mark.slow
def test_the_shipped_student_predicts_a_still_scene_in_every_phase():
    [phases] = phase_probe.probe(TREE, 1, ("still",)).values()
    # measured 0.055-0.062 in each of the 8 phases (run D, 2026-12-06); a bounce, which it has not learnt: 0.15-0.20
    assert len(phases) == 8 and all(np.isfinite(phases)) and max(phases) < 0.15
