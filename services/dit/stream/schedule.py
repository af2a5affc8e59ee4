"""Rectified-flow sampling schedule: shifted sigma grids, the sampled states and the Euler update.

x_t = (1 - sigma) x0 + sigma * noise; the model predicts v with x0_hat = x_t + sigma * v and receives
t = 1 - sigma. As the official sampler, everything is float32: the grids are a float32 linspace shifted in float32,
and the Euler coefficients are float32 (sigma as recovered from the float32 t, the ratio sigma'/sigma divided in
float32), so the states match it bitwise. Knows nothing about the model, layouts or the streaming loop.
"""

from __future__ import annotations

import torch

VIDEO_SHIFT = 12.0
AUDIO_SHIFT = 3.0
STUDENT_GRID = 50
STUDENT_STATES = (0, 16, 33, 49)
TEACHER_GRID = 10
TEACHER_SHIFT = 3.0
TEACHER_MILESTONES = (3, 6, 9)
"""Teacher states that overwrite the student's audio after student steps 1, 2 and 3."""


def _f32(x: float) -> float:
    """`x` rounded to float32. An operation on float32 values done in float64 and rounded gives the float32 result."""
    return float(torch.tensor(x, dtype=torch.float32))


def shifted_grid(num_points: int, shift: float) -> tuple[float, ...]:
    """`num_points` sigmas from 1 to 0 (a float32 linspace), each time-shifted in float32:
    sigma' = s * sigma / (1 + (s - 1) * sigma)."""
    if num_points < 2:
        raise ValueError(f"num_points={num_points} must be >= 2")
    base = torch.linspace(1.0, 0.0, num_points, dtype=torch.float32)
    return tuple(float(s) for s in shift * base / (1.0 + (shift - 1.0) * base))


def student_sigmas(shift: float) -> tuple[float, ...]:
    """Sigmas of the student's 4 states (0, 16, 33, 49) on the 50-point grid with `shift`."""
    grid = shifted_grid(STUDENT_GRID, shift)
    return tuple(grid[s] for s in STUDENT_STATES)


VIDEO_SIGMAS = student_sigmas(VIDEO_SHIFT)
"""1 -> 0.9612 -> 0.8533 -> 0."""
AUDIO_SIGMAS = student_sigmas(AUDIO_SHIFT)
"""1 -> 0.8609 -> 0.5926 -> 0."""
TEACHER_SIGMAS = shifted_grid(TEACHER_GRID, TEACHER_SHIFT)
"""10 states, 9 Euler steps."""
TEACHER_TEXT_SIGMAS = shifted_grid(TEACHER_GRID, VIDEO_SHIFT)
"""The teacher's video clock (10 states, shift 12), which its text rows take: as in every forward, text rows run at
the video timestep, though the teacher's document has no video."""


def model_t(sigma: float) -> float:
    """The timestep the model receives: t = 1 - sigma."""
    return 1.0 - sigma


def predict_x0(x: torch.Tensor, v: torch.Tensor, sigma: float) -> torch.Tensor:
    """x0_hat = x_t + sigma * v (float32), sigma as the model's float32 t = 1 - sigma gives it back."""
    return x.float() + _f32(1.0 - _f32(1.0 - sigma)) * v.float()


def euler_step(x: torch.Tensor, v: torch.Tensor, sigma: float, sigma_next: float) -> torch.Tensor:
    """One Euler / DDIM-eta-0 step: x <- r x + (1 - r) x0_hat with r = sigma'/sigma, both coefficients float32;
    returns x0_hat at sigma' = 0."""
    x0 = predict_x0(x, v, sigma)
    if sigma_next == 0.0:
        return x0
    r = _f32(_f32(sigma_next) / _f32(sigma))
    return r * x.float() + _f32(1.0 - r) * x0
