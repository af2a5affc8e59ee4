"""Video/audio VAE wrappers: parity with the diffusers decoders, presets, checkpoint layout, input errors."""
import copy
import json
from pathlib import Path

import pytest
import torch
from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio
from safetensors import safe_open

from services.common.config import VAEConfig
from services.vae.checkpoint import VAECheckpointError, load_audio_vae, load_video_vae, write_random_checkpoint
from services.vae.model import (
    AUDIO_PRESETS,
    VIDEO_PRESETS,
    AudioDecoder,
    InvalidLatents,
    VideoDecoder,
    build_video_vae,
)

pytestmark = pytest.mark.cpu

REAL = Path(__file__).resolve().parents[3] / "shared/reference/checkpoints/MiniMax-H3"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return write_random_checkpoint("tiny", tmp_path_factory.mktemp("vae"), seed=5)


@pytest.fixture(scope="module")
def video(ckpt) -> VideoDecoder:
    return VideoDecoder(load_video_vae(ckpt))


@pytest.fixture(scope="module")
def audio(ckpt) -> AudioDecoder:
    return AudioDecoder(load_audio_vae(ckpt))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_video_decode_matches_diffusers(video):
    z = torch.randn(12, 24, 6, 8, generator=torch.Generator().manual_seed(0))
    vae = video.vae
    mean = torch.tensor(vae.config.latents_mean).view(1, 24, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, 24, 1, 1, 1)
    with torch.no_grad():
        sample = vae.decode(z.permute(1, 0, 2, 3)[None] * std + mean).sample[0]  # [3, N, H, W]
    imagenet_mean = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1, 1)
    imagenet_std = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1, 1)
    ref = (sample * imagenet_std + imagenet_mean).clamp(0, 1).permute(1, 2, 3, 0)
    ours = video.decode_pixels(z)
    assert ours.shape == (39, 96, 128, 3)
    assert _rel(ours, ref) < 1e-6
    assert ours.std() > 0.05  # random weights give a non-trivial picture, so the comparison means something
    frames = video.decode(z)
    assert frames.dtype == torch.uint8 and frames.shape == (39, 96, 128, 3)
    assert (frames.float() - ours * 255).abs().max() <= 0.5 + 1e-4


def _diffusers_pixels(vae, z: torch.Tensor) -> torch.Tensor:
    """The pre-batching path: `vae.decode` (one ViT call per tile per clip) + the wrapper's post-processing."""
    mean = torch.tensor(vae.config.latents_mean).view(1, 24, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, 24, 1, 1, 1)
    with torch.no_grad():
        sample = vae.decode(z.permute(1, 0, 2, 3)[None] * std + mean).sample[0]  # [3, N, H, W]
    imagenet_mean = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1, 1)
    imagenet_std = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1, 1)
    return (sample * imagenet_std + imagenet_mean).clamp(0, 1).permute(1, 2, 3, 0)


@pytest.mark.slow
@pytest.mark.parametrize("num_latents, frames", [(7, 22), (12, 39), (17, 56)])
def test_batched_tiles_match_diffusers_tiled_decode(ckpt, num_latents, frames):
    # 64 px tiles with 32 px minimum overlap (the tiny net keeps the 16x patch): a 144 x 176 px canvas needs a 4 x 5
    # grid with uneven overlaps (48/32/32 and 48/32/32/32), so every seam kind of `_stitch_tiles` is exercised.
    vae = load_video_vae(ckpt)
    vae.enable_tiling(tile_sample_min_height=64, tile_sample_min_width=64)
    decoder = VideoDecoder(vae, tile_overlap=32)
    ys, tile_h, y_overlaps, xs, tile_w, x_overlaps = decoder.tile_grid(144, 176)
    assert (ys, tile_h, y_overlaps) == ([0, 16, 48, 80], 64, [48, 32, 32])
    assert (xs, tile_w, x_overlaps) == ([0, 16, 48, 80, 112], 64, [48, 32, 32, 32])
    z = torch.randn(num_latents, 24, 9, 11, generator=torch.Generator().manual_seed(num_latents))
    ref = _diffusers_pixels(vae, z)
    ours = decoder.decode_pixels(z)
    assert ours.shape == ref.shape == (frames, 144, 176, 3)
    assert _rel(ours, ref) < 1e-5
    assert (ours - ref).abs().max() < 1e-5
    # Tiles going through the ViT one by one reproduce the library's per-tile loop bit for bit.
    torch.testing.assert_close(VideoDecoder(vae, max_batch=1).decode_pixels(z), ref, rtol=0, atol=0)
    # The seams matter: without tiling the same latents decode visibly differently.
    vae.disable_tiling()
    assert (VideoDecoder(vae).decode_pixels(z) - ref).abs().max() > 1e-3


