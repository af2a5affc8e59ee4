"""The text encoder's presets and the check of a checkpoint's config against one.

`ModelArgs` holds the Qwen3-VL text stack's dims; `PRESETS` the real model's (`full`) and a CPU-sized one of the
same architecture (`tiny`). `read_checked_config` reads `text_encoder/config.json` (a `qwen3_vl` config whose
`text_config` carries the text stack's dims and RoPE) and `tokenizer/tokenizer_config.json`, and refuses, naming
every disagreement, a checkpoint that differs from the preset; `TextEncoder.load` builds the stack from what it
returns, and the random-checkpoint writer writes what it accepts.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from transformers import Qwen3VLTextConfig

from services.common.errors import InternalError

logger = logging.getLogger(__name__)


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


class EncoderConfigError(EncoderCheckpointError):
    """text_encoder/config.json or the tokenizer's config is unreadable or disagrees with the preset."""


# ModelArgs field -> its key in `text_config` of text_encoder/config.json (`output_layer` is the preset's choice).
_TEXT_KEYS = {"vocab_size": "vocab_size", "hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
              "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
              "num_kv_heads": "num_key_value_heads", "head_dim": "head_dim", "rms_norm_eps": "rms_norm_eps",
              "max_position_embeddings": "max_position_embeddings", "hidden_act": "hidden_act",
              "attention_bias": "attention_bias"}
# ModelArgs field -> its key among the RoPE settings: `rope_parameters` as transformers writes them, or, in the
# shipped file, `rope_theta` beside `rope_scaling`.
_ROPE_KEYS = {"rope_theta": "rope_theta", "mrope_section": "mrope_section", "mrope_interleaved": "mrope_interleaved",
              "rope_type": "rope_type"}
# Token ids the config names; each must be a row of the embedding.
_TOP_ID_KEYS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
_TEXT_ID_KEYS = ("bos_token_id", "eos_token_id")


def _read_json(path: Path) -> dict:
    try:
        cfg = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise EncoderConfigError(f"{path} is not readable JSON: {exc}") from exc
    if not isinstance(cfg, dict):
        raise EncoderConfigError(f"{path} is not a JSON object")
    return cfg


def _rope_settings(text: dict) -> dict:
    rope = dict(text.get("rope_scaling") or {})
    if "rope_theta" in text:
        rope["rope_theta"] = text["rope_theta"]
    rope.update(text.get("rope_parameters") or {})
    return rope


def config_mismatches(cfg: dict, preset: ModelArgs) -> list[str]:
    """Every way a `qwen3_vl` config dict differs from `preset`, as `field: checkpoint X, preset Y` lines."""
    problems: list[str] = []
    if cfg.get("model_type") != "qwen3_vl":
        problems.append(f"model_type: checkpoint {cfg.get('model_type')!r}, preset 'qwen3_vl'")
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        return problems + ["text_config: checkpoint missing, preset a qwen3_vl_text config"]
    rope = _rope_settings(text)
    for source, keys in ((text, _TEXT_KEYS), (rope, _ROPE_KEYS)):
        for name, key in keys.items():
            want, label = getattr(preset, name), name if name == key else f"{name} ({key})"
            shown = list(want) if isinstance(want, tuple) else want
            if key not in source:
                problems.append(f"{label}: checkpoint missing, preset {shown!r}")
                continue
            got = tuple(source[key]) if isinstance(want, tuple) and isinstance(source[key], list) else source[key]
            if got != want or isinstance(got, bool) != isinstance(want, bool):
                problems.append(f"{label}: checkpoint {source[key]!r}, preset {shown!r}")
    for source, keys in ((cfg, _TOP_ID_KEYS), (text, _TEXT_ID_KEYS)):
        for key in keys:
            token = source.get(key)
            if isinstance(token, int) and not 0 <= token < preset.vocab_size:
                problems.append(f"{key}: checkpoint {token}, outside the preset vocab_size={preset.vocab_size}")
    return problems


def tokenizer_mismatches(tok_cfg: dict, preset: ModelArgs) -> list[str]:
    """Every way a tokenizer_config.json dict disagrees with `preset` (added-token ids, longest prompt)."""
    problems: list[str] = []
    added = tok_cfg.get("added_tokens_decoder") or {}
    try:
        ids = [int(i) for i in added]
    except ValueError:
        return [f"tokenizer added_tokens_decoder: checkpoint ids {sorted(added)[:4]}..., preset integer ids"]
    if ids and max(ids) >= preset.vocab_size:
        problems.append(f"tokenizer added_tokens_decoder: checkpoint highest id {max(ids)}, "
                        f"preset vocab_size {preset.vocab_size}")
    longest = tok_cfg.get("model_max_length")
    if isinstance(longest, int) and longest > preset.max_position_embeddings:
        problems.append(f"tokenizer model_max_length: checkpoint {longest}, "
                        f"preset max_position_embeddings {preset.max_position_embeddings}")
    return problems


def read_checked_config(root: str | Path, preset: str) -> ModelArgs:
    """Read `root/text_encoder/config.json` and `root/tokenizer/tokenizer_config.json`; return the checked args.

    Raises `EncoderConfigError` naming every field that disagrees with the preset (field, checkpoint value, preset
    value). The tokenizer's config may be absent only where the tokenizer folder holds no vocabulary either.
    """
    args = get_preset(preset)
    root = Path(root)
    config_path = root / "text_encoder" / "config.json"
    if not config_path.is_file():
        raise EncoderConfigError(f"text-encoder config not found: {config_path}")
    problems = config_mismatches(_read_json(config_path), args)
    tok_dir = root / "tokenizer"
    tok_path = tok_dir / "tokenizer_config.json"
    if tok_path.is_file():
        problems += tokenizer_mismatches(_read_json(tok_path), args)
    elif any((tok_dir / name).is_file() for name in ("tokenizer.json", "vocab.json")):
        problems.append(f"tokenizer config: checkpoint has a vocabulary under {tok_dir} but no tokenizer_config.json")
    else:
        logger.info("no tokenizer config under %s; only the text encoder's config is checked", tok_dir)
    if problems:
        raise EncoderConfigError(f"text-encoder checkpoint {root} does not match the preset {preset!r} "
                                 f"(field: checkpoint value, preset value): " + "; ".join(problems))
    return args
