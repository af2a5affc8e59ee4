"""FP8 (e4m3) linears for the DiT blocks: per-output-channel weight scales, per-token dynamic activation scales.

`quantize_linears` swaps the block linears (`blocks.N.attn.qkv_proj`, `attn.out_proj`, `mlp.fc1`, `mlp.fc2`) for
`FP8Linear`; the token refiner, the patch / condition projections, the AdaLN projections, the heads and the
boundary blocks named by the ignore patterns stay in BF16 (default: the first 2 and the last 3 blocks).

LoRA: quantise AFTER the adapter is installed by `services.dit.lora` (and after `merge_into_base`, if merged).
peft only wraps `nn.Linear`, so an `FP8Linear` cannot be a LoRA target; instead, for a target that peft already
wrapped, the `base_layer` inside the `LoraLayer` is swapped and the BF16 side branch (lora_A / lora_B) stays as it
is: unmerged, the student is FP8(W) x + scale * B(A x) and the teacher FP8(W) x; merged, the student is
FP8(W + scale * BA) x and the teacher subtracts scale * B(A x) from it. The original weight `Parameter` object is
reused for the FP8 data (its `.data` is replaced) and the BF16 copy is freed. `FP8Linear` and its GEMM live in
`services.common.fp8`. Knows nothing about checkpoints, attention or the runtime.
"""

from __future__ import annotations

import fnmatch
import logging
import re
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import nn

from services.common.fp8 import Fp8Error, relative_error, swap_linear

log = logging.getLogger(__name__)

BLOCK_SUFFIXES = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")
_BLOCK_TARGET = re.compile(r"^blocks\.(\d+)\.(attn\.qkv_proj|attn\.out_proj|mlp\.fc1|mlp\.fc2)$")


def default_ignore(num_layers: int, keep_first: int = 2, keep_last: int = 3) -> list[str]:
    """Patterns keeping the first `keep_first` and last `keep_last` blocks in BF16 (all of them if too few)."""
    keep = sorted(set(range(min(keep_first, num_layers))) | set(range(max(0, num_layers - keep_last), num_layers)))
    return [f"blocks.{i}.*" for i in keep]


def block_targets(model: nn.Module) -> list[str]:
    """Names of the block linears (not the refiner's) present on `model`, LoRA-wrapped or not."""
    names = [n for n, _ in model.named_modules() if _BLOCK_TARGET.match(n)]
    return sorted(names, key=lambda n: (int(n.split(".")[1]), BLOCK_SUFFIXES.index(n.split(".", 2)[2])))


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
        fp8 = swap_linear(model, name)
        report.bytes_after += fp8.weight.numel() + fp8.weight_scale.numel() * 4
        report.quantized.append(name)
    log.info("FP8: %d block linears quantised, %d kept in BF16 (%.1f -> %.1f MiB)", len(report.quantized),
             len(report.kept), report.bytes_before / 2**20, report.bytes_after / 2**20)
    return report


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
    each target linear's input (first `max_rows` rows) and BF16 output, then once after.
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
        with torch.no_grad():
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
        got = _flat_output(run(model))
    return Fp8ErrorReport(layers=layers, forward=relative_error(got, ref), quantize=report)
