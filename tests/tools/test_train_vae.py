"""The VAE trainer (tools/train/vae.py) on the CPU: a few steps lower the loss, a resumed run continues the step
count and ends where an unbroken run ends, and the exported weights load through the service's loaders."""

import json
from dataclasses import replace

import pytest
import torch

from services.vae.checkpoint import load_audio_vae, load_video_vae
from services.vae.model import AudioDecoder, VideoDecoder
from tools.train import vae as trainer

pytestmark = [pytest.mark.cpu, pytest.mark.slow]


def logged(state_dir):
    return [json.loads(line) for line in (state_dir / "log.jsonl").read_text().splitlines()]


def test_video_training_lowers_the_loss_and_exports_weights_the_service_decodes_with(tmp_path):
    cfg = trainer.RunConfig(kind="video", dims="tiny", batch=1, lr=2e-3, warmup=1, max_steps=5, log_every=1,
                            workers=0, distinct=1, crop=(32, 32))
    state = trainer.train(cfg, tmp_path / "state", "cpu")
    losses = [r["loss"] for r in logged(tmp_path / "state")]
    assert [r["step"] for r in logged(tmp_path / "state")] == [1, 2, 3, 4, 5]
    assert losses[-1] < 0.9 * losses[0]

    trainer.export("video", "tiny", state.ema, tmp_path / "root", "cpu", windows=1, crop=(32, 32))
    vae = load_video_vae(tmp_path / "root")
    assert len(vae.config.latents_std) == 24 and min(vae.config.latents_std) > 0
    assert vae.config.latents_std != trainer.build("video", "tiny").config.latents_std  # measured, not the preset's
    frames = VideoDecoder(vae).decode(torch.randn(7, 24, 2, 2))
    assert frames.shape == (22, 32, 32, 3) and frames.dtype == torch.uint8


def test_a_resumed_audio_run_continues_the_step_count_and_ends_where_an_unbroken_run_ends(tmp_path):
    cfg = trainer.RunConfig(kind="audio", dims="tiny", batch=1, lr=2e-3, warmup=1, max_steps=4, log_every=1,
                            workers=0, distinct=2, audio_latents=8)
    unbroken = trainer.train(cfg, tmp_path / "unbroken", "cpu")
    trainer.train(replace(cfg, max_steps=2), tmp_path / "resumed", "cpu")
    resumed = trainer.train(cfg, tmp_path / "resumed", "cpu")
    assert resumed.step == unbroken.step == 4
    assert [r["step"] for r in logged(tmp_path / "resumed")] == [1, 2, 3, 4]
    for (name, a), b in zip(unbroken.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name
    assert logged(tmp_path / "resumed")[-1]["loss"] == logged(tmp_path / "unbroken")[-1]["loss"]
    assert logged(tmp_path / "unbroken")[-1]["loss"] < logged(tmp_path / "unbroken")[0]["loss"]

    trainer.export("audio", "tiny", resumed.ema, tmp_path / "root", "cpu", windows=1)
    wave = AudioDecoder(load_audio_vae(tmp_path / "root")).decode(torch.randn(2, 3, 32))
    assert wave.shape == (2, 2400)


def test_a_stop_file_ends_a_run_at_its_next_step_and_the_resumed_run_trains_on(tmp_path):
    cfg = trainer.RunConfig(kind="audio", dims="tiny", batch=1, lr=2e-3, warmup=1, max_steps=3, log_every=1,
                            workers=0, distinct=2, audio_latents=8)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "stop").touch()
    assert trainer.train(cfg, tmp_path / "run", "cpu").step == 1
    assert not (tmp_path / "run" / "stop").exists()
    assert trainer.train(cfg, tmp_path / "run", "cpu").step == 3  # resumed from the saved step 1


def test_a_state_of_another_kind_is_refused(tmp_path):
    cfg = trainer.RunConfig(kind="audio", dims="tiny", batch=1, max_steps=1, workers=0, audio_latents=8)
    trainer.train(cfg, tmp_path, "cpu")
    with pytest.raises(ValueError, match="holds a run with {'dims': 'tiny'}"):
        trainer.train(replace(cfg, dims="trained"), tmp_path, "cpu")


