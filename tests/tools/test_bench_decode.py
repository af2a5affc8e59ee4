"""`python -m tools.vae.bench_decode --vit-tiles` times one ViT call per tile count, host against device, on the
tiles of the canvas's grid."""

import subprocess
import sys

import pytest

pytestmark = [pytest.mark.cpu, pytest.mark.e2e]


def test_vit_tiles_prints_host_and_device_time_per_tile_count():
    run = subprocess.run([sys.executable, "-m", "tools.vae.bench_decode", "--preset", "tiny", "--device", "cpu",
                          "--height", "192", "--width", "320", "--vit-tiles", "1", "2", "--repeats", "1"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith("ViT on")]
    # the tiny VAE's 192 x 320 canvas tiles: 7-latent clips of 24 channels, one shape per call
    assert [line.split(":")[0] for line in lines] == ["ViT on 1 tiles [1, 24, 7, 12, 16]",
                                                     "ViT on 2 tiles [2, 24, 7, 12, 16]"]
    assert all("ms to return, device" in line for line in lines)