@pytest.mark.slow
def test_tile_replicas_share_the_tiles_and_give_the_same_frames(ckpt):
    # Two replicas (deep copies here; other GPUs in a deployment) each take a contiguous share of the 2 clips x 20
    # tiles; with one tile per ViT call the result is the library's per-tile decode bit for bit.
    vae = load_video_vae(ckpt)
    vae.enable_tiling(tile_sample_min_height=64, tile_sample_min_width=64, tile_sample_min_overlap_height=32,
                      tile_sample_min_overlap_width=32)
    z = torch.randn(12, 24, 9, 11, generator=torch.Generator().manual_seed(3))
    ref = _diffusers_pixels(vae, z)
    seen = []
    replicas = [copy.deepcopy(vae), copy.deepcopy(vae)]
    for replica in replicas:
        replica.decoder.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[0]))
    shared = VideoDecoder(vae, max_batch=1, tile_overlap=32, tile_replicas=replicas)
    torch.testing.assert_close(shared.decode_pixels(z), ref, rtol=0, atol=0)
    assert len(seen) == 2 * 40 // 3  # 40 tiles in shares of 14 / 13 / 13: the replicas ran 26 of them
    batched = VideoDecoder(vae, tile_overlap=32, tile_replicas=replicas).decode_pixels(z)
    assert (batched - ref).abs().max() < 1e-5
    other = build_video_vae("tiny")
    other.register_to_config(latent_channels=16)
    with pytest.raises(ValueError, match="must have the primary's config"):
        VideoDecoder(vae, tile_replicas=[other])
    with pytest.raises(ValueError, match="tile_devices"):
        VAEConfig(device="cuda:1", tile_devices=("cuda:0", "cuda:1"))


def test_tile_overlap_sets_the_grid_of_the_full_decoder():
    """At 480x864 the release's 64 px minimum overlap gives 3 x 5 tiles per clip, the realtime 32 px 2 x 4."""
    with torch.device("meta"):
        vae = build_video_vae("full")
    grids = {}
    for overlap in (64, 32):
        ys, _, y_overlaps, xs, _, x_overlaps = VideoDecoder(vae, tile_overlap=overlap).tile_grid(480, 864)
        assert vae.tile_sample_min_overlap_height == vae.tile_sample_min_overlap_width == overlap
        assert min(y_overlaps + x_overlaps) >= overlap and all(p % 16 == 0 for p in ys + xs)
        grids[overlap] = (len(ys), len(xs))
    assert grids == {64: (3, 5), 32: (2, 4)}
    for bad in (0, 8, 40, 256, 32.0):
        with pytest.raises(ValueError, match="tile_overlap"):
            VideoDecoder(vae, tile_overlap=bad)


def test_max_batch_is_validated(video):
    with pytest.raises(ValueError, match="max_batch"):
        VideoDecoder(video.vae, max_batch=0)


def test_video_frame_counts_at_tiny_canvas(video):
    assert [video.num_frames(n) for n in (7, 12, 37)] == [22, 39, 124]
    frames = video.decode(torch.randn(7, 24, 12, 20))
    assert frames.shape == (22, 192, 320, 3)  # 192x320 canvas: 16x spatial, tiled like the release