def test_a_run_continued_with_a_frozen_encoder_keeps_the_latents_and_trains_the_decoder(tmp_path):
    cfg = trainer.RunConfig(kind="audio", dims="tiny", batch=1, lr=2e-3, warmup=1, max_steps=2, log_every=1,
                            workers=0, distinct=2, audio_latents=8)
    first = trainer.train(cfg, tmp_path / "state", "cpu")
    trainer.export("audio", "tiny", first.ema, tmp_path / "before", "cpu", windows=1)
    before = {k: v.clone() for k, v in first.ema.shadow.items()}

    later = trainer.train(replace(cfg, max_steps=5, freeze_encoder=True), tmp_path / "state", "cpu")
    trainer.export("audio", "tiny", later.ema, tmp_path / "after", "cpu", windows=1)
    encoder = [k for k in before if k.startswith(trainer.ENCODER_SIDE["audio"])]
    decoder = [k for k in before if k.startswith(("decoder.", "dec_in_proj."))]
    assert encoder and decoder
    for k in encoder:
        assert torch.equal(later.ema.shadow[k], before[k]), k
        assert torch.equal(later.model.state_dict()[k], before[k]), k
    assert any(not torch.equal(later.ema.shadow[k], before[k]) for k in decoder)
    stats = [json.loads((tmp_path / root / "audio_vae" / "config.json").read_text()) for root in ("before", "after")]
    assert stats[0]["latents_mean"] == stats[1]["latents_mean"]
    assert stats[0]["latents_std"] == stats[1]["latents_std"]



def _windows(n, crop=(32, 32)):
    items = [trainer.VideoWindows(crop=crop)[i] for i in range(n)]
    return torch.stack([f for f, _ in items]), torch.stack([w for _, w in items])


def test_the_loss_from_the_posterior_bank_equals_the_loss_of_a_fresh_encode_and_encodes_once(monkeypatch):
    model = trainer.build("video", "tiny").requires_grad_(False)
    frames, weight = _windows(2)
    torch.manual_seed(0)
    fresh = trainer.video_loss(model, frames, weight, 1e-4)
    encoded = []
    real = trainer.encode_video
    monkeypatch.setattr(trainer, "encode_video", lambda vae, x: encoded.append(x.shape[0]) or real(vae, x))
    bank = trainer.PosteriorBank(distinct=2)
    for _ in range(2):
        torch.manual_seed(0)
        banked = trainer.video_loss(model, frames, weight, 1e-4, bank, first=0)
        torch.testing.assert_close(banked.total, fresh.total, rtol=1e-5, atol=0)
        assert banked.kl == pytest.approx(fresh.kl, rel=1e-5)
    assert encoded == [1, 1]  # each window once, on its own; the second visit encodes nothing


def test_a_decoder_only_video_run_encodes_each_window_once_and_a_resumed_run_ends_where_an_unbroken_one_ends(
        tmp_path, monkeypatch):
    encoded = []
    real = trainer.encode_video
    monkeypatch.setattr(trainer, "encode_video", lambda vae, x: encoded.append(x.shape[0]) or real(vae, x))
    cfg = trainer.RunConfig(kind="video", dims="tiny", batch=2, lr=2e-3, warmup=1, max_steps=4, log_every=1,
                            workers=0, distinct=3, crop=(32, 32), freeze_encoder=True)
    unbroken = trainer.train(cfg, tmp_path / "unbroken", "cpu")
    assert sum(encoded) == 3  # 8 samples of 3 windows
    trainer.train(replace(cfg, max_steps=2), tmp_path / "resumed", "cpu")
    resumed = trainer.train(cfg, tmp_path / "resumed", "cpu")
    for (name, a), b in zip(unbroken.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name
    assert logged(tmp_path / "resumed")[-1]["loss"] == logged(tmp_path / "unbroken")[-1]["loss"]
    decoder = [k for k in unbroken.ema.shadow if not k.startswith(trainer.ENCODER_SIDE["video"])]
    torch.manual_seed(cfg.seed)
    fresh = trainer.build("video", "tiny").state_dict()  # the run's initial weights
    assert all(torch.equal(unbroken.model.state_dict()[k], fresh[k]) for k in fresh if k not in decoder)
    assert any(not torch.equal(unbroken.model.state_dict()[k], fresh[k]) for k in decoder)
