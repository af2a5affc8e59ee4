"""Profiles load into validated dataclasses, and bad values are named."""
import pathlib

import pytest

from services.common.config import DiTConfig, ModelConfig, VAEConfig, load_profile

pytestmark = pytest.mark.cpu
ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["tiny_cpu", "usp2_fp8", "usp4_bf16"])
def test_shipped_profiles_load(name):
    profile = load_profile(ROOT / "configs" / f"{name}.yaml")
    assert profile.name == name
    assert profile.dit.usp_degree == {"tiny_cpu": 1, "usp2_fp8": 2, "usp4_bf16": 4}[name]
    gpu = name != "tiny_cpu"  # the GPU profiles run FlashAttention 4; only the BF16 one merges the LoRA
    assert profile.dit.attention == ("fa4" if gpu else "default")  # (merged before FP8 it blurs the video),
    assert profile.dit.merge_lora == (name == "usp4_bf16")
    assert profile.vae.compile_blocks == gpu  # and the video decoder's ViT blocks compiled


def test_unknown_key_is_named(tmp_path):
    p = tmp_path / "p.yaml"
    p.write_text("model: {preset: tiny, dir: x}\ndit: {devcies: [cpu]}\n")
    with pytest.raises(ValueError, match="unknown keys \\['devcies'\\]"):
        load_profile(p)


def test_bad_values_are_named():
    with pytest.raises(ValueError, match="model.preset='huge'"):
        ModelConfig(preset="huge", dir="x")
    with pytest.raises(ValueError, match="USP degree must be 1, 2 or 4"):
        DiTConfig(devices=("cuda:0", "cuda:1", "cuda:2"))
    with pytest.raises(ValueError, match="entry 200"):
        DiTConfig(canvas_short_edges=(200,))
    with pytest.raises(ValueError, match="dit.attention='flash3': use one of \\('default', 'cudnn', 'fa4'\\)"):
        DiTConfig(attention="flash3")
    with pytest.raises(ValueError, match="dit.merge_lora='yes': must be true or false"):
        DiTConfig(merge_lora="yes")
    with pytest.raises(ValueError, match="dit.reuse_text_kv=1: must be true or false"):
        DiTConfig(reuse_text_kv=1)


def test_vae_tile_overlap_is_validated():
    assert VAEConfig(tile_overlap_px=32).tile_overlap_px == 32
    for bad in (0, 24, 256, "32"):
        with pytest.raises(ValueError, match="vae.tile_overlap_px"):
            VAEConfig(tile_overlap_px=bad)
