"""TaoMate LoRA adapter: load and validate the native adapter directory, install it on the DiT through `peft`,
and switch between the LoRA student and the base-model teacher: either the student adds the side branch to the
base weights, or (`merge_into_base`) the LoRA lives in the base weights and the teacher subtracts the side branch.

Native layout: `config.json` (or `adapter_config.json`) with integer `rank` and numeric `alpha`, plus
`adapter_model.safetensors` holding exactly `<target>.lora_a` [rank, in] and `<target>.lora_b` [out, rank] (FP32)
for every target = (refiner blocks + DiT blocks) x {attn.qkv_proj, attn.out_proj, mlp.fc1, mlp.fc2}; qkv B rows in
[Q; K; V] order like the model's `qkv_proj`. The scale alpha / rank is applied once, by peft's LoRA layers.
Knows nothing about sampling, sessions or the KV cache.
"""

from __future__ import annotations

import json
import logging
import math
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file, save_file

from services.dit.api import LoRAError
from services.dit.model.network import DiT, ModelArgs

log = logging.getLogger(__name__)

SUFFIXES = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")
ADAPTER_NAME = "taomate"
WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILES = ("config.json", "adapter_config.json")


def lora_targets(args: ModelArgs) -> dict[str, tuple[int, int]]:
    """Every LoRA target module name -> (in_features, out_features) for `args` (208 on the full preset)."""
    dims = {"attn.qkv_proj": (args.hidden_size, 3 * args.inner_dim),
            "attn.out_proj": (args.inner_dim, args.hidden_size),
            "mlp.fc1": (args.hidden_size, 2 * args.ffn_hidden),
            "mlp.fc2": (args.ffn_hidden, args.hidden_size)}
    prefixes = [f"token_refiner.blocks.{i}" for i in range(args.refiner_layers)]
    prefixes += [f"blocks.{i}" for i in range(args.num_layers)]
    return {f"{p}.{s}": dims[s] for p in prefixes for s in SUFFIXES}


@dataclass(frozen=True, eq=False)
class AdapterSpec:
    """A validated native adapter: rank, alpha and the FP32 factors keyed by target."""

    rank: int
    alpha: float
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]]
    """target -> (lora_a [rank, in], lora_b [out, rank])."""

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def _read_config(directory: Path) -> tuple[int, float]:
    for name in CONFIG_FILES:
        path = directory / name
        if path.is_file():
            try:
                cfg = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError) as e:
                raise LoRAError(f"{path}: unreadable adapter config ({e})") from e
            rank, alpha = cfg.get("rank", cfg.get("r")), cfg.get("alpha", cfg.get("lora_alpha"))
            if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
                raise LoRAError(f"{path}: 'rank' must be a positive int, got {rank!r}")
            if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha) \
                    or alpha <= 0:
                raise LoRAError(f"{path}: 'alpha' must be a positive number, got {alpha!r}")
            return rank, float(alpha)
    raise LoRAError(f"{directory}: no adapter config (looked for {', '.join(CONFIG_FILES)})")


def load_adapter(directory: str | Path, args: ModelArgs) -> AdapterSpec:
    """Read and validate a native TaoMate adapter directory against the targets of `args`."""
    directory = Path(directory)
    if not directory.is_dir():
        raise LoRAError(f"adapter directory {directory} does not exist")
    rank, alpha = _read_config(directory)
    path = directory / WEIGHTS_FILE
    if not path.is_file():
        raise LoRAError(f"{directory}: missing {WEIGHTS_FILE}")
    try:
        tensors = load_file(str(path))
    except Exception as e:  # safetensors raises its own error types for corrupt files
        raise LoRAError(f"{path}: unreadable safetensors file ({e})") from e
    targets = lora_targets(args)
    expected = {f"{t}.{f}" for t in targets for f in ("lora_a", "lora_b")}
    extra = sorted(set(tensors) - expected)
    if extra:
        raise LoRAError(f"{path}: unexpected tensors {extra[:4]}{' ...' if len(extra) > 4 else ''} "
                        f"(not LoRA factors of this model's {len(targets)} targets)")
    missing = sorted(expected - set(tensors))
    if missing:
        raise LoRAError(f"{path}: missing tensors {missing[:4]}{' ...' if len(missing) > 4 else ''} "
                        f"({len(missing)} of {len(expected)})")
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for target, (fan_in, fan_out) in targets.items():
        a, b = tensors[f"{target}.lora_a"], tensors[f"{target}.lora_b"]
        for name, x, want, rank_axis in ((f"{target}.lora_a", a, (rank, fan_in), 0),
                                         (f"{target}.lora_b", b, (fan_out, rank), 1)):
            if x.dim() == 2 and x.shape[rank_axis] != rank:
                raise LoRAError(f"{path}: {name} has shape {tuple(x.shape)}: its rank {x.shape[rank_axis]} does not "
                                f"match the configured rank {rank} (expected {want})")
            if tuple(x.shape) != want:
                raise LoRAError(f"{path}: {name} has shape {tuple(x.shape)}, expected {want}")
            if not x.is_floating_point():
                raise LoRAError(f"{path}: {name} has dtype {x.dtype}, expected a float dtype (FP32)")
            if not bool(torch.isfinite(x).all()):
                raise LoRAError(f"{path}: {name} contains NaN or Inf")
        factors[target] = (a.float(), b.float())
    return AdapterSpec(rank, alpha, factors)


