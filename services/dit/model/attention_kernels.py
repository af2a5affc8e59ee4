"""The attention kernels of a DiT process: `dit.attention` picks them once per process (`prefer_attention_kernels`),
and every attention call of the model goes through `sdpa_rows`.

- "default": torch's SDPA, in its own order; "cudnn": SDPA with cuDNN's attention first, the others as fallbacks for
  inputs it cannot take.
- "fa4": FlashAttention 4 (`flash_attn.cute`, CuTe DSL kernels compiled at first use) for every unmasked attention
  on CUDA in 16-bit floats outside compiled regions; SDPA, cuDNN first, for the rest (masked keys, CPU, float32).
torch keeps the SDPA order in process-global state, so each DiT rank sets it for itself. Knows nothing about the
model, sessions or the KV cache.
"""
from __future__ import annotations

import warnings
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

_CUDNN_FIRST = (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                SDPBackend.MATH)
SDPA_ORDERS = {"default": None, "cudnn": _CUDNN_FIRST, "fa4": _CUDNN_FIRST}
"""`dit.attention` -> the order this process tries SDPA kernels in (None: torch's own choice). The kernels after
the first are fallbacks for inputs it cannot take. With `fa4`, SDPA serves the calls FlashAttention 4 does not take
(masked keys, CPU tensors, float32)."""
_HELD_SDPA_ORDERS: list = []
_FLASH_ATTENTION_4: list[Callable[..., tuple[torch.Tensor, torch.Tensor]]] = []
"""FlashAttention 4's forward, once `prefer_attention_kernels("fa4")` loaded it in this process."""


def load_flash_attention_4() -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """FlashAttention 4's forward (`flash_attn.cute.flash_attn_func`, CuTe DSL kernels compiled at first use)."""
    # its argument adapter warns once per compiled kernel about an argument it passes at compile time anyway
    warnings.filterwarnings("ignore", message="Argument aux_data .* cannot be converted to a JitArgument")
    try:
        from flash_attn.cute import flash_attn_func
    except ImportError as e:  # also a CuTe DSL that does not load
        raise RuntimeError(f"dit.attention: fa4 needs FlashAttention 4 (the flash_attn.cute package: flash-attn-4 and "
                           f"nvidia-cutlass-dsl, as deploy/Dockerfile installs them), which does not import here "
                           f"({e}); install it or set dit.attention: cudnn") from e
    return flash_attn_func


def prefer_attention_kernels(name: str) -> None:
    """Make `name` (a `dit.attention` value) the attention kernels of this whole process (every thread), for good.

    Sets the SDPA kernel order `SDPA_ORDERS[name]`, which torch keeps in process-global state, so each DiT rank calls
    this for itself; `fa4` also loads FlashAttention 4 for `sdpa_rows`' unmasked CUDA calls.
    """
    if name not in SDPA_ORDERS:
        raise ValueError(f"unknown attention kernels {name!r}: use one of {sorted(SDPA_ORDERS)}")
    if name == "fa4" and not _FLASH_ATTENTION_4:
        _FLASH_ATTENTION_4.append(load_flash_attention_4())
    if SDPA_ORDERS[name] is not None:
        held = sdpa_kernel(list(SDPA_ORDERS[name]), set_priority=True)
        held.__enter__()  # never exited; kept referenced, as collecting the context would restore the old order
        _HELD_SDPA_ORDERS.append(held)


def sdpa_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor | None = None
              ) -> torch.Tensor:
    """Attention of q rows over k/v rows; keys where `key_valid` is False take no part (`[Sk]`: for every row,
    `[Sq, Sk]`: for each row its own)."""
    # q: [Sq, H, D], k/v: [Sk, H, D], key_valid: [Sk] or [Sq, Sk] bool -> [Sq, H, D]
    if (_FLASH_ATTENTION_4 and key_valid is None and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)
            and q.shape[0] and k.shape[0] and not torch.compiler.is_compiling()):
        # [1, S, H, D] views (FlashAttention 4 needs only the last dim contiguous) -> out [1, Sq, H, D]
        return _FLASH_ATTENTION_4[0](q[None], k[None], v[None])[0][0]
    # 4-D [1, H, S, D] views (last dim contiguous) so the flash / memory-efficient kernels apply
    mask = None if key_valid is None else torch.atleast_2d(key_valid)[None, None]  # [1, 1, 1 or Sq, Sk]
    out = F.scaled_dot_product_attention(q[None].transpose(1, 2), k[None].transpose(1, 2), v[None].transpose(1, 2),
                                         attn_mask=mask)
    return out.transpose(1, 2)[0]
