"""Text-encoder config check: text_encoder/config.json and the tokenizer's config against the preset (CPU)."""
import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from services.encoder.checkpoint import write_random_checkpoint
from services.encoder.model import TextEncoder, TextStack
from services.encoder.preset import PRESETS, EncoderCheckpointError, EncoderConfigError, read_checked_config

pytestmark = pytest.mark.cpu

# The nearest shared/reference above this file: the checkout's own, or the one beside the checkouts.
REAL_ROOT = next((d / "shared/reference/checkpoints/MiniMax-H3" for d in Path(__file__).resolve().parents
                  if (d / "shared/reference/checkpoints/MiniMax-H3").is_dir()), Path("/nonexistent"))
needs_real = pytest.mark.skipif(not (REAL_ROOT / "text_encoder/config.json").is_file(),
                                reason="reference checkpoint configs not present")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return write_random_checkpoint("tiny", tmp_path_factory.mktemp("te"), seed=1)


@pytest.fixture
def real_copy(tmp_path) -> Path:
    """The shipped text_encoder/config.json and tokenizer config in a tree of their own, to edit."""
    for sub in ("text_encoder/config.json", "tokenizer/tokenizer_config.json"):
        (tmp_path / sub).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REAL_ROOT / sub, tmp_path / sub)
    return tmp_path


def _edit(root: Path, name: str, change) -> None:
    path = root / name
    cfg = json.loads(path.read_text())
    change(cfg)
    path.write_text(json.dumps(cfg))


@needs_real
def test_real_config_is_accepted_against_the_full_preset():
    assert read_checked_config(REAL_ROOT, "full") == PRESETS["full"]


@needs_real
@pytest.mark.parametrize("change, named", [
    (lambda t: t.update(rope_theta=1_000_000), "rope_theta: checkpoint 1000000, preset 5000000.0"),
    (lambda t: t.update(rms_norm_eps=1e-5), "rms_norm_eps: checkpoint 1e-05, preset 1e-06"),
    (lambda t: t["rope_scaling"].update(mrope_section=[16, 24, 24]),
     "mrope_section: checkpoint [16, 24, 24], preset [24, 20, 20]"),
    (lambda t: t.update(num_key_value_heads=16), "num_kv_heads (num_key_value_heads): checkpoint 16, preset 8"),
])
def test_a_changed_setting_is_refused_naming_it(real_copy, change, named):
    _edit(real_copy, "text_encoder/config.json", lambda cfg: change(cfg["text_config"]))
    with pytest.raises(EncoderConfigError) as err:
        read_checked_config(real_copy, "full")
    assert str(err.value).split("preset value): ", 1)[1] == named  # this one mismatch and nothing else


@needs_real
def test_two_changes_are_named_in_one_error(real_copy):
    def change(cfg):
        cfg["text_config"]["rope_theta"] = 10_000
        cfg["text_config"]["rms_norm_eps"] = 1e-5
    _edit(real_copy, "text_encoder/config.json", change)
    _edit(real_copy, "tokenizer/tokenizer_config.json",
          lambda cfg: cfg["added_tokens_decoder"].update({"151936": {"content": "<|extra|>", "special": True}}))
    with pytest.raises(EncoderConfigError) as err:
        read_checked_config(real_copy, "full")
    message = str(err.value)
    assert "rope_theta: checkpoint 10000, preset 5000000.0" in message
    assert "rms_norm_eps: checkpoint 1e-05, preset 1e-06" in message
    assert "tokenizer added_tokens_decoder: checkpoint highest id 151936, preset vocab_size 151936" in message


@needs_real
def test_missing_rope_settings_and_wrong_model_type_are_named(real_copy):
    def change(cfg):
        cfg["model_type"] = "qwen2_vl"
        del cfg["text_config"]["rope_scaling"]
    _edit(real_copy, "text_encoder/config.json", change)
    with pytest.raises(EncoderConfigError) as err:
        read_checked_config(real_copy, "full")
    message = str(err.value)
    assert "model_type: checkpoint 'qwen2_vl', preset 'qwen3_vl'" in message
    assert "mrope_section: checkpoint missing, preset [24, 20, 20]" in message
    assert "rope_theta" not in message  # still read from beside rope_scaling


def test_tiny_writer_config_round_trips(ckpt):
    assert read_checked_config(ckpt, "tiny") == PRESETS["tiny"]
    text = json.loads((ckpt / "text_encoder/config.json").read_text())["text_config"]
    rope = text["rope_parameters"]
    assert (rope["rope_theta"], rope["mrope_section"], text["rms_norm_eps"]) == (5_000_000.0, [4, 2, 2], 1e-6)
    assert (ckpt / "tokenizer/tokenizer_config.json").is_file()
    with pytest.raises(EncoderConfigError, match="hidden_size: checkpoint 64, preset 5120"):
        read_checked_config(ckpt, "full")


def test_load_refuses_a_changed_config_before_reading_weights(ckpt, tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(ckpt, root)
    _edit(root, "text_encoder/config.json",
          lambda cfg: cfg["text_config"]["rope_parameters"].update(rope_theta=10_000.0, mrope_section=[2, 4, 2]))
    with pytest.raises(EncoderCheckpointError, match=r"rope_theta: checkpoint 10000\.0, preset 5000000\.0; "
                                                     r"mrope_section: checkpoint \[2, 4, 2\], preset \[4, 2, 2\]"):
        TextEncoder.load(root, "tiny", "cpu", torch.float32)


def test_tokenizer_vocabulary_without_its_config_is_refused(ckpt, tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(ckpt, root)
    (root / "tokenizer/tokenizer_config.json").unlink()
    with pytest.raises(EncoderConfigError, match="no tokenizer_config.json"):
        read_checked_config(root, "tiny")
    (root / "text_encoder/config.json").unlink()
    with pytest.raises(EncoderConfigError, match="text-encoder config not found"):
        read_checked_config(root, "tiny")


def test_model_rope_follows_the_preset_not_a_literal():
    # The RoPE inverse frequencies the stack builds come from the args' theta.
    base = TextStack(PRESETS["tiny"]).rotary_emb.inv_freq
    other = TextStack(replace(PRESETS["tiny"], rope_theta=10_000.0)).rotary_emb.inv_freq
    assert torch.allclose(base, 5_000_000.0 ** (-torch.arange(0, 16, 2, dtype=torch.float) / 16))
    assert not torch.allclose(base, other)
