"""The DiT base trainer (tools/train/dit.py) on the CPU: a whole-clip document of the right shape, a few steps that
lower the flow-matching loss on one clip, a resumed run that continues the step count, and an exported state that
loads through the service's `load_dit` with the trainer's forward."""

from dataclasses import replace

import json
import pytest
import torch

from services.dit.model.checkpoint import load_dit
from services.dit.model.network import PRESETS, build_random, is_fp32_param
from services.encoder.checkpoint import write_random_checkpoint as write_encoder
from services.vae.checkpoint import write_random_checkpoint as write_vaes
from tools.train import dit as trainer

pytestmark = [pytest.mark.cpu, pytest.mark.slow]


@pytest.fixture(scope="module")
def conditioner(tmp_path_factory):
    root = tmp_path_factory.mktemp("minimax")
    write_encoder("tiny", root)
    write_vaes("tiny", root)
    return trainer.Conditioner(root, root, torch.device("cpu"), frames=22, cache=True)


def test_an_example_is_a_whole_clip_in_normalised_latents_with_its_caption(conditioner):
    ex = conditioner.example(3)
    assert ex.video.shape == (7, 24, 12, 20) and ex.audio.shape == (2, trainer.audio_latents(22), 32)
    assert trainer.audio_latents(124) == 207
    assert ex.text.shape[1] == 64 and ex.caption.startswith("a ")
    assert torch.isfinite(ex.video).all() and torch.isfinite(ex.audio).all()


def test_the_noise_levels_follow_the_samplers_shifts():
    u = torch.tensor([0.0, 0.5, 1.0])
    assert trainer.shifted(u, 12.0).tolist() == pytest.approx([0.0, 12 / 13, 1.0])
    assert trainer.shifted(u, 3.0).tolist() == pytest.approx([0.0, 0.75, 1.0])


def test_training_lowers_the_loss_on_one_clip_and_a_resumed_run_continues(conditioner, tmp_path):
    cfg = trainer.DiTRunConfig(frames=22, accum=1, lr=2e-3, warmup=1, max_steps=30, log_every=10, distinct=1)
    trainer.train(replace(cfg, max_steps=20), conditioner, tmp_path)
    state = trainer.train(cfg, conditioner, tmp_path)
    assert state.step == 30
    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [10, 20, 30]
    first, last = records[0], records[-1]
    assert last["video"] + last["audio"] < 0.8 * (first["video"] + first["audio"])


def test_an_exported_state_loads_through_load_dit_with_the_trainers_forward(conditioner, tmp_path):
    cfg = trainer.DiTRunConfig(frames=22, accum=1, lr=2e-3, warmup=1, max_steps=3, distinct=1)
    state = trainer.train(cfg, conditioner, tmp_path / "state")
    root = trainer.export_saved(tmp_path / "state", "tiny", tmp_path / "export")
    assert root == tmp_path / "export" / "FL2VA" / "transformer"
    assert len(list(root.glob("model-*-of-00013.safetensors"))) == 13
    loaded = load_dit(root.parent, PRESETS["tiny"], "cpu", dtype=torch.float32)

    # the trainer's model with its EMA weights, the BF16-stored ones rounded as the file stores them
    expect = build_random(PRESETS["tiny"], "cpu", torch.float32, 0)
    state.ema.copy_to(expect)
    with torch.no_grad():
        for name, p in expect.state_dict().items():
            if not is_fp32_param(name):
                p.copy_(p.to(torch.bfloat16).float())
    ex = conditioner.example(trainer.TRAIN_SEED)
    torch.manual_seed(5)
    want = trainer.flow_matching_loss(expect, ex)
    torch.manual_seed(5)
    got = trainer.flow_matching_loss(loaded, ex)
    assert got.video == pytest.approx(want.video, rel=1e-5) and got.audio == pytest.approx(want.audio, rel=1e-5)
