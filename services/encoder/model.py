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
from transformers import AutoTokenizer
from transformers.models.qwen3_vl.modeling_qwen3_vl import (
    Qwen3VLTextDecoderLayer,
    Qwen3VLTextRotaryEmbedding,
)

from services.common.errors import InvalidInput
from services.common.startup import Steps
from services.encoder.preset import EncoderCheckpointError, ModelArgs, get_preset, read_checked_config
from services.tensors.cuda_graphs import CudaGraphBank, GraphKey, PromptBuckets

logger = logging.getLogger(__name__)

TEXT_KEY_PREFIX = "model.language_model."


class EncoderInputError(InvalidInput):
    """The prompt or token ids cannot be encoded (empty, too long, out-of-vocabulary id)."""


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
