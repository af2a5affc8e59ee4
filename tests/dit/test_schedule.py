"""Sampling schedule: the shifted grids, the student/teacher states and the Euler update."""

import pytest
import torch

from services.dit.stream import schedule as sch

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
    assert sch.model_t(sch.VIDEO_SIGMAS[1]) == pytest.approx(1 - 0.96116507053, abs=1e-9)


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


# The official grids (TaoMate-H3 denoise_schedule.py) are computed in float32 (a float32 linspace, then the shift);
# these are its values, which differ from the exact rationals in the last float32 bits.
OFFICIAL_VIDEO = [1.0, 0.9611650705337524, 0.8533332943916321, 0.0]
OFFICIAL_AUDIO = [1.0, 0.8608695268630981, 0.5925925970077515, 0.0]
OFFICIAL_TEACHER_AUDIO = [1.0, 0.9600000381469727, 0.9130435585975647, 0.8571428060531616, 0.7894737124443054,
                          0.7058823704719543, 0.5999999642372131, 0.46153849363327026, 0.27272728085517883, 0.0]
OFFICIAL_TEACHER_VIDEO = [1.0, 0.9896907806396484, 0.9767442941665649, 0.9599999189376831, 0.9375,
                          0.9056603908538818, 0.8571428060531616, 0.7741935849189758, 0.5999999642372131, 0.0]


def test_grids_are_the_official_float32_values():
    assert list(sch.VIDEO_SIGMAS) == OFFICIAL_VIDEO
    assert list(sch.AUDIO_SIGMAS) == OFFICIAL_AUDIO
    assert list(sch.TEACHER_SIGMAS) == OFFICIAL_TEACHER_AUDIO
    assert list(sch.TEACHER_TEXT_SIGMAS) == OFFICIAL_TEACHER_VIDEO
    # the model's t = 1 - sigma, exactly as the official float32 timestep tensor holds it
    t = torch.tensor([sch.model_t(s) for s in OFFICIAL_VIDEO[:-1]], dtype=torch.float32)
    assert t.tolist() == [sch.model_t(s) for s in sch.VIDEO_SIGMAS[:-1]]


def _official_update(x, v, sigma, sigma_next):
    """The update as the official loop does it, every coefficient a float32 tensor: its sigma is recovered from the
    float32 timestep t = 1 - sigma, its ratio divided in float32."""
    t = torch.tensor(1.0 - sigma, dtype=torch.float32)
    s_t = 1.0 - t
    sig = torch.tensor([sigma, sigma_next], dtype=torch.float32)
    r = sig[1] / sig[0]
    x0 = x + s_t * v
    return r * x + (1.0 - r) * x0


@pytest.mark.parametrize("step", range(9))
def test_euler_step_is_bitwise_the_official_float32_update(step):
    gen = torch.Generator().manual_seed(step)
    x, v = torch.randn(4096, generator=gen), torch.randn(4096, generator=gen)
    sigma, sigma_next = OFFICIAL_TEACHER_AUDIO[step], OFFICIAL_TEACHER_AUDIO[step + 1]
    assert torch.equal(sch.euler_step(x, v, sigma, sigma_next), _official_update(x, v, sigma, sigma_next))
    for grid in (OFFICIAL_VIDEO, OFFICIAL_AUDIO):
        for s in range(3):
            want = _official_update(x, v, grid[s], grid[s + 1])
            assert torch.equal(sch.euler_step(x, v, grid[s], grid[s + 1]), want)
