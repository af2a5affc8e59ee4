"""Rectified-flow sampling schedule: shifted sigma grids, the sampled states and the Euler update.

x_t = (1 - sigma) x0 + sigma * noise; the model predicts v with x0_hat = x_t + sigma * v and receives
t = 1 - sigma. Knows nothing about the model, layouts or the streaming loop.
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


def shift_sigma(sigma: float, shift: float) -> float:
    """Time shift sigma' = s * sigma / (1 + (s - 1) * sigma)."""
    return shift * sigma / (1.0 + (shift - 1.0) * sigma)


def shifted_grid(num_points: int, shift: float) -> tuple[float, ...]:
    """`num_points` sigmas from 1 to 0 (linear), each time-shifted by `shift`."""
    if num_points < 2:
        raise ValueError(f"num_points={num_points} must be >= 2")
    return tuple(shift_sigma(1.0 - i / (num_points - 1), shift) for i in range(num_points))


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


def model_t(sigma: float) -> float:
    """The timestep the model receives: t = 1 - sigma."""
    return 1.0 - sigma


def predict_x0(x: torch.Tensor, v: torch.Tensor, sigma: float) -> torch.Tensor:
    """x0_hat = x_t + sigma * v (float32)."""
    return x.float() + sigma * v.float()


def euler_step(x: torch.Tensor, v: torch.Tensor, sigma: float, sigma_next: float) -> torch.Tensor:
    """One Euler / DDIM-eta-0 step: x <- (sigma'/sigma) x + (1 - sigma'/sigma) x0_hat; returns x0_hat at sigma' = 0."""
    x0 = predict_x0(x, v, sigma)
    if sigma_next == 0.0:
        return x0
    r = sigma_next / sigma
    return r * x.float() + (1.0 - r) * x0
