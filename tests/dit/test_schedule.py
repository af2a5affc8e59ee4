"""Sampling schedule: the shifted grids, the student/teacher states and the Euler update."""

import pytest
import torch

from services.dit import schedule as sch

pytestmark = pytest.mark.cpu


def test_student_sigmas_to_4_decimals():
    assert [round(s, 4) for s in sch.VIDEO_SIGMAS] == [1.0, 0.9612, 0.8533, 0.0]
    assert [round(s, 4) for s in sch.AUDIO_SIGMAS] == [1.0, 0.8609, 0.5926, 0.0]


def test_teacher_grid_milestones():
    assert len(sch.TEACHER_SIGMAS) == 10  # 9 Euler forwards
    got = [round(sch.TEACHER_SIGMAS[i], 3) for i in sch.TEACHER_MILESTONES]
    assert got == [0.857, 0.6, 0.0]


def test_model_receives_one_minus_sigma():
    assert sch.model_t(1.0) == 0.0 and sch.model_t(0.0) == 1.0
    assert sch.model_t(sch.VIDEO_SIGMAS[1]) == pytest.approx(1 - 0.96116504854, abs=1e-9)


def test_shift_is_monotone_and_fixes_endpoints():
    grid = sch.shifted_grid(50, 12.0)
    assert grid[0] == 1.0 and grid[-1] == 0.0
    assert all(a > b for a, b in zip(grid, grid[1:]))
    with pytest.raises(ValueError, match="num_points"):
        sch.shifted_grid(1, 3.0)


def test_euler_step_recovers_x0_and_interpolates():
    gen = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(5, 3, generator=gen), torch.randn(5, 3, generator=gen)
    sigma, sigma_next = 0.8, 0.3
    xt = (1 - sigma) * x0 + sigma * noise
    v = x0 - noise  # the exact velocity: x0_hat = x_t + sigma * v
    assert torch.allclose(sch.predict_x0(xt, v, sigma), x0, atol=1e-6)
    expected = (1 - sigma_next) * x0 + sigma_next * noise
    assert torch.allclose(sch.euler_step(xt, v, sigma, sigma_next), expected, atol=1e-6)
    assert torch.equal(sch.euler_step(xt, v, sigma, 0.0), sch.predict_x0(xt, v, sigma))
