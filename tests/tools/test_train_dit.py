"""The DiT base trainer (tools/train/dit.py) on the CPU: a whole-clip document of the right shape, a few steps that
lower the flow-matching loss on one clip, and a resumed run that continues the step count."""

from dataclasses import replace

import json
import pytest
import torch

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
