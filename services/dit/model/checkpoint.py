"""MiniMax-H3 DiT checkpoints on disk: the original sharded layout and the diffusers layout, both ways.

`load_dit` validates a checkpoint directory from its index, config and shard headers alone, then streams it shard by
shard onto the target device into a meta-device model. `write_checkpoint` writes the exact on-disk layout of the
shipped checkpoint (file names, key names, dtypes, index, config): random weights (`write_random_checkpoint`) or
trained ones (`write_trained_checkpoint`). Knows nothing about attention patterns, LoRA, sequence parallelism or the
serving runtime.
"""

from __future__ import annotations

import json
import logging
import os
import struct
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Callable, Mapping

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from services.common.errors import InternalError
from services.common.startup import Steps, size_text
from services.dit.model.network import DiT, ModelArgs, is_fp32_param, meta_model, rope_inv_freq

log = logging.getLogger(__name__)

LAYOUTS = ("original", "diffusers")
INDEX_NAME = {"original": "model.safetensors.index.json",
              "diffusers": "diffusion_pytorch_model.safetensors.index.json"}
SHARD_STEM = {"original": "model", "diffusers": "diffusion_pytorch_model"}
NUM_SHARDS = {"original": 13, "diffusers": 14}
CLASS_NAME = {"original": "MiniMaxH3DiTModel", "diffusers": "MiniMaxH3Transformer3DModel"}
_DTYPE_SIZE = {"BF16": 2, "F32": 4}


class CheckpointError(InternalError):
    """A DiT checkpoint cannot be used; the message names every problem found."""


class CheckpointMismatchError(CheckpointError):
    """Tensors are missing, unexpected, mis-shaped or of the wrong dtype for the preset."""

    def __init__(self, message: str, missing: list[str], unexpected: list[str], bad_shape: list[str],
                 bad_dtype: list[str]):
        super().__init__(message)
        self.missing, self.unexpected, self.bad_shape, self.bad_dtype = missing, unexpected, bad_shape, bad_dtype


class TruncatedShardError(CheckpointError):
    """A shard file is shorter than its header says (or has no readable header)."""


class CheckpointIndexError(CheckpointError):
    """The shard index is malformed or disagrees with the shard files."""


class CheckpointConfigError(CheckpointError):
    """config.json is unreadable, of the other layout, or its dimensions differ from the preset."""


# ----------------------------------------------------------------------------------------------------------- configs

# ModelArgs field -> config.json key, per layout.
_CONFIG_KEYS = {
    "original": {"hidden_size": "hidden_size", "num_layers": "num_layers", "refiner_layers": "token_refiner_num_layers",
                 "num_heads": "num_attention_heads", "head_dim": "attention_head_dim", "ffn_hidden": "ffn_hidden_size",
                 "video_channels": "latents_dim", "audio_channels": "audio_latents_dim", "patch_size": "patch_size",
                 "text_dim": "text_dim", "timestep_dim": "timestep_input_dim",
                 "time_embed_hidden": "time_embed_hidden_size", "time_embed_dim": "time_embed_dim",
                 "rope_freqs": "rope_inv_freq_len", "norm_eps": "norm_eps", "qk_norm_eps": "qk_norm_eps",
                 "final_norm_eps": "final_norm_eps"},
    "diffusers": {"num_heads": "num_attention_heads", "head_dim": "attention_head_dim", "hidden_size": "hidden_size",
                  "num_layers": "num_layers", "refiner_layers": "num_refiner_layers", "ffn_hidden": "ffn_dim",
                  "video_channels": "in_channels", "audio_channels": "audio_in_channels", "patch_size": "patch_size",
                  "text_dim": "text_dim", "timestep_dim": "freq_dim", "time_embed_hidden": "time_embed_hidden_dim",
                  "time_embed_dim": "time_embed_dim", "rope_freqs": "rope_freq_dim", "rope_theta": "rope_theta",
                  "norm_eps": "norm_eps", "qk_norm_eps": "qk_norm_eps", "final_norm_eps": "final_norm_eps"},
}
_VERSION = {"original": "0.32.2", "diffusers": "0.36.0.dev0"}


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} must be one of {LAYOUTS}")


