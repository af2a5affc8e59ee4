"""The DiT base trainer (tools/train/dit.py) on the CPU: a whole-clip document of the right shape, audio teacher
documents laid out as the served teacher lays them out, a few steps that lower the flow-matching loss on one clip
and on one teacher document, a resumed run equal to an unbroken one, and an exported state that loads through the
service's `load_dit` with the trainer's forward."""

from dataclasses import replace

import json
import pytest
import torch

from services.dit.model.checkpoint import load_dit
from services.dit.model.network import PRESETS, FullAttention, build_random, is_fp32_param
from services.dit.stream.geometry import TEACHER_TAIL_LATENTS, Canvas, plan_request
from services.dit.stream.schedule import TEACHER_GRID, TEACHER_SIGMAS
from services.dit.stream.session import CancelToken
from services.dit.stream.teacher import AudioTeacher, request_audio_shapes
from services.dit.stream.timeline import Timeline
from services.encoder.checkpoint import write_random_checkpoint as write_encoder
from services.vae.checkpoint import write_random_checkpoint as write_vaes
from tools.train import dit as trainer
from tools.train import documents

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
    assert documents.shifted(u, 12.0).tolist() == pytest.approx([0.0, 12 / 13, 1.0])
    assert documents.shifted(u, 3.0).tolist() == pytest.approx([0.0, 0.75, 1.0])


def test_training_lowers_the_loss_on_one_clip_and_a_resumed_run_continues(conditioner, tmp_path):
    cfg = trainer.DiTRunConfig(frames=22, accum=1, lr=2e-3, warmup=1, max_steps=30, log_every=10, distinct=1,
                               teacher_docs=0.0)
    trainer.train(replace(cfg, max_steps=20), conditioner, tmp_path)
    state = trainer.train(cfg, conditioner, tmp_path)
    assert state.step == 30
    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [10, 20, 30]
    first, last = records[0], records[-1]
    assert last["video"] + last["audio"] < 0.8 * (first["video"] + first["audio"])


def _row_t(layout):
    return layout.timesteps[layout.timestep_slot].tolist()


@pytest.mark.parametrize("request_index", [0, *trainer.TEACHER_LATER_REQUESTS])
def test_a_teacher_document_is_laid_out_as_the_served_teacher_lays_it_out(conditioner, request_index):
    ex = conditioner.teacher_example(7, request_index)
    plan, n_tail, text_len = plan_request(request_index), ex.n_tail, ex.text.shape[0]
    assert (n_tail, ex.audio.shape[1] - n_tail) in request_audio_shapes()
    assert n_tail == (0 if request_index == 0 else TEACHER_TAIL_LATENTS)

    # the served teacher on the same text, request and tail: the layout of each of its forwards
    model = build_random(PRESETS["tiny"], "cpu", torch.float32, 0)
    seen = []
    hook = model.register_forward_pre_hook(lambda _, args: seen.append((args[1].clone(), args[3])))
    timeline = Timeline(Canvas(width=320, height=192), origin=float(text_len))  # the session's: origin = L
    tail = ex.audio[:, :n_tail] if n_tail else None
    AudioTeacher(model, None).run(ex.text, plan, timeline, torch.randn(2, plan.num_audio_latents, 32), tail,
                                  CancelToken())
    assert len(seen) == len(TEACHER_SIGMAS) - 1
    grid = torch.linspace(1.0, 0.0, TEACHER_GRID)  # the u of each teacher state
    for step, (_, served) in enumerate(seen):
        ours, sigma = documents.teacher_layout(text_len, request_index, float(grid[step]))
        assert sigma == pytest.approx(TEACHER_SIGMAS[step], abs=1e-6)
        assert (ours.seq_len, ours.text_len, ours.audio_len, ours.video_len) == \
            (served.seq_len, served.text_len, served.audio_len, served.video_len) == \
            (served.seq_len, text_len, n_tail + plan.num_audio_latents, 0)
        assert torch.equal(ours.positions, served.positions) and torch.equal(ours.tags, served.tags)
        assert _row_t(ours) == pytest.approx(_row_t(served), abs=1e-6)

    hook.remove()
    # the trainer's document: the served tail rows, clean at t = 1, then the new rows at one noise level
    doc = documents.teacher_document(ex, torch.device("cpu"))
    rows, layout = doc.audio, doc.layout
    rows, row_t = rows.reshape(2, -1, 32), torch.tensor(_row_t(layout))[layout.audio_index].reshape(2, -1)
    assert torch.equal(rows[:, :n_tail], ex.audio[:, :n_tail]) and (row_t[:, :n_tail] == 1).all()
    assert not torch.equal(rows[:, n_tail:], ex.audio[:, n_tail:]) and (row_t[:, n_tail:] == row_t[0, -1]).all()


