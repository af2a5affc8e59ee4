"""`vae.compile_blocks`: the video decoder's ViT blocks compiled, warmed up at start-up, close to the eager decode."""
import copy

import pytest
import torch

from services.common.config import VAEConfig
from services.vae.checkpoint import load_video_vae, write_random_checkpoint
from services.vae.incremental import WARMUP_PHASE_LATENTS, IncrementalVideoDecoder, warm_up_video
from services.vae.model import VideoDecoder

PHASES = [12, 10, 10, 5, 10]  # a stream's first call, then later phases of both sizes


@pytest.mark.cpu
def test_compile_blocks_is_validated():
    assert VAEConfig(device="cuda:1", tile_devices=("cuda:0",), compile_blocks=True).compile_blocks
    with pytest.raises(ValueError, match="vae.compile_blocks needs CUDA devices"):
        VAEConfig(device="cpu", compile_blocks=True)
    with pytest.raises(ValueError, match="vae.compile_blocks needs CUDA devices.*tile_devices=\\['cpu'\\]"):
        VAEConfig(device="cuda:0", tile_devices=("cpu",), compile_blocks=True)
    with pytest.raises(ValueError, match="vae.compile_blocks=1: must be true or false"):
        VAEConfig(compile_blocks=1)


@pytest.mark.cpu
def test_warm_up_decodes_every_phase_size_of_a_stream(tmp_path):
    decoder = VideoDecoder(load_video_vae(write_random_checkpoint("tiny", tmp_path, seed=3)))
    seen = []
    real = decoder.decode_pixel_parts
    decoder.decode_pixel_parts = lambda latents, head, carry: (seen.append((tuple(latents.shape), head))
                                                             or real(latents, head, carry))
    warm_up_video(decoder, width=96, height=64)
    # the first call as it comes (in two parts, as a session's first phase is decoded), later ones behind the 2
    # carried latents, on the canvas's latent grid
    assert WARMUP_PHASE_LATENTS == (12, 10, 5)
    assert seen == [((12, 24, 4, 6), 1), ((12, 24, 4, 6), 0), ((7, 24, 4, 6), 0)]


@pytest.mark.gpu
def test_compiled_blocks_match_eager_and_compile_nothing_after_warm_up(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from torch._dynamo.utils import counters

    vae = load_video_vae(write_random_checkpoint("tiny", tmp_path, seed=3), "cuda", torch.bfloat16)
    eager = IncrementalVideoDecoder(VideoDecoder(copy.deepcopy(vae), tile_overlap=16))
    decoder = VideoDecoder(vae, tile_overlap=16, compile_blocks=True)
    width, height = 320, 192
    warm_up_video(decoder, width, height)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0  # the warm-up compiled
    compiled = IncrementalVideoDecoder(decoder)
    z = torch.randn(sum(PHASES), 24, height // 16, width // 16, generator=torch.Generator().manual_seed(0))
    start = 0
    for n in PHASES:
        # the parts a session decodes: the first phase's first clip apart
        want, got = eager.decode_pixels(z[start:start + n]), torch.cat([*compiled.pixel_parts(z[start:start + n],
                                                                                              split=True)])
        start += n
        assert got.shape == want.shape
        assert (got - want).abs().max().item() < 3e-2  # BF16 rounding of fused ops, RGB in [0, 1]
    assert counters["stats"]["unique_graphs"] == graphs  # nothing compiled while "serving"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_video_for_the_muxer_is_i420_converted_on_the_gpu(tmp_path):
    from services.vae.model import to_i420

    gpu = VideoDecoder(load_video_vae(write_random_checkpoint("tiny", tmp_path, seed=11), "cuda"))
    z = torch.randn(7, 24, 4, 6, generator=torch.Generator().manual_seed(1))
    (planes,) = IncrementalVideoDecoder(gpu).decode_parts_for_mux(z)
    assert planes.dtype == torch.uint8 and planes.device.type == "cpu" and planes.shape == (17, 96, 96)  # 22 frames, the last 5 held for the next call
    pixels = IncrementalVideoDecoder(gpu).decode_pixels(z).cpu()
    assert (planes.int() - to_i420(pixels).int()).abs().max() <= 1  # the same conversion, on either device
