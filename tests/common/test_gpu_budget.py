"""A profile's GPU memory shares: placed per GPU, checked against the GPUs' sizes before a stage loads anything."""
import dataclasses
import os
import pathlib
import subprocess
import sys

import pytest

from services.common.config import DiTConfig, EncoderConfig, VAEConfig, load_profile
from services.common.gpu_budget import budgets, fit_error

pytestmark = pytest.mark.cpu
ROOT = pathlib.Path(__file__).resolve().parents[2]
H200_GIB = 139.8  # what an H200 reports as its total memory
H100_GIB = 79.1   # an 80 GB H100


def profile(name):
    return load_profile(ROOT / "configs" / f"{name}.yaml")


def test_usp2_places_every_stage_on_its_gpu_within_the_110_gib_target():
    shares = budgets(profile("usp2_fp8"))
    assert shares == {"cuda:0": {"encoder": 49, "dit rank 0": 55, "vae tiles": 4},
                      "cuda:1": {"dit rank 1": 55, "vae": 11}}
    assert all(sum(parts.values()) <= 110 for parts in shares.values())  # issue 5: ≤ 110 GiB per GPU, all stages


def test_usp4_places_the_encoder_beside_rank_0_and_the_vae_beside_rank_3():
    shares = budgets(profile("usp4_bf16"))
    assert list(shares) == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert shares["cuda:0"] == {"encoder": 49, "dit rank 0": 64}
    assert shares["cuda:3"] == {"dit rank 3": 64, "vae": 20}


@pytest.mark.parametrize("name", ["usp2_fp8", "usp4_bf16"])
@pytest.mark.parametrize("stage", ["encoder", "dit", "vae"])
def test_gpu_profiles_fit_h200s(name, stage):
    p = profile(name)
    assert fit_error(p, stage, {f"cuda:{i}": H200_GIB for i in range(p.dit.usp_degree)}) == ""


def test_usp2_on_80_gb_gpus_is_refused_with_the_numbers():
    why = fit_error(profile("usp2_fp8"), "encoder", {"cuda:0": H100_GIB, "cuda:1": H100_GIB})
    assert why.startswith("profile usp2_fp8 does not fit this node's GPUs for the encoder stage")
    assert "cuda:0 has 79.1 GiB, but the profile places 108 GiB on it (encoder 49 + dit rank 0 55 + vae tiles 4)" \
        in why
    # GPU 1's 66 GiB fit an H100, so the VAE's own GPU passes; its tile share on GPU 0 does not
    vae = fit_error(profile("usp2_fp8"), "vae", {"cuda:0": H100_GIB, "cuda:1": H100_GIB})
    assert "cuda:0 has 79.1" in vae and "cuda:1" not in vae


def test_every_gpu_of_the_stage_that_does_not_fit_is_named():
    why = fit_error(profile("usp4_bf16"), "dit", {f"cuda:{i}": H100_GIB for i in range(4)})
    assert "cuda:0 has 79.1 GiB, but the profile places 113 GiB" in why
    assert "cuda:3 has 79.1 GiB, but the profile places 84 GiB on it (dit rank 3 64 + vae 20)" in why
    assert "cuda:1" not in why and "cuda:2" not in why  # 64 GiB each: they fit


def test_a_gpu_the_process_does_not_see_is_named():
    why = fit_error(profile("usp2_fp8"), "dit", {"cuda:0": H200_GIB})
    assert "cuda:1 is named in the profile, but this process sees 1 GPU(s) (cuda:0)" in why
    four = fit_error(profile("usp4_bf16"), "dit", {"cuda:0": H100_GIB})  # missing and too small, both named
    assert "cuda:1, cuda:2, cuda:3 are named in the profile, but this process sees 1 GPU(s) (cuda:0); cuda:0 has " \
           "79.1 GiB, but the profile places 113 GiB on it" in four
    assert four.endswith("(CUDA_VISIBLE_DEVICES, the container's GPUs). Run it on GPUs with at least that much "
                         "memory, or pick a profile made for these GPUs.")
    none = fit_error(profile("usp2_fp8"), "encoder", {})
    assert "cuda:0 is named in the profile, but this process sees 0 GPU(s). Make every GPU the profile names " \
           "visible to this process" in none
    assert "at least that much memory" not in none


def test_shares_are_summed_per_gpu_whatever_the_device_is_called():
    p = profile("usp2_fp8")
    p = dataclasses.replace(p, encoder=dataclasses.replace(p.encoder, device="cuda"))  # "cuda" is cuda:0
    assert budgets(p)["cuda:0"]["encoder"] == 49
    assert "places 108 GiB" in fit_error(p, "encoder", {"cuda:0": 100.0})
    assert fit_error(p, "encoder", {"cuda:0": 108.0}) == ""  # exactly full fits


def test_cpu_profiles_declare_nothing():
    p = profile("tiny_cpu")
    assert budgets(p) == {}
    assert all(fit_error(p, stage, {}) == "" for stage in ("encoder", "dit", "vae"))


@pytest.mark.parametrize("make, field", [(EncoderConfig, "memory_gib"), (DiTConfig, "memory_gib"),
                                         (VAEConfig, "memory_gib"), (VAEConfig, "tile_memory_gib")])
@pytest.mark.parametrize("bad", [-1, "50", True, float("nan"), float("inf")])
def test_bad_shares_are_named(make, field, bad):
    section = {EncoderConfig: "encoder", DiTConfig: "dit", VAEConfig: "vae"}[make]
    with pytest.raises(ValueError, match=f"{section}.{field}=.*must be a number of GiB >= 0"):
        make(**{field: bad})


@pytest.mark.e2e
def test_a_stage_whose_gpus_are_missing_exits_before_loading():
    """`python -m services.encoder` with the usp2 profile on this machine (no GPU): a clear refusal, at once."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-m", "services.encoder", "--profile", "configs/usp2_fp8.yaml",
                           "--port", "0"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "profile usp2_fp8 does not fit this node's GPUs for the encoder stage: cuda:0 is named in the profile, " \
           "but this process sees 0 GPU(s)" in done.stderr
    assert "loading" not in done.stderr  # refused before the server came up or any weight loaded