def test_a_later_requests_tail_is_the_previous_requests_last_second_of_the_same_scene():
    hop, tail = trainer.HOP, TEACHER_TAIL_LATENTS * trainer.HOP
    docs = [trainer.render_teacher_clip(3, k) for k in range(3)]
    # a moving shape pans its sound: no second of it repeats the one before (a still or bouncing one's would)
    assert len({d.caption for d in docs}) == 1 and "moving right" in docs[0].caption
    assert [d.wave.shape[1] // hop for d in docs] == [207, 40 + 198, 40 + 198]
    for before, after in zip(docs, docs[1:]):
        assert torch.allclose(after.wave[:, :tail], before.wave[:, -tail:], atol=1e-6)
        assert not torch.allclose(after.wave[:, :tail], before.wave[:, -2 * tail:-tail], atol=1e-3)


def test_the_teacher_document_fraction_splits_the_seeds_and_leaves_each_clip_as_it_was():
    requests = [trainer.teacher_request(seed, 0.5) for seed in range(400)]
    teacher = [r for r in requests if r is not None]
    assert 0.4 < len(teacher) / 400 < 0.6 and 0.4 < teacher.count(0) / len(teacher) < 0.6
    assert set(teacher) == {0, *trainer.TEACHER_LATER_REQUESTS}
    assert all(trainer.teacher_request(seed, 0.0) is None for seed in range(50))
    assert all(trainer.teacher_request(seed, 1.0) is not None for seed in range(50))
    seed = requests.index(None)
    mixed, alone = trainer.render_example(seed, 22, 0.5), trainer.render_clip(seed, 22)
    assert torch.equal(mixed.frames, alone.frames) and torch.equal(mixed.wave, alone.wave)


def test_training_lowers_the_loss_on_one_teacher_document(conditioner, tmp_path):
    cfg = trainer.DiTRunConfig(frames=22, accum=1, lr=2e-3, warmup=1, max_steps=30, log_every=10, distinct=1,
                               teacher_docs=1.0)
    trainer.train(cfg, conditioner, tmp_path)
    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [10, 20, 30]
    assert all(r["video"] is None and r["audio"] is None for r in records)
    assert records[-1]["teacher"] < 0.8 * records[0]["teacher"]


def test_a_resumed_run_of_clips_and_teacher_documents_equals_an_unbroken_one(conditioner, tmp_path):
    cfg = trainer.DiTRunConfig(frames=22, accum=2, lr=2e-3, warmup=1, max_steps=4, log_every=1, teacher_docs=0.5)
    kinds = [trainer.teacher_request(seed, 0.5) for seed in range(8)]
    assert None in kinds and 0 in kinds and set(kinds) & set(trainer.TEACHER_LATER_REQUESTS)
    trainer.train(replace(cfg, max_steps=2), conditioner, tmp_path / "broken")
    broken = trainer.train(cfg, conditioner, tmp_path / "broken")
    unbroken = trainer.train(cfg, conditioner, tmp_path / "unbroken")
    assert broken.step == unbroken.step == 4
    for (name, a), b in zip(broken.model.state_dict().items(), unbroken.model.state_dict().values()):
        assert torch.equal(a, b), name
    assert all(torch.equal(broken.ema.shadow[k], unbroken.ema.shadow[k]) for k in unbroken.ema.shadow)

    def losses(run):
        return [{k: r[k] for k in ("step", "video", "audio", "teacher")}
                for r in map(json.loads, (tmp_path / run / "log.jsonl").read_text().splitlines())]
    assert losses("broken") == losses("unbroken")
    assert any(r["teacher"] is not None for r in losses("unbroken"))
    assert any(r["video"] is not None for r in losses("unbroken"))


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
    doc = documents.clip_document(ex, torch.device("cpu"), torch.Generator().manual_seed(5))
    (_, [want]), (_, [got]) = documents.document_losses(expect, [doc]), documents.document_losses(loaded, [doc])
    assert got["video"] == pytest.approx(want["video"], rel=1e-5) and got["audio"] == pytest.approx(want["audio"], rel=1e-5)


def test_an_opening_clip_is_the_sessions_opening_scene_from_frame_zero_and_leaves_other_seeds_as_they_were():
    from tools.train import world
    kinds = {seed: trainer.render_example(seed, 22, 0.5, openings=0.5) for seed in range(60)}
    openings = [s for s, c in kinds.items() if isinstance(c, trainer.Clip) and c.opening]
    clips = [s for s, c in kinds.items() if isinstance(c, trainer.Clip) and not c.opening]
    assert 8 <= len(openings) <= 25 and len(clips) >= 8
    for seed in clips:  # a clip not drawn as an opening is the clip it always was, a teacher document likewise
        assert torch.equal(kinds[seed].frames, trainer.render_example(seed, 22, 0.5).frames)
    for seed in set(kinds) - set(openings) - set(clips):
        if not kinds[seed].opening:
            assert torch.equal(kinds[seed].wave, trainer.render_example(seed, 22, 0.5).wave)
    for seed in openings:
        clip = kinds[seed]
        scene = next(world.opening_scene(*g) for g in _grammars() if world.opening_scene(*g).caption == clip.caption)
        assert torch.equal(clip.frames, torch.from_numpy(world.render_video(scene, 0, 22)))


def test_request_0s_teacher_documents_open_a_session_as_often_as_clips_do_and_later_requests_stay_as_they_were():
    from tools.train import world
    from tools.train.vae import HOP
    kinds = {seed: trainer.render_example(seed, 22, 1.0, openings=0.5) for seed in range(80)}
    first = [s for s, c in kinds.items() if c.request_index == 0]
    opened = [s for s in first if kinds[s].opening]
    assert 0 < len(opened) < len(first)
    for seed, clip in kinds.items():
        assert trainer.seen(seed, 1.0, 0.5) == trainer.Seen(seed, clip.request_index, clip.opening)
        if not clip.opening:  # a random place and start, or a later request: as without openings
            assert torch.equal(clip.wave, trainer.render_example(seed, 22, 1.0).wave)
    for seed in opened:  # the opening scene's sound from its first sample: for a still shape, centred and steady
        clip = kinds[seed]
        scene = next(world.opening_scene(*g) for g in _grammars() if world.opening_scene(*g).caption == clip.caption)
        n = plan_request(0).num_audio_latents * HOP
        assert torch.equal(clip.wave, torch.from_numpy(world.render_audio(scene, 0, n)))
    still = world.opening_scene("circle", "red", "black", "still")
    left, right = world.render_audio(still, 0, 8000)
    assert torch.allclose(torch.from_numpy(left), torch.from_numpy(right))


def _grammars():
    from itertools import product
    from tools.train import world
    return product(world.SHAPES, [c.name for c in world.COLOURS], world.BACKGROUNDS, [m.name for m in world.MOTIONS])


def test_an_opening_clips_video_is_given_as_pure_noise_and_logged_apart(conditioner):
    ex = conditioner.example(3)
    model = build_random(PRESETS["tiny"], "cpu", torch.float32, 0)
    inputs = []
    for opening in (False, True):
        for scale in (1.0, 3.0):  # other clean video: the input moves unless it is pure noise
            changed = replace(ex, video=ex.video * scale, opening=opening)
            doc = documents.clip_document(changed, torch.device("cpu"), torch.Generator().manual_seed(1))
            _, [parts] = documents.document_losses(model, [doc])
            assert (parts["opening"] is None) != opening and (parts["video"] is None) == opening
            inputs.append(doc.video)
    assert not torch.equal(inputs[0], inputs[1])
    torch.testing.assert_close(inputs[2], inputs[3], rtol=0, atol=0)


def test_documents_packed_in_one_forward_give_each_the_loss_and_gradient_of_its_own_forward(conditioner):
    # clips, an opening clip and teacher documents of two lengths, packed: each document's velocity must be what
    # the network gives it alone under `FullAttention`, so each loss, their mean and its gradient are the same
    cpu = torch.device("cpu")
    examples = [conditioner.example(3), replace(conditioner.example(4), opening=True),
                conditioner.teacher_example(5, 0), conditioner.teacher_example(6, 3), conditioner.example(7)]
    docs = [documents.document(ex, cpu, torch.Generator().manual_seed(i)) for i, ex in enumerate(examples)]
    model = build_random(PRESETS["tiny"], "cpu", torch.float32, 0).requires_grad_(True)
    packed, parts = documents.document_losses(model, docs)
    packed.backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()

    alone = []
    for d in docs:
        v_video, v_audio = model(d.video, d.audio, d.text, d.layout, FullAttention(d.layout))
        loss_a = torch.nn.functional.mse_loss(v_audio[d.loss_rows], d.target_audio)
        alone.append(loss_a + torch.nn.functional.mse_loss(v_video, d.target_video) if d.video.shape[0] else loss_a)
    reference = torch.stack(alone).mean()
    reference.backward()
    torch.testing.assert_close(packed, reference, rtol=1e-5, atol=0)
    assert [p["teacher"] is not None for p in parts] == [False, False, True, True, False]
    assert parts[1]["opening"] is not None and parts[0]["video"] is not None
    for part, loss in zip(parts, alone):
        assert sum(v for v in part.values() if v is not None) == pytest.approx(loss.item(), rel=1e-5)
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(packed_grads[name], p.grad, rtol=1e-4, atol=1e-7, msg=name)


def test_a_caching_run_renders_each_distinct_seed_once_and_trains_as_a_run_that_renders_every_sample(
        conditioner, tmp_path, monkeypatch):
    rendered = []
    real = trainer.render_example
    monkeypatch.setattr(trainer, "render_example", lambda seed, *a: rendered.append(seed) or real(seed, *a))
    cfg = trainer.DiTRunConfig(frames=22, accum=2, lr=2e-3, warmup=1, max_steps=4, log_every=1, distinct=3,
                               teacher_docs=0.5, openings=0.5)
    kinds = {trainer.seen(s, 0.5, 0.5) for s in range(3)}
    assert {k.request_index is None for k in kinds} == {True, False}  # clips and teacher documents among them
    cached = trainer.train(cfg, conditioner, tmp_path / "cached")
    assert rendered == [0, 1, 2]  # 8 samples of 3 seeds
    rendered.clear()
    trainer.train(replace(cfg, max_steps=2), conditioner, tmp_path / "resumed")
    resumed = trainer.train(cfg, conditioner, tmp_path / "resumed")
    assert rendered == [0, 1, 2, 1, 2, 0]  # a resumed process renders its first 3 samples again

    root = tmp_path / "minimax"  # the same trees (the random writers are seeded), a conditioner that keeps nothing
    write_encoder("tiny", root)
    write_vaes("tiny", root)
    rendered.clear()
    every = trainer.train(cfg, trainer.Conditioner(root, root, torch.device("cpu"), frames=22), tmp_path / "every")
    assert len(rendered) == 8
    for (name, a), b, c in zip(cached.model.state_dict().items(), resumed.model.state_dict().values(),
                               every.model.state_dict().values()):
        assert torch.equal(a, b) and torch.equal(a, c), name


def test_openings_of_one_caption_are_encoded_once_even_by_a_conditioner_that_keeps_no_seeds(tmp_path, monkeypatch):
    root = tmp_path / "minimax"
    write_encoder("tiny", root)
    write_vaes("tiny", root)
    cond = trainer.Conditioner(root, root, torch.device("cpu"), frames=22)
    by_caption: dict[str, list] = {}
    for seed in range(200):  # 540 opening captions: 200 seeds share some
        clip = trainer.render_example(seed, 22, 0.0, openings=1.0)
        by_caption.setdefault(clip.caption, []).append(clip)
    first, second = next(clips for clips in by_caption.values() if len(clips) >= 2)[:2]
    other = next(clips[0] for caption, clips in by_caption.items() if caption != first.caption)
    encodes = []
    real = cond.encode_frames
    monkeypatch.setattr(cond, "encode_frames", lambda frames: encodes.append(1) or real(frames))
    a, b, c = cond.encode(first), cond.encode(second), cond.encode(other)
    assert len(encodes) == 2 and b is a and c is not a and a.opening and c.opening
    assert torch.equal(b.video, real(second.frames)) and torch.equal(b.audio, cond.encode_wave(second.wave))
    plain = replace(first, opening=False)  # the same pixels as a clip: not taken from the openings
    assert not cond.encode(plain).opening and len(encodes) == 3


def test_a_seed_named_as_encoded_that_the_conditioner_never_encoded_is_refused(conditioner):
    with pytest.raises(KeyError, match="seed 99999 .* was named as encoded"):
        conditioner.encode(trainer.Seen(99999, None, False))
