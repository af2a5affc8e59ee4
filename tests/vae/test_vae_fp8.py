"""FP8 ViT linears of the video VAE decoder: which linears are swapped, decode error, refusals, the bench flag."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from diffusers import AutoencoderKLMiniMaxH3
from diffusers.models.modeling_utils import get_parameter_dtype
from torch import nn

from services.common.config import ModelConfig, Profile, VAEConfig
from services.common.fp8 import FP8_DTYPE, FP8Linear, Fp8Error
from services.vae.fp8 import (
    DECODER_BLOCK_SUFFIXES,
    AlreadyQuantized,
    Fp8Unsupported,
    decoder_block_linears,
    quantize_video_decoder,
    require_fp8_device,
)
from services.vae.model import VIDEO_PRESETS, VideoDecoder
from services.vae.service import VAEService

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parents[2]


def _vae(num_layers: int = 4, seed: int = 0) -> AutoencoderKLMiniMaxH3:
    """Tiny video VAE with `num_layers` ViT blocks; constant parameters (zero gates, biases) get noise."""
    torch.manual_seed(seed)
    vae = AutoencoderKLMiniMaxH3(**dict(VIDEO_PRESETS["tiny"], decoder_num_layers=num_layers))
    with torch.no_grad():
        for param in vae.parameters():
            flat = param.flatten()
            if param.numel() > 1 and bool((flat == flat[0]).all()):
                param.add_(0.2 * torch.randn_like(param))
    return vae.eval()


def _names(blocks) -> list[str]:
    return [f"transformer_blocks.{b}.{s}" for b in blocks for s in DECODER_BLOCK_SUFFIXES]


def test_swap_quantises_inner_block_linears_only():
    vae = _vae(4)
    shapes = {n: tuple(vae.decoder.get_submodule(n).weight.shape) for n in decoder_block_linears(vae)}
    assert list(shapes) == _names(range(4))
    untouched = {n: m for n, m in vae.named_modules() if not n.startswith("decoder.transformer_blocks")}

    report = quantize_video_decoder(vae)

    assert report.quantized == _names([1, 2]) and report.kept == _names([0, 3])
    fp8 = {n for n, m in vae.decoder.named_modules() if isinstance(m, FP8Linear)}
    assert fp8 == set(report.quantized)
    for name in report.quantized:
        layer = vae.decoder.get_submodule(name)
        assert layer.weight.dtype == FP8_DTYPE and (layer.out_features, layer.in_features) == shapes[name]
    for name in report.kept:
        assert type(vae.decoder.get_submodule(name)) is nn.Linear
    for name, module in vae.named_modules():  # convs, proj_in / proj_out, norms: the same objects as before
        if not name.startswith("decoder.transformer_blocks"):
            assert untouched[name] is module
    assert report.bytes_before == sum(4 * shapes[n][0] * shapes[n][1] for n in report.quantized)  # float32 weights
    assert report.bytes_after == sum(shapes[n][0] * shapes[n][1] + 4 * shapes[n][0] for n in report.quantized)

    everything = quantize_video_decoder(_vae(4), keep_first=0, keep_last=0)
    assert everything.quantized == _names(range(4)) and everything.kept == []


def test_decode_after_fp8_stays_close_and_keeps_the_compute_dtype():
    vae = _vae(4)
    decoder = VideoDecoder(vae)
    latents = torch.randn(12, 24, 4, 6, generator=torch.Generator().manual_seed(1))
    ref = decoder.decode_pixels(latents)  # [39, 64, 96, 3] in [0, 1]

    quantize_video_decoder(vae)
    for block in vae.decoder.transformer_blocks:  # the block casts its activations to this dtype
        assert get_parameter_dtype(block.attn.to_q) == torch.float32
    got = decoder.decode_pixels(latents)

    assert got.shape == ref.shape and got.dtype == ref.dtype
    diff = (got - ref).abs()
    assert not torch.equal(got, ref)  # the FP8 layers really ran
    # measured: max 3.3e-3, mean 3.7e-4 on this seed (RGB std 0.14)
    assert diff.max().item() < 2e-2 and diff.mean().item() < 2e-3


def test_refusals():
    vae = _vae(4)
    quantize_video_decoder(vae)
    with pytest.raises(AlreadyQuantized, match="already quantised"):
        quantize_video_decoder(vae)

    bad = _vae(4)
    bad.decoder.transformer_blocks[2].attn.to_v = nn.Linear(32, 24)
    with pytest.raises(Fp8Error, match=r"transformer_blocks\.2\.attn\.to_v is \[24, 32\].*divisible by 16"):
        quantize_video_decoder(bad)
    assert not any(isinstance(m, FP8Linear) for m in bad.modules())  # checked before any swap

    with pytest.raises(Fp8Error, match="keep_first=-1"):
        quantize_video_decoder(_vae(2), keep_first=-1)
    with pytest.raises(Fp8Error, match="no ViT decoder"):
        quantize_video_decoder(nn.Linear(16, 16))


def test_config_and_service_refuse_fp8_without_cuda_fp8(tmp_path):
    with pytest.raises(ValueError, match=r"vae\.fp8=true with vae\.device='cpu'.*CUDA"):
        VAEConfig(device="cpu", fp8=True)
    with pytest.raises(ValueError, match="vae.fp8"):
        VAEConfig(device="cuda", fp8="yes")
    assert VAEConfig().fp8 is False
    with pytest.raises(Fp8Unsupported, match="compute capability >= 8.9"):
        require_fp8_device(torch.device("cpu"))
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA: the service check below needs a host without FP8 GEMMs")
    profile = Profile(name="t", model=ModelConfig(preset="tiny", dir=str(tmp_path / "missing")),
                      vae=VAEConfig(device="cuda", fp8=True))
    service = VAEService(profile)
    with pytest.raises(Fp8Unsupported, match="vae.fp8: false"):  # raised before looking for weights
        service.start()
    assert service.video is None


def test_bench_decode_fp8_smoke():
    cmd = [sys.executable, "-m", "services.vae.bench_decode", "--preset", "tiny", "--device", "cpu",
           "--height", "192", "--width", "320", "--repeats", "1", "--warmup", "0", "--fp8", "--fp8-keep", "0"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    line = next(line for line in out.stdout.splitlines() if line.startswith("new+fp8 vs new"))
    assert "12 ViT linears in FP8, 0 kept" in line
    max_diff = float(line.split("max |diff| ")[1].split(",")[0])
    assert 0 < max_diff < 5e-2
    assert any(line.startswith("later (10 latents)") and " new+fp8 " in line for line in out.stdout.splitlines())
