"""FP8 (e4m3) linears: per-output-channel weight scales, per-token dynamic activation scales.

`FP8Linear` replaces an `nn.Linear` in place (`swap_linear`); which linears a model quantises is its own module's
business (`services.dit.fp8` for the DiT blocks, `services.encoder.model` for the text stack).

GEMM: `torch._scaled_mm(x_fp8 [M, K] row-major, w_fp8.t() [K, N] column-major, scale_a [M, 1] fp32,
scale_b [1, N] fp32, out_dtype=bf16)` on CUDA devices of compute capability >= 8.9; elsewhere (CPU tests) a
reference path dequantises both operands and multiplies in float32, so the quantisation math is the same.
"""

from __future__ import annotations

import torch
from torch import nn

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
_MIN_AMAX = 1e-12


class Fp8Error(ValueError):
    """FP8 quantisation was asked for something it cannot do (bad shape, bad pattern, unsupported weight)."""


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric e4m3 quantisation with one scale per row (amax / 448)."""
    # x: [R, K] -> q: [R, K] float8_e4m3fn, scale: [R, 1] float32 with x ~= q * scale
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp_min(_MIN_AMAX)
    scale = amax / FP8_MAX
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).contiguous()  # row-major for _scaled_mm
    return q, scale


def scaled_mm_supported(device: torch.device) -> bool:
    """True where `torch._scaled_mm` with row-wise scales runs: CUDA, compute capability >= 8.9."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


class FP8Linear(nn.Module):
    """y = x W^T (+ b) with W in e4m3 and one scale per output channel; x quantised per token at run time."""

    def __init__(self, weight: nn.Parameter, weight_scale: torch.Tensor, bias: nn.Parameter | None):
        super().__init__()
        # weight: [N, K] float8_e4m3fn; weight_scale: [1, N] float32 (the `scale_b` of _scaled_mm)
        self.out_features, self.in_features = weight.shape
        self.weight = weight
        self.register_buffer("weight_scale", weight_scale, persistent=True)
        self.bias = bias
        self.backend = "scaled_mm" if scaled_mm_supported(weight.device) else "reference"
        """"scaled_mm" where the weight's device runs it (decided once: the DiT is built on its device), else the
        dequantising "reference" path; tests may force "reference"."""

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "FP8Linear":
        """Quantise `linear` in place of its weight Parameter (same object, FP8 data) and wrap it."""
        if not isinstance(linear, nn.Linear):
            raise Fp8Error(f"FP8Linear.from_linear needs an nn.Linear, got {type(linear).__name__}")
        n, k = linear.weight.shape
        if n % 16 or k % 16:
            raise Fp8Error(f"linear [{n}, {k}]: FP8 GEMMs need in and out features divisible by 16")
        param = linear.weight
        with torch.no_grad():
            q, scale = quantize_rows(param.data)  # q: [N, K], scale: [N, 1]
        param.data = q
        param.requires_grad_(False)
        return cls(param, scale.reshape(1, n).contiguous(), linear.bias)

    def dequantized_weight(self) -> torch.Tensor:
        """[N, K] float32 weight the FP8 data stands for."""
        self._check_weight()
        return self.weight.float() * self.weight_scale.reshape(-1, 1)

    def _check_weight(self) -> None:
        if self.weight.dtype != FP8_DTYPE:
            raise Fp8Error(f"FP8Linear holds a {self.weight.dtype} weight: something re-assigned `.weight` after "
                           "quantisation")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., K] -> [..., N] in x's dtype
        self._check_weight()
        if x.shape[-1] != self.in_features:
            raise Fp8Error(f"FP8Linear expects {self.in_features} input features, got shape {tuple(x.shape)}")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        xq, sx = quantize_rows(x2)  # [M, K] fp8, [M, 1] fp32; fused with its producer in a compiled block region
        if self.backend == "scaled_mm":
            out = torch._scaled_mm(xq, self.weight.t(), scale_a=sx, scale_b=self.weight_scale,
                                   out_dtype=torch.bfloat16)
        else:
            out = (xq.float() * sx) @ self.dequantized_weight().t()
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.to(x.dtype).reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weight=e4m3/channel"


def swap_linear(model: nn.Module, name: str) -> FP8Linear:
    """Replace the linear at `name` (or the base layer of the LoRA layer there) with an FP8Linear."""
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name)
    module = getattr(parent, attr)
    if isinstance(module, FP8Linear):
        raise Fp8Error(f"{name} is already FP8")
    base = getattr(module, "base_layer", None)
    if base is not None:  # peft LoraLayer: swap its base layer, keep the BF16 side branch
        if isinstance(base, FP8Linear):
            raise Fp8Error(f"{name} is already FP8")
        fp8 = FP8Linear.from_linear(base)
        module.base_layer = fp8
        return fp8
    fp8 = FP8Linear.from_linear(module)
    setattr(parent, attr, fp8)
    return fp8


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """||got - ref|| / ||ref|| in float32 (0 when both are zero)."""
    ref32, got32 = ref.float(), got.float()
    den = ref32.norm().item()
    num = (got32 - ref32).norm().item()
    return num / den if den > 0 else num