def config_for(args: ModelArgs, layout: str) -> dict:
    """config.json contents in the format of `layout`."""
    _check_layout(layout)
    cfg: dict = {"_class_name": CLASS_NAME[layout], "_diffusers_version": _VERSION[layout]}
    for field, key in _CONFIG_KEYS[layout].items():
        value = getattr(args, field)
        cfg[key] = list(value) if isinstance(value, tuple) else value
    if layout == "original":
        cfg["adaln_out_features"] = args.adaln_out
        cfg["final_adaln_out_features"] = args.final_adaln_out
    return cfg


def args_from_config(cfg: dict) -> tuple[ModelArgs, str]:
    """(ModelArgs, layout) from an original (`MiniMaxH3DiTModel`) or diffusers (`MiniMaxH3Transformer3DModel`) config."""
    cls = cfg.get("_class_name") if isinstance(cfg, dict) else None
    layout = {v: k for k, v in CLASS_NAME.items()}.get(cls)
    if layout is None:
        raise CheckpointConfigError(f"config _class_name={cls!r} is neither {CLASS_NAME['original']!r} "
                                    f"nor {CLASS_NAME['diffusers']!r}")
    keys = _CONFIG_KEYS[layout]
    missing = [k for k in keys.values() if k not in cfg]
    if missing:
        raise CheckpointConfigError(f"config ({layout} layout) lacks keys {missing}")
    kwargs = {f: (tuple(cfg[k]) if f == "patch_size" else cfg[k]) for f, k in keys.items()}
    try:
        args = ModelArgs(**kwargs)
    except (TypeError, ValueError) as e:
        raise CheckpointConfigError(f"config values are invalid: {e}") from e
    derived = config_for(args, layout)
    bad = [f"{k}={cfg[k]!r} (implied {derived[k]!r})" for k in derived if not k.startswith("_") and k in cfg
           and cfg[k] != derived[k]]
    if bad:
        raise CheckpointConfigError(f"config is inconsistent: {', '.join(bad)}")
    return args, layout


# ----------------------------------------------------------------------------------------------------------- key maps

