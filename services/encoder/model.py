"""Qwen3-VL text stack used as the MiniMax-H3 text encoder.

Knows nothing about gRPC, sessions or the DiT: it turns a raw prompt (no chat template) or a list of token ids
into the unnormalised hidden states that leave decoder layer `output_layer - 1`, i.e. `hidden_states[output_layer]`
of the full `transformers` model. Only the token embedding and layers `0 .. output_layer - 1` exist here; the
remaining layers, the final norm, the LM head and the vision tower are never built or read.

The layer modules are the `transformers` Qwen3-VL classes; this file only wires them together and loads the real
checkpoint layout (`text_encoder/model.safetensors.index.json`, keys `model.language_model.*`) shard by shard.
"""
from __future__ import annotations

import json
import logging
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from transformers import AutoTokenizer, Qwen3VLTextConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import (
    Qwen3VLTextDecoderLayer,
    Qwen3VLTextRotaryEmbedding,
)

from services.common.errors import InternalError, InvalidInput
from services.common.startup import Steps
from services.tensors.cuda_graphs import CudaGraphBank, GraphKey, PromptBuckets

logger = logging.getLogger(__name__)

TEXT_KEY_PREFIX = "model.language_model."


class EncoderInputError(InvalidInput):
    """The prompt or token ids cannot be encoded (empty, too long, out-of-vocabulary id)."""


class EncoderCheckpointError(InternalError):
    """The text-encoder checkpoint on disk does not match the preset (missing/mis-shaped tensors, bad index)."""


@dataclass(frozen=True)
class ModelArgs:
    """Dimensions of the Qwen3-VL text stack (the `text_config` of a `qwen3_vl` checkpoint)."""

    vocab_size: int
    """Rows of the token embedding."""
    hidden_size: int
    """Model width; also the width of the returned embedding (`text_dim` of the DiT)."""
    intermediate_size: int
    """SwiGLU hidden width."""
    num_layers: int
    """Decoder layers in the checkpoint (64 for the real model); only `output_layer` of them are built."""
    output_layer: int
    """Index into `hidden_states` whose (unnormalised) value is returned; layers `0 .. output_layer-1` run."""
    num_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads (grouped-query attention)."""
    head_dim: int
    """Per-head width."""
    rms_norm_eps: float
    """RMSNorm epsilon (`rms_norm_eps`)."""
    rope_theta: float
    """RoPE base (`rope_theta`)."""
    mrope_section: tuple[int, int, int]
    """Multimodal RoPE split of the head_dim/2 frequencies over (t, h, w); for text all three use one position."""
    mrope_interleaved: bool
    """Whether the (t, h, w) frequencies are interleaved rather than laid out in three blocks."""
    rope_type: str
    """RoPE variant of `transformers` ("default": no scaling)."""
    max_position_embeddings: int
    """Longest position the RoPE is configured for."""
    hidden_act: str
    """SwiGLU activation."""
    attention_bias: bool
    """Whether the q/k/v/o projections carry a bias."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelArgs.{name} must be >= 1, got {getattr(self, name)}")
        if not 1 <= self.output_layer <= self.num_layers:
            raise ValueError(
                f"ModelArgs.output_layer={self.output_layer} must lie in [1, num_layers={self.num_layers}]")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelArgs.num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0 or self.max_position_embeddings < 1:
            raise ValueError(f"ModelArgs rms_norm_eps={self.rms_norm_eps}, rope_theta={self.rope_theta} and "
                             f"max_position_embeddings={self.max_position_embeddings} must be positive")
        if len(self.mrope_section) != 3 or sum(self.mrope_section) * 2 != self.head_dim:
            raise ValueError(
                f"ModelArgs.mrope_section={self.mrope_section} must sum to head_dim/2={self.head_dim // 2}")

    def text_config(self, num_layers: int | None = None) -> Qwen3VLTextConfig:
        """Return the `transformers` text config, with `num_layers` decoder layers (default: all)."""
        config = Qwen3VLTextConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers if num_layers is None else num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            hidden_act=self.hidden_act,
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            attention_bias=self.attention_bias,
            rope_parameters={
                "rope_type": self.rope_type,
                "rope_theta": self.rope_theta,
                "mrope_section": list(self.mrope_section),
                "mrope_interleaved": self.mrope_interleaved,
            },
        )
        config._attn_implementation = "sdpa"
        return config


