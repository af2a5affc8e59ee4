"""Which of the tiny DiT's weights the student trains: a fresh LoRA on every target, and of the base either
nothing, all of it (`--train-base`) or only what video rows read (`--video-weights`), which leaves the audio
teacher, the base with the LoRA off, exactly as it was loaded (`tools.train.student`)."""
from __future__ import annotations

import math

import torch

from services.dit.model.layout import TAG_VIDEO
from services.dit.model.lora import AdapterSpec, LoRAAdapter, lora_targets
from services.dit.model.network import DiT


def student_adapter(model: DiT, rank: int, seed: int) -> LoRAAdapter:
    """A fresh LoRA on every target of `model`, trainable: A random, B zero (so it starts as the base model)."""
    gen = torch.Generator().manual_seed(seed)
    factors = {t: (torch.randn(rank, fan_in, generator=gen) / math.sqrt(fan_in), torch.zeros(fan_out, rank))
               for t, (fan_in, fan_out) in lora_targets(model.args).items()}
    adapter = LoRAAdapter(model, AdapterSpec(rank, float(rank), factors), dtype=torch.float32)
    for layer in adapter.layers.values():
        for mod in layer.lora_A.values():
            mod.requires_grad_(True)
        for mod in layer.lora_B.values():
            mod.requires_grad_(True)
    return adapter


def adapter_spec(adapter: LoRAAdapter, weights: dict[str, torch.Tensor]) -> AdapterSpec:
    """The adapter's factors as held in `weights` (a state dict of the model, e.g. the EMA's)."""
    factors = {}
    for target in adapter.layers:
        a = weights[f"{target}.lora_A.taomate.weight"].float().cpu()
        b = weights[f"{target}.lora_B.taomate.weight"].float().cpu()
        factors[target] = (a.contiguous(), b.contiguous())
    return AdapterSpec(adapter.spec.rank, adapter.spec.alpha, factors)


def is_lora(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def set_trainable(model: DiT, train_base: bool, video: frozenset[str] = frozenset()) -> None:
    """The LoRA factors trainable, and the base weights when `train_base`, else those named in `video` (the
    adapter's on/off switch freezes its layers, so this runs again before every student forward)."""
    for name, p in model.named_parameters():
        p.requires_grad_(is_lora(name) or train_base or name in video)


def base_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The base model's own state dict from that of the model with the LoRA installed (peft's `base_layer` names)."""
    return {k.replace(".base_layer.", "."): v for k, v in weights.items() if not is_lora(k)}


VIDEO_ONLY = ("video_patch_proj.weight", "video_patch_proj.bias", "final_layer.video_out.weight",
              "final_layer.video_out.bias")


def video_only_weights(model: DiT) -> dict[str, slice | None]:
    """The base's weights that only video rows read, name -> the rows of the tensor (None: all of it): the video
    patch projection and output, and in each block the AdaLN projection's rows for the video tag (its output is
    [modality, 6, hidden] a timestep, picked by `PackedLayout.adaln_rows`). An audio teacher document has no video
    rows, so these can learn while the audio teacher (the base, LoRA off) stays the base's to the bit."""
    width = 6 * model.args.hidden_size
    rows = slice(TAG_VIDEO * width, (TAG_VIDEO + 1) * width)
    weights: dict[str, slice | None] = dict.fromkeys(VIDEO_ONLY)
    for i in range(model.args.num_layers):
        weights[f"blocks.{i}.adaln_proj.linear.weight"] = weights[f"blocks.{i}.adaln_proj.linear.bias"] = rows
    return weights


def hold_shared_rows(model: DiT) -> None:
    """Drop the gradients of the rows of `video_only_weights`' tensors that modulate text and audio, so that
    training those tensors moves their video rows alone (AdamW without weight decay leaves a weight whose gradient
    is always zero exactly as it was)."""
    params = dict(model.named_parameters())
    for name, rows in video_only_weights(model).items():
        if rows is not None:
            keep = torch.zeros(params[name].shape[0], device=params[name].device)
            keep[rows] = 1.0
            keep = keep.view(-1, *([1] * (params[name].dim() - 1)))  # [out, 1] for a weight, [out] for a bias
            params[name].register_hook(lambda grad, keep=keep: grad * keep)
