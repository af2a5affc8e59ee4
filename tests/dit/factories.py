"""Tiny-model factories for the DiT tests: the tiny preset's args, random weights, adapters, runtimes, prompts.

Knows nothing about any one test. The defaults are the numbers the tests used when each file built its own
(weights seed 0, adapter seed 1, 16 text tokens), so a test that moves onto these gets the same tensors.
"""
from __future__ import annotations

from pathlib import Path

import torch

from services.dit.api import PromptUpdate, RuntimeConfig
from services.dit.model.lora import LoRAAdapter, write_random_adapter
from services.dit.model.network import PRESETS, DiT, ModelArgs, build_random
from services.dit.stream.runtime import DiTRuntime

TINY = PRESETS["tiny"]
"""2 blocks, 4 heads: N = 2 and N = 4 both divide the heads (Ulysses)"""


def tiny_model(device: str = "cpu", dtype: torch.dtype = torch.float32, *, args: ModelArgs = TINY,
               seed: int = 0) -> DiT:
    """Build the tiny DiT with random weights (seed 0 unless told)."""
    return build_random(args, device, dtype, seed=seed)


def tiny_adapter(out_dir: str | Path, *, args: ModelArgs = TINY, seed: int = 1, **kwargs) -> Path:
    """Write a random LoRA adapter for `args` into out_dir (seed 1 unless told); kwargs: rank, alpha."""
    return write_random_adapter(args, out_dir, seed=seed, **kwargs)


def tiny_runtime(adapter_dir: str | Path | None = None, *, model: DiT | None = None, **config) -> DiTRuntime:
    """A streaming runtime over `model` (a fresh tiny_model() if None), with the adapter in adapter_dir if given.

    config: RuntimeConfig.for_preset("tiny", ...) keywords; max_text_tokens defaults to 16.
    """
    model = tiny_model() if model is None else model
    runtime_config = RuntimeConfig.for_preset("tiny", **{"max_text_tokens": 16, **config})
    adapter = None if adapter_dir is None else LoRAAdapter.load(model, adapter_dir)
    return DiTRuntime(model, runtime_config, adapter)


def tiny_embedding(tokens: int, seed: int) -> torch.Tensor:
    """A [tokens, text_dim] text embedding drawn from its own generator."""
    # e: [T, C]
    return torch.randn(tokens, TINY.text_dim, generator=torch.Generator().manual_seed(seed))


def tiny_prompt(seed: int, event_id: str, tokens: int = 6) -> PromptUpdate:
    """A prompt update with a tiny_embedding(tokens, seed)."""
    return PromptUpdate(tiny_embedding(tokens, seed), event_id)