# The architecture both presets share: the `text_config` of MiniMax-H3's text_encoder/config.json.
_QWEN3_VL_TEXT = dict(rms_norm_eps=1e-6, rope_theta=5_000_000.0, mrope_interleaved=True, rope_type="default",
                      max_position_embeddings=262_144, hidden_act="silu", attention_bias=False)

PRESETS: dict[str, ModelArgs] = {
    # text_config of MiniMax-H3 text_encoder/config.json (Qwen3-VL-32B); H3 reads hidden_states[50].
    "full": ModelArgs(vocab_size=151_936, hidden_size=5120, intermediate_size=25_600, num_layers=64,
                      output_layer=50, num_heads=64, num_kv_heads=8, head_dim=128, mrope_section=(24, 20, 20),
                      **_QWEN3_VL_TEXT),
    # Same architecture, CPU sized; hidden_size equals the tiny DiT's text_dim. vocab fits the tiny tokenizer.
    "tiny": ModelArgs(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=4, output_layer=3,
                      num_heads=4, num_kv_heads=2, head_dim=16, mrope_section=(4, 2, 2), **_QWEN3_VL_TEXT),
}


def get_preset(name: str) -> ModelArgs:
    """Return the named preset or raise naming the known ones."""
    if name not in PRESETS:
        raise ValueError(f"unknown text-encoder preset {name!r}; known presets: {sorted(PRESETS)}")
    return PRESETS[name]


