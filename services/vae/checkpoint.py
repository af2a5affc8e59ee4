"""Video/audio VAE checkpoints in the diffusers layout of MiniMax-H3 (`vae/`, `audio_vae/`).

Knows nothing about decoding or streaming: it writes seeded random-weight checkpoints of a preset
(`config.json` + `diffusion_pytorch_model.safetensors`, sharded with an index when large, float32 like the release)
and loads either directory back through `diffusers`' `from_pretrained`, mapping failures to one named error.

The whole tree of a preset is written by `python -m services.checkpoints`. Never write `full` on a small host:
the video VAE alone is about 10.4 GB.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch
from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio
from torch import nn

from services.common.errors import InternalError
from services.vae.model import build_audio_vae, build_video_vae

logger = logging.getLogger(__name__)

VIDEO_SUBDIR = "vae"
AUDIO_SUBDIR = "audio_vae"


class VAECheckpointError(InternalError):
    """A VAE checkpoint directory is missing, malformed or does not match the expected class."""


def _randomise(model: nn.Module, gen: torch.Generator) -> None:
    """Replace the constant parts of the default init (zero gates, unit norms, zero tokens) with noise.

    The library zero-initialises the ViT residual gates (`scale1/scale2`), the register tokens and the biases, which
    would make a random decoder an identity in places and a parity test blind to them.
    """
    with torch.no_grad():
        for name, tensor in model.state_dict(keep_vars=True).items():
            if not tensor.is_floating_point() or name.endswith("zero_k_bias"):
                continue  # the audio attention's key bias is a frozen zero buffer in the real checkpoint
            first = tensor.flatten()[0]
            if tensor.numel() > 1 and bool((tensor == first).all()):
                tensor.add_(0.2 * torch.randn(tensor.shape, generator=gen))


def write_random_checkpoint(preset: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Write `out_dir/vae` and `out_dir/audio_vae` for `preset` with seeded random float32 weights."""
    root = Path(out_dir)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    for subdir, build in ((VIDEO_SUBDIR, build_video_vae), (AUDIO_SUBDIR, build_audio_vae)):
        model = build(preset)
        _randomise(model, gen)
        model.save_pretrained(str(root / subdir), safe_serialization=True)
        logger.info("wrote %s (%d tensors)", root / subdir, len(model.state_dict()))
        del model
    return root


def _load(cls, directory: Path, device: str | torch.device, dtype: torch.dtype):
    if not (directory / "config.json").is_file():
        raise VAECheckpointError(f"no config.json in {directory}")
    try:
        model = cls.from_pretrained(str(directory), torch_dtype=dtype)
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        raise VAECheckpointError(f"cannot load {cls.__name__} from {directory}: {exc}") from exc
    return model.to(device).eval()


def load_video_vae(path: str | Path, device: str | torch.device = "cpu",
                   dtype: torch.dtype = torch.float32) -> AutoencoderKLMiniMaxH3:
    """Load `path/vae`; `dtype` reaches the ViT block stack, the modules diffusers pins stay float32."""
    return _load(AutoencoderKLMiniMaxH3, Path(path) / VIDEO_SUBDIR, device, dtype)


def load_audio_vae(path: str | Path, device: str | torch.device = "cpu",
                   dtype: torch.dtype = torch.float32) -> AutoencoderKLMiniMaxH3Audio:
    """Load `path/audio_vae` (diffusers keeps its decoder in float32 whatever `dtype` says)."""
    return _load(AutoencoderKLMiniMaxH3Audio, Path(path) / AUDIO_SUBDIR, device, dtype)
