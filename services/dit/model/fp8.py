"""FP8 (e4m3) linears for the DiT blocks: per-output-channel weight scales, per-token dynamic activation scales.

`quantize_linears` swaps the block linears (`blocks.N.attn.qkv_proj`, `attn.out_proj`, `mlp.fc1`, `mlp.fc2`) for
`FP8Linear`; the token refiner, the patch / condition projections, the AdaLN projections, the heads and the
boundary blocks named by the ignore patterns stay in BF16 (default: the first 2 and the last 3 blocks).

LoRA: quantise AFTER the adapter is installed by `services.dit.model.lora` (and after `merge_into_base`, if merged).
peft only wraps `nn.Linear`, so an `FP8Linear` cannot be a LoRA target; instead, for a target that peft already
wrapped, the `base_layer` inside the `LoraLayer` is swapped and the BF16 side branch (lora_A / lora_B) stays as it
is: unmerged, the student is FP8(W) x + scale * B(A x) and the teacher FP8(W) x; merged, the student is
FP8(W + scale * BA) x and the teacher subtracts scale * B(A x) from it. The original weight `Parameter` object is
reused for the FP8 data (its `.data` is replaced) and the BF16 copy is freed.

GEMM: `torch._scaled_mm(x_fp8 [M, K] row-major, w_fp8.t() [K, N] column-major, scale_a [M, 1] fp32,
scale_b [1, N] fp32, out_dtype=bf16)` on CUDA devices of compute capability >= 8.9; elsewhere (CPU tests) a
reference path dequantises both operands and multiplies in float32, so the quantisation math is the same.
Knows nothing about checkpoints, attention or the runtime.
"""

from __future__ import annotations

import fnmatch
import logging
import re
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import nn

from services.common.errors import InternalError

log = logging.getLogger(__name__)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
BLOCK_SUFFIXES = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")
_BLOCK_TARGET = re.compile(r"^blocks\.(\d+)\.(attn\.qkv_proj|attn\.out_proj|mlp\.fc1|mlp\.fc2)$")
_MIN_AMAX = 1e-12


class Fp8Error(InternalError):
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


def default_ignore(num_layers: int, keep_first: int = 2, keep_last: int = 3) -> list[str]:
    """Patterns keeping the first `keep_first` and last `keep_last` blocks in BF16 (all of them if too few)."""
    keep = sorted(set(range(min(keep_first, num_layers))) | set(range(max(0, num_layers - keep_last), num_layers)))
    return [f"blocks.{i}.*" for i in keep]


def block_targets(model: nn.Module) -> list[str]:
    """Names of the block linears (not the refiner's) present on `model`, LoRA-wrapped or not."""
    names = [n for n, _ in model.named_modules() if _BLOCK_TARGET.match(n)]
    return sorted(names, key=lambda n: (int(n.split(".")[1]), BLOCK_SUFFIXES.index(n.split(".", 2)[2])))


def _swap(model: nn.Module, name: str) -> FP8Linear:
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


@dataclass
class QuantizeReport:
    """What `quantize_linears` did."""

    quantized: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    """Block linears matched by an ignore pattern (stay BF16)."""
    bytes_before: int = 0
    bytes_after: int = 0


def quantize_linears(model: nn.Module, ignore: Sequence[str] | None = None) -> QuantizeReport:
    """Swap the block linears not matched by an `ignore` fnmatch pattern for `FP8Linear`s.

    `ignore=None` uses `default_ignore(len(model.blocks))`. Install LoRA before calling this.
    """
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        raise Fp8Error(f"{type(model).__name__} has no `blocks`: not a DiT")
    patterns = default_ignore(len(blocks)) if ignore is None else list(ignore)
    for p in patterns:
        if not isinstance(p, str) or not p:
            raise Fp8Error(f"ignore pattern {p!r} must be a non-empty string")
    report = QuantizeReport()
    for name in block_targets(model):
        if any(fnmatch.fnmatchcase(name, p) for p in patterns):
            report.kept.append(name)
            continue
        module = model.get_submodule(name)
        w = getattr(module, "base_layer", module).weight
        report.bytes_before += w.numel() * w.element_size()
        fp8 = _swap(model, name)
        report.bytes_after += fp8.weight.numel() + fp8.weight_scale.numel() * 4
        report.quantized.append(name)
    log.info("FP8: %d block linears quantised, %d kept in BF16 (%.1f -> %.1f MiB)", len(report.quantized),
             len(report.kept), report.bytes_before / 2**20, report.bytes_after / 2**20)
    return report


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """||got - ref|| / ||ref|| in float32 (0 when both are zero)."""
    ref32, got32 = ref.float(), got.float()
    den = ref32.norm().item()
    num = (got32 - ref32).norm().item()
    return num / den if den > 0 else num


@dataclass
class Fp8ErrorReport:
    """FP8 vs BF16 on the same inputs: per quantised layer and on the whole forward."""

    layers: dict[str, float]
    """Layer name -> relative error of FP8Linear(x) against the BF16 linear's output on the same captured x."""
    forward: float
    """Relative error of the full forward output (all returned tensors concatenated)."""
    quantize: QuantizeReport

    def worst_layer(self) -> tuple[str, float]:
        name = max(self.layers, key=self.layers.__getitem__)
        return name, self.layers[name]


def _flat_output(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out.detach().float().flatten()
    if isinstance(out, (tuple, list)) and out and all(isinstance(o, torch.Tensor) for o in out):
        return torch.cat([o.detach().float().flatten() for o in out])
    raise Fp8Error(f"the forward callable must return a tensor or a tuple of tensors, got {type(out).__name__}")


def fp8_error_report(model: nn.Module, run: Callable[[nn.Module], object], ignore: Sequence[str] | None = None,
                     max_rows: int = 1024) -> Fp8ErrorReport:
    """Quantise `model` (in place) and measure FP8 against BF16 on the same inputs.

    `run(model)` performs one forward and returns its output. It is called once before quantisation, capturing
    each target linear's input (first `max_rows` rows) and BF16 output, then once after. Both forwards run eagerly,
    compiled block regions included: the capture hooks would not fire inside code compiled before they were added.
    """
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        raise Fp8Error(f"{type(model).__name__} has no `blocks`: not a DiT")
    patterns = default_ignore(len(blocks)) if ignore is None else list(ignore)
    captured: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    hooks = []
    for name in block_targets(model):
        if any(fnmatch.fnmatchcase(name, p) for p in patterns):
            continue
        module = model.get_submodule(name)
        base = getattr(module, "base_layer", module)

        def hook(_mod, inputs, output, name=name):
            if name not in captured:
                x = inputs[0].reshape(-1, inputs[0].shape[-1])[:max_rows]
                captured[name] = (x.detach().clone(), output.reshape(-1, output.shape[-1])[:max_rows].detach().clone())
        hooks.append(base.register_forward_hook(hook))
    try:
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            ref = _flat_output(run(model))
    finally:
        for h in hooks:
            h.remove()
    report = quantize_linears(model, patterns)
    layers: dict[str, float] = {}
    with torch.no_grad():
        for name in report.quantized:
            if name not in captured:
                raise Fp8Error(f"{name} did not run during the forward; cannot measure its error")
            x, y_ref = captured[name]
            fp8 = getattr(model.get_submodule(name), "base_layer", model.get_submodule(name))
            layers[name] = relative_error(fp8(x), y_ref)
        with torch.compiler.set_stance("force_eager"):
            got = _flat_output(run(model))
    return Fp8ErrorReport(layers=layers, forward=relative_error(got, ref), quantize=report)
