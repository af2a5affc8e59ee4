"""Random-weight MiniMax-H3 `text_encoder/` checkpoints, to test the loader and to serve the tiny preset.

Knows nothing about serving. The config the loader checks (`services.encoder.preset.read_checked_config`) is the
one written here.

`write_random_checkpoint` writes the exact on-disk layout: `text_encoder/config.json`, BF16 safetensors shards named
`model-0000i-of-0000N.safetensors` and `model.safetensors.index.json` with the real key names, and for `tiny` an
offline `tokenizer/` (tokenizer.json + tokenizer_config.json).

Every key of the real weight map is written, the vision tower included (the key set is taken from the
`transformers` `Qwen3VLForConditionalGeneration` built on the meta device, which equals the real index), so a
checkpoint loads into `transformers` unchanged and the encoder's loader is exercised on a file that contains the
tensors it must skip. The `full` preset is therefore ~66.7 GB on disk; benchmarks build it with
`TextEncoder.random(...)` on the device instead.

The whole tree of a preset is written by `python -m services.checkpoints`.
"""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen3VLConfig, Qwen3VLForConditionalGeneration

from services.encoder.preset import ModelArgs, get_preset

logger = logging.getLogger(__name__)

# Vision tower dims: the real Qwen3-VL-32B ViT for `full`, a two-block one for `tiny`.
_VISION = {
    "full": dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, deepstack_visual_indexes=[8, 16, 24],
                 num_position_embeddings=2304),
    "tiny": dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, deepstack_visual_indexes=[0, 1],
                 num_position_embeddings=64),
}
# Real special-token ids of Qwen3-VL (text_encoder/config.json); the tiny vocabulary puts them at its end.
_SPECIAL_IDS_FULL = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
                         vision_end_token_id=151653, bos_token_id=151643, eos_token_id=151645)
TINY_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                       "<|image_pad|>", "<|video_pad|>", "<d>", "</d>"]
DEFAULT_SHARD_BYTES = {"full": 5_000_000_000, "tiny": 200_000}

# A small built-in corpus for the offline tiny byte-level BPE; it mirrors the kind of prompts the service sees.
_TINY_CORPUS = [
    "A calm lake at sunrise, mist over the water, a wooden boat drifting slowly.",
    "A woman in a red coat walks through a snowy city street at night, neon signs glowing.",
    "Close-up of a cat playing with a ball of yarn on a sunny windowsill.",
    "<d>Hello there, how are you today?</d> she asks, smiling at the camera.",
    "Drone shot over green mountains and a winding river, clouds moving fast.",
    "A chef slices vegetables in a busy kitchen; steam rises from the pots.",
    "The man turns to the camera and says <d>We have to leave now.</d>",
    "Waves crash on a rocky shore under a stormy grey sky, seagulls flying.",
    "A child laughs while running through a field of yellow flowers in spring.",
    "An old train crosses a stone bridge in the evening light, smoke trailing.",
    "Rain falls on a quiet street; a dog shakes water from its fur.",
    "Two friends talk in a cafe, cups of coffee on the table, soft music playing.",
]


def text_encoder_config(preset: str) -> Qwen3VLConfig:
    """Return the `qwen3_vl` config of `preset` in the layout of the real `text_encoder/config.json`."""
    args: ModelArgs = get_preset(preset)
    text = args.text_config().to_dict()
    special = _SPECIAL_IDS_FULL if preset == "full" else _tiny_special_ids(args)
    text.update(bos_token_id=special["bos_token_id"], eos_token_id=special["eos_token_id"])
    vision = dict(_VISION[preset], hidden_act="gelu_pytorch_tanh", in_channels=3, patch_size=16,
                  spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=args.hidden_size)
    config = Qwen3VLConfig(
        text_config=text, vision_config=vision, tie_word_embeddings=False,
        image_token_id=special["image_token_id"], video_token_id=special["video_token_id"],
        vision_start_token_id=special["vision_start_token_id"], vision_end_token_id=special["vision_end_token_id"],
    )
    config.architectures = ["Qwen3VLForConditionalGeneration"]
    return config


def _tiny_special_ids(args: ModelArgs) -> dict[str, int]:
    base = args.vocab_size - len(TINY_SPECIAL_TOKENS)
    pos = {tok: base + i for i, tok in enumerate(TINY_SPECIAL_TOKENS)}
    return dict(bos_token_id=pos["<|endoftext|>"], eos_token_id=pos["<|im_end|>"],
                vision_start_token_id=pos["<|vision_start|>"], vision_end_token_id=pos["<|vision_end|>"],
                image_token_id=pos["<|image_pad|>"], video_token_id=pos["<|video_pad|>"])


def _random_tensor(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    # Weights ~ N(0, 1/fan_in) so every layer changes its input; norm scales near 1; biases small.
    if len(shape) >= 2:
        return torch.randn(shape, generator=gen) * math.prod(shape[1:]) ** -0.5
    if "norm" in name:
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    return 0.02 * torch.randn(shape, generator=gen)


def _plan_shards(shapes: dict[str, tuple[int, ...]], bytes_per_value: int, max_shard_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * bytes_per_value
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def write_tiny_tokenizer(out_dir: Path, vocab_size: int) -> None:
    """Train and save an offline byte-level BPE (tokenizer.json + tokenizer_config.json) of `vocab_size` ids."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(TINY_SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(_TINY_CORPUS, trainer=trainer)
    # Special tokens go after the learned vocabulary, like Qwen's added tokens after its BPE ids.
    tokenizer.add_special_tokens(TINY_SPECIAL_TOKENS)
    if tokenizer.get_vocab_size() > vocab_size:
        raise ValueError(f"tiny tokenizer has {tokenizer.get_vocab_size()} ids, more than vocab_size={vocab_size}")
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=TINY_SPECIAL_TOKENS[3:],
                                   model_max_length=262_144)
    fast.save_pretrained(str(out_dir))


def write_random_checkpoint(preset: str, out_dir: str | Path, seed: int = 0,
                            max_shard_bytes: int | None = None) -> Path:
    """Write `out_dir/text_encoder` (+ `out_dir/tokenizer` for tiny) with seeded random BF16 weights."""
    args = get_preset(preset)
    root = Path(out_dir)
    text_dir = root / "text_encoder"
    text_dir.mkdir(parents=True, exist_ok=True)
    config = text_encoder_config(preset)
    with torch.device("meta"):
        model = Qwen3VLForConditionalGeneration(config)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    config_dict = config.to_dict()
    config_dict["text_config"]["dtype"] = "bfloat16"
    (text_dir / "config.json").write_text(json.dumps(config_dict, indent=2, sort_keys=True))

    shards = _plan_shards(shapes, 2, max_shard_bytes or DEFAULT_SHARD_BYTES[preset])
    gen = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    total = 0
    for i, names in enumerate(shards):
        shard_name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {n: _random_tensor(n, shapes[n], gen).to(torch.bfloat16) for n in names}
        save_file(tensors, str(text_dir / shard_name), metadata={"format": "pt"})
        total += sum(t.numel() * 2 for t in tensors.values())
        weight_map.update({n: shard_name for n in names})
        logger.info("wrote %s (%d tensors)", shard_name, len(names))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (text_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    if preset == "tiny":
        write_tiny_tokenizer(root / "tokenizer", args.vocab_size)
    return root
