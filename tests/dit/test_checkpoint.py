"""DiT checkpoint layouts: real weight maps vs the full preset, round trips, and malformed checkpoints (CPU)."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.dit.model.checkpoint import (INDEX_NAME, CheckpointConfigError, CheckpointIndexError, CheckpointMismatchError,
                                     TruncatedShardError, args_from_config, expected_tensors, key_maps, load_dit,
                                     validate_checkpoint, write_random_checkpoint)
from services.dit.model.network import PRESETS, meta_model
from tests.dit.factories import TINY

pytestmark = pytest.mark.cpu

REF = Path(__file__).resolve().parents[3] / "shared/reference/checkpoints/MiniMax-H3"
REAL = {"original": REF / "FL2VA/transformer", "diffusers": REF / "transformer"}
needs_ref = pytest.mark.skipif(not REF.is_dir(), reason="reference checkpoint JSONs not present")


@needs_ref
@pytest.mark.parametrize("layout", ["original", "diffusers"])
def test_real_weight_map_matches_full_preset(layout):
    index = json.loads((REAL[layout] / INDEX_NAME[layout]).read_text())
    expected = expected_tensors(PRESETS["full"], layout)
    real_keys = set(index["weight_map"])
    assert sorted(real_keys - set(expected)) == [] and sorted(set(expected) - real_keys) == []
    # Shapes and dtypes (BF16, F32 for the float32 modules) reproduce the byte count of the shipped shards exactly.
    size = {"BF16": 2, "F32": 4}
    assert sum(torch.Size(s).numel() * size[d] for s, d in expected.values()) == index["metadata"]["total_size"]
    args, cfg_layout = args_from_config(json.loads((REAL[layout] / "config.json").read_text()))
    assert cfg_layout == layout and args == PRESETS["full"]


@pytest.mark.parametrize("layout", ["original", "diffusers"])
def test_key_maps_cover_every_model_tensor_of_full_preset(layout):
    model = meta_model(PRESETS["full"])
    names = {n for n, _ in list(model.named_parameters()) + list(model.named_buffers())}
    maps = key_maps(PRESETS["full"], layout)
    mapped = [m.name for m in maps]
    assert len(mapped) == len(set(mapped))
    assert set(mapped) == (names if layout == "original" else names - {"rope.inv_freq"})
    shapes = {m.name: m.shape for m in maps}
    assert shapes["blocks.0.attn.qkv_proj.weight"] == (21504, 5376)
    assert shapes["blocks.49.adaln_proj.linear.weight"] == (96768, 2688)
    assert shapes["final_layer.adaln_proj.linear.weight"] == (10752, 2688)
    assert shapes["token_refiner.blocks.1.mlp.fc1.weight"] == (28672, 5376)
    assert shapes["blocks.3.attn.out_proj.weight"] == (5376, 7168)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {lay: write_random_checkpoint(TINY, root / lay, lay, seed=11) for lay in ("original", "diffusers")}


@pytest.fixture
def ckpt(base, tmp_path):
    out = tmp_path / "original"
    shutil.copytree(base["original"], out)
    return out


def _edit(d: Path, fn):
    """Apply fn(tensors) to every shard, then rewrite the index to match (so only the tensors are wrong)."""
    index_path = d / INDEX_NAME["original"]
    index = json.loads(index_path.read_text())
    weight_map, total = {}, 0
    for shard in sorted(set(index["weight_map"].values())):
        tensors = load_file(str(d / shard))
        fn(shard, tensors)
        save_file(tensors, str(d / shard), metadata={"format": "pt"})
        for k, t in tensors.items():
            weight_map[k] = shard
            total += t.numel() * t.element_size()
    index_path.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))


def _shard_of(d: Path, key: str) -> str:
    return json.loads((d / INDEX_NAME["original"]).read_text())["weight_map"][key]


def test_layout_autodetect_and_round_trip(base):
    for layout, d in base.items():
        info = validate_checkpoint(d, TINY)
        assert info.layout == layout and len(info.shards) == {"original": 13, "diffusers": 14}[layout]
    model = load_dit(base["original"], TINY, "cpu", torch.bfloat16)
    assert model.blocks[0].attn.qkv_proj.weight.dtype == torch.bfloat16
    assert model.video_patch_proj.weight.dtype == torch.float32 and model.rope.inv_freq.dtype == torch.float32
    assert model.final_layer.audio_out.weight.dtype == torch.float32
    assert model.time_embedder.proj_out.weight.dtype == torch.float32
    assert model.condition_proj.weight.dtype == torch.bfloat16
    assert not any(p.is_meta for p in model.parameters())


def test_one_error_lists_every_mismatch(ckpt):
    def corrupt(shard, t):
        if "blocks.0.mlp.fc2.weight" in t:
            del t["blocks.0.mlp.fc2.weight"]
        if "blocks.1.attn.q_norm.weight" in t:
            t["blocks.1.attn.q_norm.weight"] = torch.ones(7, dtype=torch.bfloat16)
        if "video_patch_proj.weight" in t:
            t["video_patch_proj.weight"] = t["video_patch_proj.weight"].to(torch.bfloat16)
        if "condition_proj.bias" in t:
            t["blocks.0.attn.extra.weight"] = torch.zeros(3, dtype=torch.bfloat16)

    _edit(ckpt, corrupt)
    with pytest.raises(CheckpointMismatchError) as e:
        load_dit(ckpt, TINY, "cpu", torch.float32)
    msg = str(e.value)
    for name in ("blocks.0.mlp.fc2.weight", "blocks.1.attn.q_norm.weight", "video_patch_proj.weight",
                 "blocks.0.attn.extra.weight"):
        assert name in msg
    assert e.value.missing == ["blocks.0.mlp.fc2.weight"]
    assert e.value.unexpected == ["blocks.0.attn.extra.weight"]
    assert e.value.bad_shape[0].startswith("blocks.1.attn.q_norm.weight [7]")
    assert e.value.bad_dtype[0].startswith("video_patch_proj.weight BF16")


@pytest.mark.parametrize("case", ["missing", "extra", "shape", "dtype"])
def test_each_tensor_problem_alone(ckpt, case):
    key = "blocks.1.mlp.fc1.weight"

    def corrupt(shard, t):
        if key not in t:
            return
        if case == "missing":
            del t[key]
        elif case == "extra":
            t["blocks.2.mlp.fc1.weight"] = t[key].clone()
        elif case == "shape":
            t[key] = t[key][:-1].clone()
        else:
            t[key] = t[key].float()

    _edit(ckpt, corrupt)
    with pytest.raises(CheckpointMismatchError, match={"missing": "missing", "extra": "unexpected",
                                                       "shape": "wrong shape", "dtype": "wrong dtype"}[case]):
        validate_checkpoint(ckpt, TINY)


def test_truncated_shard(ckpt):
    shard = ckpt / _shard_of(ckpt, "blocks.0.mlp.fc1.weight")
    data = shard.read_bytes()
    shard.write_bytes(data[:-100])
    with pytest.raises(TruncatedShardError, match=shard.name):
        load_dit(ckpt, TINY, "cpu", torch.float32)
    shard.write_bytes(data[:5])
    with pytest.raises(TruncatedShardError, match=shard.name):
        validate_checkpoint(ckpt, TINY)


def test_index_missing_shard_file(ckpt):
    shard = _shard_of(ckpt, "blocks.0.norm1.weight")
    (ckpt / shard).unlink()
    with pytest.raises(CheckpointIndexError, match=shard):
        validate_checkpoint(ckpt, TINY)


def test_index_malformed_json(ckpt):
    (ckpt / INDEX_NAME["original"]).write_text('{"weight_map": {"a": ')
    with pytest.raises(CheckpointIndexError, match="not valid JSON"):
        validate_checkpoint(ckpt, TINY)
    (ckpt / INDEX_NAME["original"]).write_text('{"metadata": {}}')
    with pytest.raises(CheckpointIndexError, match="weight_map"):
        validate_checkpoint(ckpt, TINY)


def test_index_key_points_to_wrong_shard(ckpt):
    p = ckpt / INDEX_NAME["original"]
    index = json.loads(p.read_text())
    key = "blocks.0.attn.out_proj.weight"
    other = next(s for s in sorted(set(index["weight_map"].values())) if s != index["weight_map"][key])
    index["weight_map"][key] = other
    p.write_text(json.dumps(index))
    with pytest.raises(CheckpointIndexError, match=key):
        validate_checkpoint(ckpt, TINY)


def test_index_total_size_inconsistent(ckpt):
    p = ckpt / INDEX_NAME["original"]
    index = json.loads(p.read_text())
    index["metadata"]["total_size"] += 2
    p.write_text(json.dumps(index))
    with pytest.raises(CheckpointIndexError, match="total_size"):
        validate_checkpoint(ckpt, TINY)


def test_config_mismatch_and_missing_index(base, tmp_path):
    with pytest.raises(CheckpointConfigError, match="hidden_size"):
        validate_checkpoint(base["diffusers"], PRESETS["full"])
    with pytest.raises(CheckpointIndexError, match="no model.safetensors.index.json"):
        validate_checkpoint(tmp_path, TINY)