@dataclass(frozen=True)
class KeyMap:
    """One model tensor and the file tensors it is stored as."""

    name: str
    """Parameter or buffer name in `DiT` (original key naming)."""
    keys: tuple[str, ...]
    """File keys, in the order `kind` combines them."""
    kind: str
    """copy | qkv_grouped (per head [q_h, k_h, v_h]) | qkv_split (to_q, to_k, to_v) | gate_up_swap ([up; gate])."""
    shape: tuple[int, ...]
    """Shape in the model."""
    file_dtype: str
    """safetensors dtype of every file key (BF16, or F32 for the float32 modules)."""

    def file_shapes(self) -> list[tuple[int, ...]]:
        if self.kind == "qkv_split":
            return [(self.shape[0] // 3, self.shape[1])] * 3
        return [self.shape]


_DIFFUSERS_RENAMES = (
    (".attn.q_norm.", ".attn.norm_q."), (".attn.k_norm.", ".attn.norm_k."), (".attn.out_proj.", ".attn.to_out.0."),
    (".mlp.fc1.", ".ff.net.0.proj."), (".mlp.fc2.", ".ff.net.2."),
)
_DIFFUSERS_TOP = {
    "condition_proj.": "context_embedder.", "video_patch_proj.": "proj_in.", "audio_patch_proj.": "audio_proj_in.",
    "time_embedder.proj_in.": "time_embedder.linear_1.", "time_embedder.proj_out.": "time_embedder.linear_2.",
    "final_layer.norm.": "norm_out.norm.", "final_layer.adaln_proj.linear.": "norm_out.linear.",
    "final_layer.video_out.": "proj_out.", "final_layer.audio_out.": "audio_proj_out.",
}


def _diffusers_name(name: str) -> str:
    if name.startswith("blocks."):
        name = "transformer_blocks." + name[len("blocks."):]
    elif name.startswith("token_refiner.blocks."):
        name = "token_refiner.refiner_blocks." + name[len("token_refiner.blocks."):]
    for old, new in _DIFFUSERS_TOP.items():
        if name.startswith(old):
            name = new + name[len(old):]
    for old, new in _DIFFUSERS_RENAMES:
        name = name.replace(old, new)
    return name


def key_maps(args: ModelArgs, layout: str) -> list[KeyMap]:
    """Every model tensor of `args` and how `layout` stores it (diffusers stores no rope.inv_freq)."""
    _check_layout(layout)
    model = meta_model(args)
    out = []
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        dtype = "F32" if is_fp32_param(name) else "BF16"
        shape = tuple(t.shape)
        if layout == "original":
            kind = "qkv_grouped" if name.endswith("attn.qkv_proj.weight") else "copy"
            out.append(KeyMap(name, (name,), kind, shape, dtype))
        elif name == "rope.inv_freq":
            continue
        elif name.endswith("attn.qkv_proj.weight"):
            base = _diffusers_name(name).replace("attn.qkv_proj.weight", "attn.")
            keys = tuple(base + p + ".weight" for p in ("to_q", "to_k", "to_v"))
            out.append(KeyMap(name, keys, "qkv_split", shape, dtype))
        else:
            kind = "gate_up_swap" if name.endswith("mlp.fc1.weight") else "copy"
            out.append(KeyMap(name, (_diffusers_name(name),), kind, shape, dtype))
    return out


def expected_tensors(args: ModelArgs, layout: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """File key -> (shape, safetensors dtype) of a complete checkpoint of `args` in `layout`."""
    return {k: (s, m.file_dtype) for m in key_maps(args, layout) for k, s in zip(m.keys, m.file_shapes())}


def _to_model(m: KeyMap, parts: list[torch.Tensor], args: ModelArgs) -> torch.Tensor:
    """Combine the file tensors of `m` into the model tensor."""
    if m.kind == "qkv_grouped":  # [H * (q, k, v) * D, C] -> [(Q, K, V) * H * D, C]
        w = parts[0]
        return w.unflatten(0, (args.num_heads, 3, args.head_dim)).transpose(0, 1).reshape(w.shape)
    if m.kind == "qkv_split":
        return torch.cat(parts, dim=0)
    if m.kind == "gate_up_swap":  # diffusers [up; gate] -> ours [gate; up]
        up, gate = parts[0].chunk(2, dim=0)
        return torch.cat([gate, up], dim=0)
    return parts[0]


def _to_file(m: KeyMap, t: torch.Tensor, args: ModelArgs) -> list[torch.Tensor]:
    """Split a model tensor into the file tensors of `m` (inverse of `_to_model`)."""
    if m.kind == "qkv_grouped":
        return [t.unflatten(0, (3, args.num_heads, args.head_dim)).transpose(0, 1).reshape(t.shape).contiguous()]
    if m.kind == "qkv_split":
        return [p.contiguous() for p in t.chunk(3, dim=0)]
    if m.kind == "gate_up_swap":
        gate, up = t.chunk(2, dim=0)
        return [torch.cat([up, gate], dim=0)]
    return [t.contiguous()]


# ------------------------------------------------------------------------------------------------- index and headers

@dataclass(frozen=True)
class ShardTensor:
    shard: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class CheckpointInfo:
    """A validated checkpoint directory (nothing loaded yet)."""

    directory: Path
    layout: str
    args: ModelArgs
    shards: tuple[str, ...]
    """Shard file names in load order."""
    weight_map: dict
    """File key -> shard file name."""


def read_shard_header(path: Path) -> dict[str, ShardTensor]:
    """Tensor dtypes and shapes from a safetensors header, checking the file holds every byte it declares."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise TruncatedShardError(f"shard {path.name} is {size} bytes, too short for a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
            raise TruncatedShardError(f"shard {path.name} declares a {n}-byte header but the file is {size} bytes")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TruncatedShardError(f"shard {path.name} has an unreadable header: {e}") from e
    out, end = {}, 0
    for key, meta in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape, (lo, hi) = meta["dtype"], tuple(meta["shape"]), meta["data_offsets"]
        except (KeyError, TypeError, ValueError) as e:
            raise TruncatedShardError(f"shard {path.name} has a malformed header entry for {key!r}") from e
        out[key] = ShardTensor(path.name, dtype, shape, hi - lo)
        end = max(end, hi)
    if 8 + n + end > size:
        raise TruncatedShardError(f"shard {path.name} is truncated: header needs {8 + n + end} bytes, "
                                  f"file has {size}")
    return out


def _find_layout(path: Path) -> tuple[Path, str]:
    """The transformer directory and its layout, from the index file present."""
    for d in (path, path / "transformer"):
        found = [lay for lay in LAYOUTS if (d / INDEX_NAME[lay]).is_file()]
        if len(found) > 1:
            raise CheckpointIndexError(f"{d} holds both {INDEX_NAME['original']} and {INDEX_NAME['diffusers']}; "
                                       "keep one layout per directory")
        if found:
            return d, found[0]
    raise CheckpointIndexError(f"no {INDEX_NAME['original']} or {INDEX_NAME['diffusers']} in {path}")


def _read_index(d: Path, layout: str) -> tuple[dict, int | None]:
    p = d / INDEX_NAME[layout]
    try:
        index = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointIndexError(f"index {p} is not valid JSON: {e}") from e
    wm = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wm, dict) or not wm or not all(isinstance(v, str) for v in wm.values()):
        raise CheckpointIndexError(f"index {p} has no weight_map of tensor name -> shard file name")
    total = index.get("metadata", {}).get("total_size") if isinstance(index.get("metadata"), dict) else None
    return wm, total


def _check_config(d: Path, layout: str, preset: ModelArgs) -> None:
    p = d / "config.json"
    if not p.is_file():
        raise CheckpointConfigError(f"{p} is missing")
    try:
        cfg = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointConfigError(f"{p} is not valid JSON: {e}") from e
    args, cfg_layout = args_from_config(cfg)
    if cfg_layout != layout:
        raise CheckpointConfigError(f"{p} is a {cfg_layout}-layout config but the index is {INDEX_NAME[layout]}")
    diff = [f"{f.name}: checkpoint {getattr(args, f.name)!r} vs preset {getattr(preset, f.name)!r}"
            for f in fields(ModelArgs) if getattr(args, f.name) != getattr(preset, f.name)
            and not (layout == "original" and f.name == "rope_theta")]
    if diff:
        raise CheckpointConfigError(f"{p} does not match the preset: {'; '.join(diff)}")


def validate_checkpoint(path: str | os.PathLike, preset: ModelArgs) -> CheckpointInfo:
    """Check index, config and every shard header against `preset`; reads no tensor data."""
    d, layout = _find_layout(Path(path))
    _check_config(d, layout, preset)
    wm, total = _read_index(d, layout)
    shards = sorted(set(wm.values()))
    absent = [s for s in shards if not (d / s).is_file()]
    if absent:
        raise CheckpointIndexError(f"index {INDEX_NAME[layout]} names shard files that do not exist: {absent}")
    found: dict[str, ShardTensor] = {}
    for s in shards:
        found.update(read_shard_header(d / s))
    wrong_shard = [f"{k} -> {s}" for k, s in wm.items() if k not in found or found[k].shard != s]
    unindexed = sorted(k for k in found if k not in wm)
    if wrong_shard or unindexed:
        raise CheckpointIndexError(
            f"index {INDEX_NAME[layout]} disagrees with the shards: "
            + (f"keys not in the shard the index names: {wrong_shard}. " if wrong_shard else "")
            + (f"keys in shards but not in the index: {unindexed}." if unindexed else ""))
    nbytes = sum(t.nbytes for t in found.values())
    if total is not None and total != nbytes:
        raise CheckpointIndexError(f"index metadata.total_size={total} but the shards hold {nbytes} tensor bytes")
    _check_tensors(found, expected_tensors(preset, layout), layout)
    return CheckpointInfo(d, layout, preset, tuple(shards), dict(wm))


def _check_tensors(found: dict[str, ShardTensor], expected: dict, layout: str) -> None:
    missing = sorted(k for k in expected if k not in found)
    unexpected = sorted(k for k in found if k not in expected)
    bad_shape = sorted(f"{k} {list(found[k].shape)} (expected {list(expected[k][0])})" for k in expected
                       if k in found and found[k].shape != expected[k][0])
    bad_dtype = sorted(f"{k} {found[k].dtype} (expected {expected[k][1]})" for k in expected
                       if k in found and found[k].dtype != expected[k][1])
    if missing or unexpected or bad_shape or bad_dtype:
        parts = [f"{label} ({len(items)}): {', '.join(items)}" for label, items in
                 (("missing", missing), ("unexpected", unexpected), ("wrong shape", bad_shape),
                  ("wrong dtype", bad_dtype)) if items]
        raise CheckpointMismatchError(f"{layout}-layout checkpoint does not match the preset; " + "; ".join(parts),
                                      missing, unexpected, bad_shape, bad_dtype)


# ------------------------------------------------------------------------------------------------------------ loading

def _assign(model: nn.Module, name: str, t: torch.Tensor) -> None:
    owner, _, leaf = name.rpartition(".")
    mod = model.get_submodule(owner)
    if leaf in mod._parameters:
        mod._parameters[leaf] = nn.Parameter(t, requires_grad=False)
    else:
        mod._buffers[leaf] = t


@torch.no_grad()
def load_dit(path: str | os.PathLike, preset_args: ModelArgs, device: torch.device | str,
             dtype: torch.dtype = torch.bfloat16) -> DiT:
    """Validate, then stream a checkpoint (either layout, autodetected) shard by shard onto `device`."""
    info = validate_checkpoint(path, preset_args)
    device = torch.device(device)
    model = meta_model(preset_args, dtype)
    maps = key_maps(preset_args, info.layout)
    by_key = {k: m for m in maps for k in m.keys}
    pending: dict[str, dict[str, torch.Tensor]] = {}
    loaded_bytes = 0
    shards = Steps(log, "DiT shards", len(info.shards))
    for shard in info.shards:
        keys = [k for k, s in info.weight_map.items() if s == shard]
        loaded_bytes += (info.directory / shard).stat().st_size
        with safe_open(str(info.directory / shard), framework="pt", device=str(device)) as f:
            for key in keys:
                m = by_key[key]
                parts = pending.setdefault(m.name, {})
                parts[key] = f.get_tensor(key)
                if len(parts) == len(m.keys):
                    t = _to_model(m, [parts[k] for k in m.keys], preset_args)
                    _assign(model, m.name, t.to(torch.float32 if is_fp32_param(m.name) else dtype))
                    del pending[m.name]
        shards.tick(f"{shard}: {len(keys)} tensors, {size_text(loaded_bytes)} in all")
    if info.layout == "diffusers":
        _assign(model, "rope.inv_freq", rope_inv_freq(preset_args.rope_freqs, preset_args.rope_theta).to(device))
    left = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.is_meta]
    if left or pending:
        raise CheckpointError(f"tensors not loaded: {sorted(left + list(pending))}")
    return model.eval()


# ------------------------------------------------------------------------------------------------------------ writing

def _random_tensor(m: KeyMap, index: int, seed: int, args: ModelArgs) -> torch.Tensor:
    """Deterministic random model tensor (float32, BF16-representable where the file is BF16); exact inv_freq."""
    if m.name == "rope.inv_freq":
        return rope_inv_freq(args.rope_freqs, args.rope_theta)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + index)
    if m.name.endswith(("norm.weight", "norm1.weight", "norm2.weight")):
        t = 1.0 + 0.1 * torch.randn(m.shape, generator=gen)
    elif m.name.endswith(".bias"):
        t = 0.02 * torch.randn(m.shape, generator=gen)
    else:
        t = torch.randn(m.shape, generator=gen) / (m.shape[-1] ** 0.5)
    return t.to(torch.bfloat16).float() if m.file_dtype == "BF16" else t


def _assign_shards(sizes: list[int], n: int) -> list[int]:
    """Contiguous shard index per file tensor, balanced by bytes, no shard empty when there are enough tensors."""
    total, cum, prev, out = max(sum(sizes), 1), 0, 0, []
    for j, size in enumerate(sizes):
        s = min(max(cum * n // total, prev), prev + 1)
        s = min(max(s, n - (len(sizes) - j)), n - 1)
        out.append(s)
        prev, cum = s, cum + size
    return out


def write_checkpoint(args: ModelArgs, out_dir: str | os.PathLike, layout: str,
                     tensor: Callable[[KeyMap, int], torch.Tensor]) -> Path:
    """Write the model tensors `tensor(map, index)` (float32, `index` the tensor's place in the original layout) in
    the exact on-disk layout of the shipped checkpoint; returns `out_dir`. Shards are written one at a time."""
    _check_layout(layout)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    maps = key_maps(args, layout)
    items = [(mi, k, s) for mi, m in enumerate(maps) for k, s in zip(m.keys, m.file_shapes())]
    sizes = [_DTYPE_SIZE[maps[mi].file_dtype] * int(torch.Size(s).numel()) for mi, _, s in items]
    n = NUM_SHARDS[layout]
    shard_of = _assign_shards(sizes, n)
    names = [f"{SHARD_STEM[layout]}-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    model_index = {m.name: i for i, m in enumerate(key_maps(args, "original"))}
    weight_map = {}
    for i in range(n):
        tensors, parts = {}, {}
        for (mi, key, _), s in zip(items, shard_of):
            if s != i:
                continue
            m = maps[mi]
            if mi not in parts:
                full = tensor(m, model_index[m.name])
                if tuple(full.shape) != m.shape:
                    raise CheckpointMismatchError(f"{m.name} has shape {tuple(full.shape)}, the preset's is {m.shape}",
                                                  [], [], [m.name], [])
                parts[mi] = _to_file(m, full.detach().float().cpu(), args)
            part = parts[mi][m.keys.index(key)]
            tensors[key] = part.to(torch.float32 if m.file_dtype == "F32" else torch.bfloat16)
            weight_map[key] = names[i]
        save_file(tensors, str(out / names[i]), metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(sizes)}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_NAME[layout]).write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(config_for(args, layout), indent=2) + "\n")
    log.info("wrote %s-layout checkpoint with %d tensors to %s", layout, len(items), out)
    return out


def write_random_checkpoint(args: ModelArgs, out_dir: str | os.PathLike, layout: str, seed: int = 0) -> Path:
    """Write a random-weight checkpoint in the exact on-disk layout of the shipped one; returns `out_dir`.

    The same (args, seed) gives the same model in both layouts.
    """
    return write_checkpoint(args, out_dir, layout, lambda m, index: _random_tensor(m, index, seed, args))


def write_trained_checkpoint(args: ModelArgs, state: Mapping[str, torch.Tensor], out_dir: str | os.PathLike,
                             layout: str = "original") -> Path:
    """Write trained weights (`state`: a `DiT` state dict of `args`, e.g. a trainer's EMA) in the shipped on-disk
    layout; BF16 entries are rounded to bfloat16 as the shipped checkpoint stores them. Returns `out_dir`."""
    names = {m.name for m in key_maps(args, "original")}
    missing, unexpected = sorted(names - set(state)), sorted(set(state) - names)
    if missing or unexpected:
        raise CheckpointMismatchError(f"trained state does not match the preset: missing {missing}, "
                                      f"unexpected {unexpected}", missing, unexpected, [], [])
    return write_checkpoint(args, out_dir, layout, lambda m, index: state[m.name])
