"""What of the DiT the student trains: with `--base-own-loss-only` the base part learns from its own objective
alone, with `--video-weights` only the base's video-only weights move and the served audio teacher stays the
loaded base's to the bit, and the options that ask for a base that does not train are refused."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from services.dit.model.checkpoint import load_dit
from services.dit.model.network import PRESETS
from services.dit.stream.geometry import TEACHER_TAIL_LATENTS, plan_request
from services.dit.stream.runtime import request_noise
from services.dit.stream.session import CancelToken
from services.dit.stream.teacher import AudioTeacher
from services.dit.stream.timeline import Timeline
from tools.train import student, student_weights, world
from tools.train.documents import WORLD_CANVAS

pytestmark = pytest.mark.cpu


@pytest.mark.slow
def test_a_base_part_kept_to_its_own_loss_learns_nothing_from_the_students_video(trainer_inputs, tmp_path):
    """With `student_reaches_base=False` the base weights learn from the base's own objective alone: with only audio
    teacher documents there, the video-only weights (patch projection, video output) stay as they were, where the
    student's video loss moves them when it reaches the base."""
    base_dir, cond = trainer_inputs
    cfg = student.StudentRunConfig(rank=4, sessions=1, max_steps=1, distinct=1, train_base=True, base_accum=1,
                                   warmup=1, base_lr=1e-2, teacher_docs=1.0, openings=0.0)
    before = dict(load_dit(base_dir, PRESETS["tiny"], "cpu", torch.float32).named_parameters())
    video_only = ("video_patch_proj.weight", "final_layer.video_out.weight")

    def moved(config, name):
        state, _ = student.train(config, base_dir, cond, tmp_path / name)
        after = dict(state.model.named_parameters())
        return [n for n in video_only if not torch.equal(after[n], before[n])]

    assert moved(cfg, "reaches") == list(video_only)
    assert moved(replace(cfg, student_reaches_base=False), "kept") == []


@pytest.mark.slow
def test_a_student_training_the_video_weights_leaves_the_served_audio_teacher_as_it_was_to_the_bit(
        trainer_inputs, tmp_path):
    """`video_weights`: the student's loss moves the base's video-only weights (the patch projection, the video
    output, each block's AdaLN rows for the video tag) and nothing else of the base, so the served audio teacher
    (the base, LoRA off) writes the same latents from the same noise, with and without a tail; the export of the
    saved state gives the same base."""
    base_dir, cond = trainer_inputs
    cfg = student.StudentRunConfig(rank=4, sessions=1, max_steps=2, distinct=1, warmup=1, base_lr=1e-2,
                                   video_weights=True)
    state, adapter = student.train(cfg, base_dir, cond, tmp_path / "state")
    student.export(state, adapter, tmp_path / "lora", tmp_path / "base")
    before = load_dit(base_dir, PRESETS["tiny"], "cpu", torch.float32).eval()
    after = load_dit(tmp_path / "base", PRESETS["tiny"], "cpu", torch.float32).eval()
    video = student_weights.video_only_weights(before)
    was, now = dict(before.named_parameters()), dict(after.named_parameters())
    assert {n for n in was if not torch.equal(now[n], was[n])} == set(video)
    for name, rows in video.items():
        if rows is not None:  # the AdaLN rows of text and audio stay, the video tag's moved
            others = torch.ones(was[name].shape[0], dtype=torch.bool)
            others[rows] = False
            assert torch.equal(now[name][others], was[name][others]), name
            assert not torch.equal(now[name][rows], was[name][rows]), name

    text = cond.encode_caption(world.opening_scene("circle", "red", "black", "still").caption)
    timeline = Timeline(WORLD_CANVAS, 0.0)
    tail = None
    for request in (0, 1):
        plan = plan_request(request)
        _, noise = request_noise(7, plan, WORLD_CANVAS, before.args.video_channels, before.args.audio_channels)
        old, new = (AudioTeacher(m, None).run(text, plan, timeline, noise, tail, CancelToken())[-1]
                    for m in (before, after))
        assert torch.equal(old, new), f"request {request}: the teacher moved by {(old - new).abs().max():.3g}"
        tail = old[:, -TEACHER_TAIL_LATENTS:]

    student.export_saved(tmp_path / "state", base_dir, tmp_path / "lora2", 4, tmp_path / "base2", video_weights=True)
    again = dict(load_dit(tmp_path / "base2", PRESETS["tiny"], "cpu", torch.float32).named_parameters())
    assert all(torch.equal(again[n], now[n]) for n in now)


@pytest.mark.parametrize("flags, said", [(["--train-base", "--video-weights"], "choose one"),
                                         (["--export-base", "out"], "--export-base needs --train-base or")])
def test_the_base_is_trained_whole_or_in_its_video_weights_and_exported_only_when_trained(capsys, flags, said):
    with pytest.raises(SystemExit):
        student.main(["--base", "b", "--state", "s", "--vae-root", "v", "--encoder-root", "e", *flags])
    assert said in capsys.readouterr().err


def test_the_base_own_loss_only_needs_the_base_trained(capsys):
    with pytest.raises(SystemExit):
        student.main(["--base", "b", "--state", "s", "--vae-root", "v", "--encoder-root", "e",
                      "--base-own-loss-only"])
    assert "--base-own-loss-only needs --train-base" in capsys.readouterr().err
