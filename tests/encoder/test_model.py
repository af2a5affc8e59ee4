"""Text encoder: parity with transformers' Qwen3-VL, checkpoint layout and loader errors (tiny preset, CPU)."""
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration

from services.encoder.checkpoint import text_encoder_config, write_random_checkpoint
from services.encoder.model import EncoderInputError, TextEncoder, TextStack, checkpoint_key
from services.encoder.preset import PRESETS, EncoderCheckpointError

pytestmark = pytest.mark.cpu

REAL = Path(__file__).resolve().parents[3] / "shared/reference/checkpoints/MiniMax-H3/text_encoder"
PROMPT = "A cat plays on a sunny windowsill. <d>Hello there!</d> zebra \u2603"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    # Small shards so that the vision tower and the unused last layer land in shards of their own.
    return write_random_checkpoint("tiny", tmp_path_factory.mktemp("te"), seed=3, max_shard_bytes=20_000)


def _copy(ckpt: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(ckpt, dst)
    return dst


def _index(root: Path) -> dict:
    return json.loads((root / "text_encoder/model.safetensors.index.json").read_text())


def test_parity_with_transformers_hidden_states(ckpt):
    enc = TextEncoder.load(ckpt, "tiny", "cpu", torch.float32)
    ids = enc.tokenize(PROMPT)
    ours = enc.encode(PROMPT)
    ref_model = Qwen3VLForConditionalGeneration.from_pretrained(
        ckpt / "text_encoder", dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        out = ref_model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    layer = PRESETS["tiny"].output_layer
    ref = out.hidden_states[layer][0]
    assert ours.shape == (len(ids), PRESETS["tiny"].hidden_size)
    assert ((ours - ref).norm() / ref.norm()).item() < 1e-5
    # The normalised final output is something else: the test would catch returning the wrong layer.
    assert ((ours - out.hidden_states[-1][0]).norm() / ref.norm()).item() > 1e-2


def test_raw_prompt_no_chat_template_and_causal(ckpt):
    enc = TextEncoder.load(ckpt, "tiny", "cpu", torch.float32)
    tok = AutoTokenizer.from_pretrained(ckpt / "tokenizer")
    assert enc.tokenize(PROMPT) == tok(PROMPT, add_special_tokens=False)["input_ids"]
    assert tok.decode(enc.tokenize(PROMPT)) == PROMPT
    assert "<|im_start|>" not in tok.decode(enc.tokenize(PROMPT))
    full = enc.encode(PROMPT)
    prefix_ids = enc.tokenize(PROMPT)[:5]
    # Causal attention: a prefix encodes to the prefix rows of the whole prompt.
    torch.testing.assert_close(enc.encode_ids(prefix_ids), full[:5], rtol=1e-5, atol=1e-5)


def test_prompt_is_stripped_before_tokenizing(ckpt):
    # TaoMate-H3 strips every prompt (runtime precompute_text_prompts, config resolve_prompts) before it becomes
    # ids, so surrounding whitespace and newlines must not reach the tokenizer.
    enc = TextEncoder.load(ckpt, "tiny", "cpu", torch.float32)
    padded = "  \n" + PROMPT + " \t\n"
    assert enc.tokenize(padded) == enc.tokenize(PROMPT)
    torch.testing.assert_close(enc.encode(padded), enc.encode(PROMPT), rtol=0, atol=0)
    # Inner whitespace is the prompt's own and stays.
    assert enc.tokenize("a  cat") != enc.tokenize("a cat")


def test_loader_skips_vision_and_late_layer_shards(ckpt, tmp_path):
    root = _copy(ckpt, tmp_path)
    index = _index(root)["weight_map"]
    needed = {index[checkpoint_key(n)] for n in TextStack(PRESETS["tiny"]).state_dict()}
    skipped = set(index.values()) - needed
    assert skipped, "the tiny checkpoint should have shards holding only unused tensors"
    for shard in skipped:
        (root / "text_encoder" / shard).write_bytes(b"not a safetensors file")
    enc = TextEncoder.load(root, "tiny", "cpu", torch.float32)
    ref = TextEncoder.load(ckpt, "tiny", "cpu", torch.float32)
    torch.testing.assert_close(enc.encode(PROMPT), ref.encode(PROMPT), rtol=0, atol=0)


def test_checkpoint_layout_matches_transformers_model(ckpt):
    index = _index(ckpt)
    config = text_encoder_config("tiny")
    with torch.device("meta"):
        model = Qwen3VLForConditionalGeneration(config)
    assert set(index["weight_map"]) == set(model.state_dict())
    assert any(k.startswith("model.visual.") for k in index["weight_map"])
    shards = sorted(set(index["weight_map"].values()))
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    with safe_open(str(ckpt / "text_encoder" / shards[0]), framework="pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    cfg = json.loads((ckpt / "text_encoder/config.json").read_text())
    assert cfg["model_type"] == "qwen3_vl" and cfg["text_config"]["hidden_size"] == 64


@pytest.mark.skipif(not REAL.is_dir(), reason="reference checkpoint configs not present")
def test_full_preset_matches_real_config_and_weight_map():
    real_cfg = json.loads((REAL / "config.json").read_text())["text_config"]
    args = PRESETS["full"]
    assert (args.hidden_size, args.intermediate_size, args.num_layers, args.num_heads, args.num_kv_heads,
            args.head_dim, args.vocab_size) == (
        real_cfg["hidden_size"], real_cfg["intermediate_size"], real_cfg["num_hidden_layers"],
        real_cfg["num_attention_heads"], real_cfg["num_key_value_heads"], real_cfg["head_dim"],
        real_cfg["vocab_size"])
    assert args.rope_theta == real_cfg["rope_theta"]
    assert list(args.mrope_section) == real_cfg["rope_scaling"]["mrope_section"]
    real_keys = set(json.loads((REAL / "model.safetensors.index.json").read_text())["weight_map"])
    with torch.device("meta"):
        model = Qwen3VLForConditionalGeneration(text_encoder_config("full"))
        stack = TextStack(args)
    assert set(model.state_dict()) == real_keys  # the writer produces exactly the real key set
    ours = {checkpoint_key(n) for n in stack.state_dict()}
    assert ours <= real_keys
    assert len(ours) == 1 + 11 * 50  # embedding + 11 tensors per layer for layers 0..49


def test_empty_and_too_long_prompts(ckpt):
    enc = TextEncoder.load(ckpt, "tiny", "cpu", torch.float32, max_tokens=8)
    with pytest.raises(EncoderInputError, match="empty"):
        enc.encode("   ")
    with pytest.raises(EncoderInputError, match="max_tokens=8"):
        enc.encode("a very long prompt that certainly has more than eight tokens in it")
    with pytest.raises(EncoderInputError, match=r"\[0, 512\)"):
        enc.encode_ids([1, 2, 512])
    with pytest.raises(EncoderInputError, match="non-empty"):
        enc.encode_ids([])


def test_random_build_without_tokenizer():
    enc = TextEncoder.random("tiny", "cpu", torch.float32, seed=0)
    out = enc.encode_ids(torch.arange(7))
    assert out.shape == (7, 64) and torch.isfinite(out).all()
    with pytest.raises(EncoderInputError, match="encode_ids"):
        enc.encode("hello")


def test_missing_tensor_is_named(ckpt, tmp_path):
    root = _copy(ckpt, tmp_path)
    index = _index(root)
    key = "model.language_model.layers.1.mlp.up_proj.weight"
    del index["weight_map"][key]
    (root / "text_encoder/model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(EncoderCheckpointError, match=key.replace(".", r"\.")):
        TextEncoder.load(root, "tiny", "cpu", torch.float32)


def test_wrong_shape_and_truncated_shard_are_named(ckpt, tmp_path):
    root = _copy(ckpt, tmp_path)
    key = "model.language_model.layers.0.self_attn.q_proj.weight"
    shard = root / "text_encoder" / _index(root)["weight_map"][key]
    with safe_open(str(shard), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    original = tensors[key]
    tensors[key] = original[:-1]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(EncoderCheckpointError, match=r"q_proj\.weight: shape \(63, 64\), expected \(64, 64\)"):
        TextEncoder.load(root, "tiny", "cpu", torch.float32)
    tensors[key] = original.to(torch.int32)  # right shape, wrong type
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(EncoderCheckpointError, match=r"q_proj\.weight: dtype I32, expected a floating dtype"):
        TextEncoder.load(root, "tiny", "cpu", torch.float32)
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(EncoderCheckpointError, match="cannot read shard"):
        TextEncoder.load(root, "tiny", "cpu", torch.float32)


def test_bad_index_and_unknown_preset(ckpt, tmp_path):
    root = _copy(ckpt, tmp_path)
    (root / "text_encoder/model.safetensors.index.json").write_text("{not json")
    with pytest.raises(EncoderCheckpointError, match="bad text-encoder index"):
        TextEncoder.load(root, "tiny", "cpu", torch.float32)
    with pytest.raises(ValueError, match="known presets"):
        TextEncoder.load(root, "medium", "cpu", torch.float32)
