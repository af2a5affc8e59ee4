"""Element-wise pieces of the DiT block in plain torch, and `cuda_compiled`, which compiles a block region on CUDA.

The pieces are the reference (run as they are on the CPU and in the parity tests). On CUDA a block's regions
(network.py: `qkv_projection`, `mlp_inputs`, `mlp_residual`) are compiled whole, so the pieces fuse with their
neighbours (AdaLN gather, FP8 activation quantisation, LoRA scale-and-add) and one region call replaces ~10 eager op
launches: eager, a forward's host-side dispatch cost ~125 ms on its own, more than the GPU work of a small phase.
Between the regions, Triton kernels finish the QKV projection and fc1 (`lora_kernels.py`); the QK-norm, RoPE and
SwiGLU here are their reference.
Knows nothing about modules or checkpoints.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch.fx.experimental import _config as fx_config


def cuda_compiled(eager: Callable) -> Callable:
    """`eager` on the CPU; on CUDA its torch.compile'd version (one graph, dynamic shapes, compiled on first use).

    The device is that of the first tensor argument; `.eager` is the plain function (tests compile it on the CPU).
    """
    compiled: Callable | None = None

    def run(*args):
        nonlocal compiled
        if not next(a for a in args if isinstance(a, torch.Tensor)).is_cuda:
            return eager(*args)
        if compiled is None:
            apply_compiler_settings()
            compiled = torch.compile(eager, dynamic=True, fullgraph=True)
        return compiled(*args)

    run.__name__, run.__doc__, run.eager = eager.__name__, eager.__doc__, eager
    return run


def apply_compiler_settings() -> None:
    """Process-wide compiler settings for the block regions, set before the first compile.

    Sizes that happen to be equal are traced as separate symbols (no "duck" sizing), so a start-up forward whose row
    counts coincide does not give a graph that a later phase fails and recompiles in the hot path; and each region
    may hold more variants than dynamo's default 8 (FP8 and BF16 blocks x LoRA on and off x one or several
    timesteps is already 8) before it would fall back to eager.
    """
    fx_config.use_duck_shape = False
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 32)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm with float32 statistics, result in x's dtype."""
    # x: [..., C]
    return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first R channels of every head; the rest pass through."""
    # x: [S, H, D]; cos/sin: [S, R] in x's dtype, R <= D
    r = cos.shape[-1]
    xr, xp = x[..., :r], x[..., r:]
    x1, x2 = xr.chunk(2, dim=-1)
    rot = torch.cat([-x2, x1], dim=-1)
    xr = xr * cos[:, None, :] + rot * sin[:, None, :]
    return torch.cat([xr, xp], dim=-1)


def norm_modulate(x: torch.Tensor, weight: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor,
                  eps: float) -> torch.Tensor:
    """AdaLN input: RMSNorm(x) * (1 + scale) + shift."""
    # x, shift, scale: [S, C]
    return rms_norm(x, weight, eps) * (1.0 + scale) + shift


def gated_residual(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x + gate * y."""
    return x + gate * y


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                 cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of q and k, then RoPE on both."""
    # q, k: [S, H, D]; cos/sin: [S, R]
    return apply_rope(rms_norm(q, q_weight, eps), cos, sin), apply_rope(rms_norm(k, k_weight, eps), cos, sin)


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of fc1's [gate | up] output."""
    # h: [S, 2F] -> [S, F]
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up