class TextStack(nn.Module):
    """Token embedding + the first `output_layer` Qwen3-VL decoder layers, no final norm."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.config = args.text_config(num_layers=args.output_layer)
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(
            [Qwen3VLTextDecoderLayer(self.config, i) for i in range(args.output_layer)])
        self.rotary_emb = Qwen3VLTextRotaryEmbedding(config=self.config)

    def reset_rotary(self, device: torch.device | str) -> None:
        """Rebuild the (non-persistent) RoPE frequencies on `device`, e.g. after a meta-device build."""
        with torch.device(device):
            self.rotary_emb = Qwen3VLTextRotaryEmbedding(config=self.config)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # ids: [L] int64 -> hidden: [L, hidden]
        x = self.embed_tokens(ids)[None]  # x: [1, L, hidden]
        # Text only: the t, h and w rope axes all carry the token index.
        positions = torch.arange(ids.shape[0], device=ids.device)
        cos_sin = self.rotary_emb(x, positions.view(1, 1, -1).expand(3, 1, -1))
        for layer in self.layers:
            # attention_mask=None with SDPA means causal attention over the whole prompt.
            x = layer(x, position_embeddings=cos_sin, attention_mask=None, position_ids=positions[None])
        return x[0]


def checkpoint_key(param_name: str) -> str:
    """Map a `TextStack` parameter name to its key in the real Qwen3-VL checkpoint."""
    return TEXT_KEY_PREFIX + param_name


def _read_index(text_dir: Path) -> dict[str, str]:
    index_path = text_dir / "model.safetensors.index.json"
    if not index_path.is_file():
        raise EncoderCheckpointError(f"text-encoder index not found: {index_path}")
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise EncoderCheckpointError(f"bad text-encoder index {index_path}: {exc}") from exc
    if not isinstance(weight_map, dict):
        raise EncoderCheckpointError(f"bad text-encoder index {index_path}: weight_map is not an object")
    return weight_map


_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}


@contextmanager
def _open_shard(path: Path):
    if not path.is_file():
        raise EncoderCheckpointError(f"shard {path} named by the index does not exist")
    try:
        handle = safe_open(str(path), framework="pt", device="cpu")
    except (OSError, SafetensorError) as exc:  # truncated or corrupt header
        raise EncoderCheckpointError(f"cannot read shard {path}: {exc}") from exc
    with handle as f:
        yield f


def load_stack_weights(stack: TextStack, text_dir: Path, device: torch.device | str,
                       dtype: torch.dtype) -> None:
    """Load the embedding and layers < output_layer from the sharded checkpoint into a meta-built `stack`."""
    expected = {name: p for name, p in stack.state_dict().items()}
    weight_map = _read_index(text_dir)
    missing = [checkpoint_key(n) for n in expected if checkpoint_key(n) not in weight_map]
    if missing:
        raise EncoderCheckpointError(
            f"{len(missing)} tensors missing from {text_dir}/model.safetensors.index.json: {missing[:8]}")
    by_shard: dict[str, list[str]] = {}
    for name in expected:
        by_shard.setdefault(weight_map[checkpoint_key(name)], []).append(name)
    # Pass 1 reads only the shard headers, so every problem is reported before device memory is committed.
    problems: list[str] = []
    for shard, names in sorted(by_shard.items()):
        with _open_shard(text_dir / shard) as f:
            present = set(f.keys())
            for name in names:
                key = checkpoint_key(name)
                if key not in present:
                    problems.append(f"{key}: listed in the index but absent from {shard}")
                    continue
                header = f.get_slice(key)
                shape, want = tuple(header.get_shape()), tuple(expected[name].shape)
                if shape != want:
                    problems.append(f"{key}: shape {shape}, expected {want}")
                elif header.get_dtype() not in _FLOAT_DTYPES:
                    problems.append(f"{key}: dtype {header.get_dtype()}, expected a floating dtype")
    if problems:
        raise EncoderCheckpointError(f"text-encoder checkpoint {text_dir} does not match the preset: "
                                     + "; ".join(problems))
    loaded: dict[str, torch.Tensor] = {}
    shards = Steps(logger, "text-encoder shards", len(by_shard))
    for shard, names in sorted(by_shard.items()):
        with _open_shard(text_dir / shard) as f:
            for name in names:
                try:
                    loaded[name] = f.get_tensor(checkpoint_key(name)).to(device=device, dtype=dtype)
                except SafetensorError as exc:
                    raise EncoderCheckpointError(f"cannot read {checkpoint_key(name)} from {shard}: {exc}") from exc
        shards.tick(f"{shard}: {len(names)} tensors")
    stack.load_state_dict(loaded, strict=True, assign=True)
    stack.reset_rotary(device)


@dataclass
class TextEncoder:
    """Prompt -> `[L, hidden]` unnormalised layer-`output_layer` hidden states."""

    stack: TextStack
    tokenizer: object | None
    """A `transformers` tokenizer, or None for checkpoints without a vocabulary (use `encode_ids`)."""
    max_tokens: int = 512
    """Longest accepted prompt in tokens."""
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    graphs: CudaGraphBank | None = None
    """The stack captured per prompt bucket (`capture_graphs`); None runs it eagerly on the prompt's exact ids."""
    buckets: PromptBuckets | None = None
    """Prompt lengths the graphs were captured for (set with `graphs`)."""

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"TextEncoder.max_tokens must be >= 1, got {self.max_tokens}")

    @property
    def hidden_size(self) -> int:
        return self.stack.args.hidden_size

    @classmethod
    def load(cls, path: str | Path, preset: str, device: str | torch.device = "cpu",
             dtype: torch.dtype = torch.bfloat16, max_tokens: int = 512) -> "TextEncoder":
        """Load `path/text_encoder` (and `path/tokenizer` if it holds a vocabulary) for `preset`.

        Its config.json and the tokenizer's config are checked against the preset first; the stack is built from
        the checked config.
        """
        from services.encoder.checkpoint import read_checked_config  # checkpoint.py imports this module

        root = Path(path)
        args = read_checked_config(root, preset)
        with torch.device("meta"):
            stack = TextStack(args)
        load_stack_weights(stack, root / "text_encoder", device, dtype)
        stack.eval()
        tokenizer = load_tokenizer(root / "tokenizer")
        if tokenizer is not None and len(tokenizer) > args.vocab_size:
            raise EncoderCheckpointError(
                f"tokenizer at {root / 'tokenizer'} has {len(tokenizer)} tokens, more than the "
                f"preset {preset!r} vocab_size={args.vocab_size}")
        return cls(stack=stack, tokenizer=tokenizer, max_tokens=max_tokens, device=torch.device(device))

    @classmethod
    def random(cls, preset: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16,
               seed: int = 0, max_tokens: int = 512) -> "TextEncoder":
        """Build `preset` with random weights directly on `device` (benchmarks; no tokenizer, use `encode_ids`)."""
        args = get_preset(preset)
        gen = torch.Generator(device=device).manual_seed(seed)
        with torch.device("meta"):
            stack = TextStack(args)
        weights = {}
        for name, p in stack.state_dict().items():  # one tensor at a time, already in `dtype`
            t = torch.empty(p.shape, device=device, dtype=dtype)
            weights[name] = t.normal_(0.0, 0.02, generator=gen) if p.ndim > 1 else t.fill_(1.0)
        stack.load_state_dict(weights, strict=True, assign=True)
        stack.reset_rotary(device)
        stack.eval()
        return cls(stack=stack, tokenizer=None, max_tokens=max_tokens, device=torch.device(device))

    @torch.inference_mode()
    def capture_graphs(self, buckets: PromptBuckets) -> None:
        """Record the stack on every bucket's length as a CUDA graph (start-up; on the CPU an eager bank).

        The stack is causal, so ids padded at the end leave the real rows' hidden states as they are.
        """
        if buckets.sizes[-1] < self.max_tokens:
            raise ValueError(f"prompt buckets {list(buckets.sizes)} do not hold max_tokens={self.max_tokens}")
        bank = CudaGraphBank(self.device)
        captured = Steps(logger, "text-encoder CUDA graphs", len(buckets.sizes))
        for size in buckets.sizes:
            ids = torch.zeros(size, dtype=torch.long, device=self.device)
            bank.capture(GraphKey.for_inputs("text_encoder", [ids]), self.stack, [ids])
            captured.tick(f"{size} tokens")
        bank.seal()
        self.graphs, self.buckets = bank, buckets

    def tokenize(self, prompt: str) -> list[int]:
        """Return the token ids of the stripped raw prompt (no chat template, no special tokens added).

        Leading and trailing whitespace is dropped first, as TaoMate-H3 does to every prompt before tokenizing.
        """
        if self.tokenizer is None:
            raise EncoderInputError("this text encoder has no tokenizer (random-weight checkpoint); "
                                    "use encode_ids() with token ids")
        if not isinstance(prompt, str) or not prompt.strip():
            raise EncoderInputError("prompt is empty; send at least one non-blank character")
        return list(self.tokenizer(prompt.strip(), add_special_tokens=False)["input_ids"])

    @torch.inference_mode()
    def encode(self, prompt: str) -> torch.Tensor:
        """Encode a raw prompt to `[L, hidden]` in the model dtype."""
        return self.encode_ids(self.tokenize(prompt))

    @torch.inference_mode()
    def encode_bytes(self, prompt: str) -> torch.Tensor:
        """Encode a prompt's UTF-8 bytes as token ids: random-weight checkpoints ship no vocabulary (benchmarks)."""
        return self.encode_ids([b % self.stack.args.vocab_size for b in prompt.encode()])

    @torch.inference_mode()
    def encode_ids(self, ids: list[int] | torch.Tensor) -> torch.Tensor:
        """Encode token ids `[L]` to `[L, hidden]` in the model dtype."""
        ids = torch.as_tensor(ids, dtype=torch.long)
        if ids.ndim != 1 or ids.numel() == 0:
            raise EncoderInputError(f"token ids must be a non-empty 1-D sequence, got shape {tuple(ids.shape)}")
        if ids.numel() > self.max_tokens:
            raise EncoderInputError(
                f"prompt has {ids.numel()} tokens, more than max_tokens={self.max_tokens}; shorten it")
        vocab = self.stack.args.vocab_size
        if int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise EncoderInputError(f"token ids must lie in [0, {vocab}), got [{int(ids.min())}, {int(ids.max())}]")
        ids = ids.to(self.device)
        if self.graphs is None:
            return self.stack(ids)
        padded, n = self.buckets.pad(ids)  # [L] -> [bucket]
        out = self.graphs.run(GraphKey.for_inputs("text_encoder", [padded]), self.stack, [padded])
        return out[:n].clone()  # [L, hidden]; the graph's output buffer belongs to the next replay


def load_tokenizer(tokenizer_dir: Path):
    """Load a tokenizer from `tokenizer_dir`, or return None when it holds no vocabulary file."""
    vocab_files = ("tokenizer.json", "vocab.json")
    if not any((tokenizer_dir / name).is_file() for name in vocab_files):
        logger.info("no tokenizer vocabulary under %s; only encode_ids() is available", tokenizer_dir)
        return None
    return AutoTokenizer.from_pretrained(str(tokenizer_dir))
