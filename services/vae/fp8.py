"""FP8 (e4m3) linears for the video VAE's ViT decoder: which linears are swapped, and the device check.

`quantize_video_decoder` swaps the linears of the transformer blocks of `AutoencoderKLMiniMaxH3.decoder`
(`transformer_blocks.N.attn.to_q / to_k / to_v / to_out.0` and the SwiGLU feed-forward `ff.net.0.proj`, `ff.net.2`)
for `services.common.fp8.FP8Linear`; the first and last `keep_first` / `keep_last` blocks stay in their dtype, and so
does everything outside the blocks: the CNN encoder, `post_quant_conv`, the ViT's `proj_in` / `proj_out`, norms,
rotary tables and register tokens. The swap happens in place and once: a decoder holding any `FP8Linear` is refused.

Knows nothing about tiling, streaming state, services or configuration files.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

import torch
from diffusers import AutoencoderKLMiniMaxH3
from torch import nn

from services.common.fp8 import FP8Linear, Fp8Error, scaled_mm_supported

log = logging.getLogger(__name__)

DECODER_BLOCK_SUFFIXES = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "ff.net.0.proj", "ff.net.2")
_TARGET = re.compile(r"^transformer_blocks\.(\d+)\.(" + "|".join(re.escape(s) for s in DECODER_BLOCK_SUFFIXES) + r")$")


class AlreadyQuantized(Fp8Error):
    """The video decoder already holds FP8 linears; quantising twice would quantise FP8 data again."""


class Fp8Unsupported(Fp8Error):
    """FP8 was asked for on a device without FP8 GEMMs (needs CUDA, compute capability >= 8.9)."""


@dataclass
class VaeFp8Report:
    """What `quantize_video_decoder` did; names are relative to `vae.decoder`."""

    quantized: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    """Block linears of the boundary blocks (stay in the VAE dtype)."""
    bytes_before: int = 0
    """Weight bytes of the quantised linears before the swap."""
    bytes_after: int = 0
    """FP8 weight + float32 scale bytes of the same linears after the swap."""


def decoder_block_linears(vae: AutoencoderKLMiniMaxH3) -> list[str]:
    """Return the names (under `vae.decoder`) of the ViT block linears, in block then layer order."""
    found = [(int(m.group(1)), DECODER_BLOCK_SUFFIXES.index(m.group(2)), name)
             for name, _ in vae.decoder.named_modules() if (m := _TARGET.match(name))]
    return [name for _, _, name in sorted(found)]


def require_fp8_device(device: torch.device) -> None:
    """Raise Fp8Unsupported unless `device` runs `torch._scaled_mm` (CUDA, compute capability >= 8.9)."""
    if not scaled_mm_supported(device):
        where = "a non-CUDA device" if device.type != "cuda" else "a CUDA device below compute capability 8.9"
        raise Fp8Unsupported(f"FP8 video decoder linears need CUDA with compute capability >= 8.9, got {device} "
                             f"({where}); set vae.fp8: false or move vae.device to an H100/H200-class GPU")


def _keep_compute_dtype(fp8: FP8Linear) -> None:
    """Register the bias before the e4m3 weight, so diffusers reads the block's compute dtype from the bias.

    `MiniMaxH3VideoTransformerBlock.forward` casts its normed activations to `get_parameter_dtype(self.attn.to_q)`,
    the dtype of the first floating parameter; with the weight first that would be float8_e4m3fn.
    """
    if fp8.bias is not None:
        fp8._parameters = {"bias": fp8._parameters["bias"],
                           **{k: v for k, v in fp8._parameters.items() if k != "bias"}}


def quantize_video_decoder(vae: AutoencoderKLMiniMaxH3, keep_first: int = 1, keep_last: int = 1) -> VaeFp8Report:
    """Swap the ViT decoder's block linears for `FP8Linear`s in place, keeping the boundary blocks as they are."""
    decoder = getattr(vae, "decoder", None)
    blocks = getattr(decoder, "transformer_blocks", None)
    if not isinstance(blocks, nn.ModuleList):
        raise Fp8Error(f"{type(vae).__name__} has no ViT decoder (`decoder.transformer_blocks`)")
    for what, value in (("keep_first", keep_first), ("keep_last", keep_last)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise Fp8Error(f"{what}={value!r}: must be an int >= 0")
    fp8_names = [name for name, m in decoder.named_modules() if isinstance(m, FP8Linear)]
    if fp8_names:
        raise AlreadyQuantized(f"the video decoder is already quantised ({len(fp8_names)} FP8 linears, e.g. "
                               f"{fp8_names[0]}); build or load the VAE again to change the FP8 layout")
    num = len(blocks)
    kept_blocks = set(range(min(keep_first, num))) | set(range(max(0, num - keep_last), num))
    report = VaeFp8Report()
    targets = []
    for name in decoder_block_linears(vae):
        if int(name.split(".")[1]) in kept_blocks:
            report.kept.append(name)
            continue
        linear = decoder.get_submodule(name)
        if type(linear) is not nn.Linear:
            raise Fp8Error(f"decoder.{name} is a {type(linear).__name__}, not an nn.Linear")
        n, k = linear.weight.shape
        if n % 16 or k % 16:  # checked for all targets before any swap, so a refusal leaves the VAE untouched
            raise Fp8Error(f"decoder.{name} is [{n}, {k}]: FP8 GEMMs need in and out features divisible by 16")
        if name.endswith("attn.to_q") and linear.bias is None:
            raise Fp8Error(f"decoder.{name} has no bias: its block would take e4m3 as its compute dtype (see "
                           "_keep_compute_dtype)")
        targets.append(name)
    for name in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = decoder.get_submodule(parent_name)
        linear = getattr(parent, attr)  # also an nn.ModuleList index ("to_out.0"): modules are keyed by str
        report.bytes_before += linear.weight.numel() * linear.weight.element_size()
        fp8 = FP8Linear.from_linear(linear)
        _keep_compute_dtype(fp8)
        setattr(parent, attr, fp8)
        report.bytes_after += fp8.weight.numel() * fp8.weight.element_size() + fp8.weight_scale.numel() * 4
        report.quantized.append(name)
    log.info("video VAE FP8: %d ViT block linears quantised, %d kept (%.1f -> %.1f MiB)", len(report.quantized),
             len(report.kept), report.bytes_before / 2**20, report.bytes_after / 2**20)
    return report