def random_adapter_spec(args: ModelArgs, device: torch.device | str, seed: int, rank: int | None = None,
                        alpha: float | None = None) -> AdapterSpec:
    """A random adapter of TaoMate's shape, built on `device` (rank 128 on full, hidden/8 on small presets)."""
    rank = rank if rank is not None else min(128, max(1, args.hidden_size // 8))
    alpha = float(alpha if alpha is not None else rank)
    gen = torch.Generator(device=device).manual_seed(seed)
    factors = {}
    for target, (fan_in, fan_out) in lora_targets(args).items():
        a = torch.randn(rank, fan_in, generator=gen, device=device) / math.sqrt(fan_in)
        b = torch.randn(fan_out, rank, generator=gen, device=device) * 0.02
        factors[target] = (a, b)
    return AdapterSpec(rank, alpha, factors)


def write_random_adapter(args: ModelArgs, out_dir: str | Path, seed: int, rank: int | None = None,
                         alpha: float | None = None) -> Path:
    """Write a random adapter in the native layout (for the tiny/full checkpoint writer and tests)."""
    return write_adapter(random_adapter_spec(args, "cpu", seed, rank, alpha), out_dir)


def write_adapter(spec: AdapterSpec, out_dir: str | Path) -> Path:
    """Write `spec` in the native layout `load_adapter` reads: config.json and the FP32 factors."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for target, (a, b) in spec.factors.items():
        tensors[f"{target}.lora_a"], tensors[f"{target}.lora_b"] = a.float().contiguous(), b.float().contiguous()
    save_file(tensors, str(out / WEIGHTS_FILE))
    (out / "config.json").write_text(json.dumps({"rank": spec.rank, "alpha": spec.alpha}))
    return out


class LoRAAdapter:
    """The adapter installed on a DiT via peft; `suspended()` turns the base model (teacher) on, nestably."""

    def __init__(self, model: DiT, spec: AdapterSpec, dtype: torch.dtype | None = None):
        dev = model.condition_proj.weight.device
        dtype = dtype or (torch.float32 if dev.type == "cpu" else torch.bfloat16)
        config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=0.0, bias="none",
                            target_modules=sorted(spec.factors))
        inject_adapter_in_model(config, model, adapter_name=ADAPTER_NAME)
        state = {}
        for target, (a, b) in spec.factors.items():
            state[f"{target}.lora_A.weight"] = a.to(dev, dtype)
            state[f"{target}.lora_B.weight"] = b.to(dev, dtype)
        result = set_peft_model_state_dict(model, state, adapter_name=ADAPTER_NAME)
        unexpected = getattr(result, "unexpected_keys", [])
        if unexpected:
            raise LoRAError(f"peft did not place adapter tensors {unexpected[:4]}")
        self.model, self.spec = model, spec
        self.layers: dict[str, LoraLayer] = {n: m for n, m in model.named_modules() if isinstance(m, LoraLayer)}
        if set(self.layers) != set(spec.factors):
            raise LoRAError(f"peft wrapped {len(self.layers)} modules, expected the {len(spec.factors)} targets")
        for layer in self.layers.values():
            for mod in (layer.lora_A[ADAPTER_NAME], layer.lora_B[ADAPTER_NAME]):
                mod.to(dev, dtype).requires_grad_(False)
        self._depth = 0
        self.merged = False
        """True once `merge_into_base` folded the LoRA into the base weights."""
        model.requires_grad_(False)
        log.info("LoRA installed: %d targets, rank %d, alpha %s", len(self.layers), spec.rank, spec.alpha)

    @classmethod
    def load(cls, model: DiT, directory: str | Path, dtype: torch.dtype | None = None) -> "LoRAAdapter":
        """Load, validate and install the adapter directory on `model`."""
        return cls(model, load_adapter(directory, model.args), dtype)

    @property
    def suspended_depth(self) -> int:
        return self._depth

    def _apply(self) -> None:
        # side branch: the student adds s·B(A x); merged: the teacher subtracts it from (W + s·BA) x
        branch_on = (self._depth == 0) != self.merged
        for layer in self.layers.values():
            layer.enable_adapters(branch_on)
            # peft marks an enabled adapter trainable; inference keeps it frozen (and the compiled block regions,
            # which are specialised on requires_grad, keep one variant per LoRA state)
            layer.requires_grad_(False)

    @contextmanager
    def suspended(self) -> Iterator[None]:
        """Run the base model (LoRA off) inside the block; nestable and exception-safe."""
        self._depth += 1
        try:
            if self._depth == 1:
                self._apply()
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._apply()

    def merge_into_base(self) -> None:
        """Fold s·BA into every target's base weight, in place; the teacher then runs W x = (W + s·BA) x - s·B(A x).

        The students and the commit (most forwards) lose the side branch's two GEMMs and its add; the audio teacher,
        run as CUDA graphs, gains them. No memory changes hands. Call before FP8 quantisation, which then quantises
        the merged weights.
        """
        if self.merged:
            raise LoRAError("the LoRA is already merged into the base weights")
        if self._depth:
            raise LoRAError("merge_into_base inside suspended(): merge before serving")
        with torch.no_grad():
            for name, layer in self.layers.items():
                weight = layer.get_base_layer().weight
                if weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                    raise LoRAError(f"{name}: cannot merge the LoRA into a {weight.dtype} weight (merge before FP8)")
                a = layer.lora_A[ADAPTER_NAME].weight.float()  # [rank, in]
                b = layer.lora_B[ADAPTER_NAME].weight.float()  # [out, rank]
                scale = layer.scaling[ADAPTER_NAME]
                weight.copy_((weight.float() + scale * (b @ a)).to(weight.dtype))  # [out, in]
                layer.scaling[ADAPTER_NAME] = -scale
        self.merged = True
        self._apply()