def test_audio_decode_matches_diffusers(audio):
    z = torch.randn(2, 30, 32, generator=torch.Generator().manual_seed(1))
    vae = audio.vae
    mean = torch.tensor(vae.config.latents_mean).view(1, 32, 1)
    std = torch.tensor(vae.config.latents_std).view(1, 32, 1)
    with torch.no_grad():
        left = vae.decode(z[0:1].transpose(1, 2) * std + mean).sample[0, 0]
        right = vae.decode(z[1:2].transpose(1, 2) * std + mean).sample[0, 0]
    ours = audio.decode(z)
    assert ours.shape == (2, 30 * 800) and ours.dtype == torch.float32
    assert _rel(ours[0], left) < 1e-5 and _rel(ours[1], right) < 1e-5
    assert ours.abs().max() <= 1.0 and ours.std() > 0
    assert audio.sample_rate == 32000 and audio.hop_length == 800


@pytest.mark.parametrize("shape, match", [
    ((12, 16, 6, 8), "24 channels"),
    ((24, 6, 8), r"\[F, 24, h, w\]"),
    ((10, 24, 6, 8), "2 \\+ 5k latent frames"),
    ((2, 24, 6, 8), "2 \\+ 5k latent frames"),
])
def test_video_bad_latents(video, shape, match):
    with pytest.raises(InvalidLatents, match=match):
        video.decode(torch.zeros(shape))


def test_video_non_finite(video):
    z = torch.zeros(7, 24, 6, 8)
    z[3, 1, 2, 2] = float("nan")
    with pytest.raises(InvalidLatents, match="finite"):
        video.decode(z)


@pytest.mark.parametrize("shape, match", [
    ((1, 10, 32), r"\[2, A, 32\]"),
    ((2, 10, 24), r"\[2, A, 32\]"),
    ((2, 32), r"\[2, A, 32\]"),
    ((2, 0, 32), "empty"),
])
def test_audio_bad_latents(audio, shape, match):
    with pytest.raises(InvalidLatents, match=match):
        audio.decode(torch.zeros(shape))


def test_checkpoint_layout(ckpt):
    for sub, cls in (("vae", AutoencoderKLMiniMaxH3), ("audio_vae", AutoencoderKLMiniMaxH3Audio)):
        cfg = json.loads((ckpt / sub / "config.json").read_text())
        assert cfg["_class_name"] == cls.__name__
        with safe_open(str(ckpt / sub / "diffusion_pytorch_model.safetensors"), framework="pt") as f:
            keys = set(f.keys())
            assert {f.get_tensor(k).dtype for k in list(keys)[:20]} == {torch.float32}
        assert keys == set(cls(**{k: v for k, v in cfg.items() if not k.startswith("_")}).state_dict())
    # The random init must not leave the zero-initialised ViT gates at zero (they would hide the blocks).
    with safe_open(str(ckpt / "vae/diffusion_pytorch_model.safetensors"), framework="pt") as f:
        assert f.get_tensor("decoder.transformer_blocks.0.scale1").abs().sum() > 0
        assert f.get_tensor("decoder.register_tokens").abs().sum() > 0


def test_missing_checkpoint_is_named(tmp_path):
    with pytest.raises(VAECheckpointError, match="no config.json"):
        load_video_vae(tmp_path)
    (tmp_path / "audio_vae").mkdir()
    (tmp_path / "audio_vae/config.json").write_text(json.dumps({"_class_name": "AutoencoderKLMiniMaxH3Audio"}))
    with pytest.raises(VAECheckpointError, match="cannot load"):
        load_audio_vae(tmp_path)


@pytest.mark.skipif(not REAL.is_dir(), reason="reference checkpoint configs not present")
def test_full_presets_match_released_configs():
    for sub, preset in (("vae", VIDEO_PRESETS["full"]), ("audio_vae", AUDIO_PRESETS["full"])):
        real = {k: v for k, v in json.loads((REAL / sub / "config.json").read_text()).items()
                if not k.startswith("_")}
        assert set(real) == set(preset)
        for key, value in real.items():
            if key.startswith("latents_"):
                torch.testing.assert_close(torch.tensor(preset[key], dtype=torch.float64),
                                           torch.tensor(value, dtype=torch.float64), rtol=0, atol=1e-7)
            else:
                assert json.loads(json.dumps(preset[key])) == value, key
    with torch.device("meta"):
        model = build_video_vae("full")
    real_keys = json.loads((REAL / "vae/diffusion_pytorch_model.safetensors.index.json").read_text())["weight_map"]
    assert set(model.state_dict()) == set(real_keys)
