"""The student trainer runs the served streaming pattern: its batched forwards equal the runtime's, phase by phase."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from services.dit.model.layout import pack_layout
from services.dit.model.lora import load_adapter
from services.dit.model.network import PRESETS, build_random
from services.dit.stream.attention import StreamingAttention
from services.dit.stream.geometry import plan_request
from services.dit.stream.kv_cache import CleanAVKVCache, kv_capacity
from services.dit.stream.schedule import model_t
from services.dit.stream.timeline import Timeline
from tools.train import session_batch, student, student_weights, world
from tools.train.sample import sound_of

pytestmark = pytest.mark.cpu

LH, LW = 6, 8  # a 128x96 canvas: 12 video rows a latent


def _session(gen: torch.Generator, text_lens: tuple[int, int]) -> session_batch.Session:
    args = PRESETS["tiny"]
    return session_batch.Session(tuple(torch.randn(n, args.text_dim, generator=gen) for n in text_lens),
                           torch.randn(72, args.video_channels, LH, LW, generator=gen),
                           torch.randn(2, 405, args.audio_channels, generator=gen))


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = build_random(PRESETS["tiny"], "cpu", torch.float32, 0)
    adapter = student_weights.student_adapter(m, rank=8, seed=1)
    with torch.no_grad():  # a LoRA that changes the output, so a pattern that dropped it would show
        for layer in adapter.layers.values():
            layer.lora_B["taomate"].weight.normal_(0.0, 0.05)
    return m.eval()


def _runtime_phase(model, cache, sess, timeline, ph, xv, xa, sigma_v, sigma_a, commit):
    """One forward as `DiTRuntime._forward` runs it, over the real KV cache."""
    text = sess.texts[ph.request_index]
    layout = pack_layout(text_len=text.shape[0], audio_len_per_channel=ph.num_audio_latents,
                         video_rows=xv.shape[0], positions_text=timeline.text(ph.request_index, text.shape[0]),
                         positions_audio=timeline.audio(ph.audio_start, ph.num_audio_latents),
                         positions_video=timeline.video(ph), video_t=model_t(sigma_v), audio_t=model_t(sigma_a))
    if commit:
        cache.begin(xa.shape[0], xv.shape[0])
    out = model(xv, xa, text, layout, StreamingAttention(layout, cache, commit=commit), heads=not commit)
    if commit:
        cache.commit()
        return None
    return out[0]


@torch.no_grad()
def test_batched_student_forwards_equal_the_runtimes_over_eight_phases(model):
    gen = torch.Generator().manual_seed(3)
    sessions = [_session(gen, (9, 12)), _session(gen, (14, 7))]
    batch = session_batch.SessionBatch(sessions, torch.device("cpu"))
    args = model.args
    caches = [CleanAVKVCache(args.num_layers, kv_capacity(batch.canvas, 32), args.num_heads, args.head_dim,
                             torch.float32, "cpu") for _ in sessions]
    commits, audio_rows, n = [], [], 0
    for k in range(student.REQUESTS):
        for ph in plan_request(k).phases:
            x0_v, x0_a = batch.clean(ph)
            history = session_batch.retained(commits, audio_rows)
            xv = torch.randn(x0_v.shape, generator=gen)
            v, _ = session_batch.forward(model, batch, ph, xv, x0_a, 0.9612, 0.8609, history, commit=False,
                                   texts=batch.refined_texts(model, ph.request_index))
            for b, sess in enumerate(sessions):
                want = _runtime_phase(model, caches[b], sess, batch.timelines[b], ph, xv[b], x0_a[b], 0.9612, 0.8609,
                                      commit=False)
                torch.testing.assert_close(v[b], want, atol=2e-5, rtol=1e-4,
                                           msg=f"phase {k}.{ph.phase_index}, session {b}")
            _, att = session_batch.forward(model, batch, ph, x0_v, x0_a, 0.0, 0.0, history, commit=True,
                                     texts=batch.refined_texts(model, ph.request_index))
            for b, sess in enumerate(sessions):
                _runtime_phase(model, caches[b], sess, batch.timelines[b], ph, x0_v[b], x0_a[b], 0.0, 0.0, commit=True)
            commits.append((n, att.committed))
            audio_rows.append(x0_a.shape[1])
            n += 1
            held = sum(kv[0].shape[1] for kv in session_batch.retained(commits, audio_rows)[0])
            assert held == caches[0].live, f"after commit {n - 1}: the trainer holds {held} rows, the cache {caches[0].live}"


def _commit(model, batch, phases):
    """Commit the clean latents of `phases` in order, each over the history retained before it: the commits and
    each commit's audio rows, as `retained` takes them."""
    commits, audio_rows = [], []
    for n, ph in enumerate(phases):
        x0_v, x0_a = batch.clean(ph)
        history = session_batch.retained(commits, audio_rows)
        _, att = session_batch.forward(model, batch, ph, x0_v, x0_a, 0.0, 0.0, history, commit=True,
                                       texts=batch.refined_texts(model, ph.request_index))
        commits.append((n, att.committed))
        audio_rows.append(x0_a.shape[1])
    return commits, audio_rows


@torch.no_grad()
def test_a_sink_moved_back_equals_a_sink_committed_that_much_earlier(model):
    gen = torch.Generator().manual_seed(8)
    sessions = [_session(gen, (9, 12)), _session(gen, (14, 7))]
    batch = session_batch.SessionBatch(sessions, torch.device("cpu"))
    gaps = torch.tensor([700.0, 1900.0])
    commits, audio_rows = _commit(model, batch, plan_request(0).phases[:3])  # 3 commits: commit 0 is the sink
    held = session_batch.retained(commits, audio_rows)
    moved = session_batch.retained(commits, audio_rows, sink_turn=batch.sink_turn(model, gaps))

    earlier = session_batch.SessionBatch(sessions, torch.device("cpu"))
    earlier.timelines = [Timeline(earlier.canvas, origin=tl.origin - g)
                         for tl, g in zip(batch.timelines, gaps.tolist(), strict=True)]
    [(_, early)], _ = _commit(model, earlier, plan_request(0).phases[:1])
    cut = audio_rows[0]  # a commit's rows: its audio (both channels), then its video
    for layer, (k_early, v_early) in enumerate(early):
        (sink_k, sink_v), *recent = moved[layer]
        # float32 angles at ~2,000 units are good to ~1e-4 rad; unturned keys are off by ~7
        torch.testing.assert_close(sink_k, k_early[:, cut:], atol=5e-4, rtol=1e-4, msg=f"layer {layer}")
        torch.testing.assert_close(sink_v, v_early[:, cut:], atol=1e-4, rtol=1e-4, msg=f"layer {layer}")
        assert torch.equal(sink_v, held[layer][0][1])  # the values stay as committed
        assert all(torch.equal(a, b) for kv, held_kv in zip(recent, held[layer][1:], strict=True)
                   for a, b in zip(kv, held_kv))
        assert (sink_k - held[layer][0][0]).abs().amax() > 0.1  # the keys did turn


@torch.no_grad()
def test_the_student_loss_moves_each_phases_sink_by_its_gaps_and_zero_gaps_change_nothing(model, monkeypatch):
    batch = session_batch.SessionBatch([_session(torch.Generator().manual_seed(9), (9, 7))], torch.device("cpu"))
    gaps = torch.tensor([900.0])
    turns, retained = [], student.retained

    def recording_retained(commits, audio_rows, sink_turn=None):
        turns.append(sink_turn)
        return retained(commits, audio_rows, sink_turn)

    monkeypatch.setattr(student, "retained", recording_retained)
    student.session_loss(model, batch, torch.Generator().manual_seed(0), self_rollout=False, sink_gaps=gaps)
    monkeypatch.undo()
    cos, sin = batch.sink_turn(model, gaps)
    assert len(turns) == 8 and all(torch.equal(c, cos) and torch.equal(s, sin) for c, s in turns)

    plain = student.session_loss(model, batch, torch.Generator().manual_seed(0), self_rollout=False)
    zero = student.session_loss(model, batch, torch.Generator().manual_seed(0), self_rollout=False,
                                sink_gaps=torch.zeros(1))
    assert torch.equal(zero.total, plain.total) and zero.phases == plain.phases


def test_the_served_history_applies_from_its_step_and_draws_nothing_before():
    cfg = student.StudentRunConfig(sessions=4, self_commit=1.0, sink_gap=300.0, served_from=468)
    gen = torch.Generator().manual_seed(0)
    assert student.served_history(cfg, 467, gen) == (False, None)
    assert torch.equal(gen.get_state(), torch.Generator().manual_seed(0).get_state())  # the stream untouched
    own, gaps = student.served_history(cfg, 468, gen)
    assert own and gaps.shape == (4,) and (gaps <= 300.0).all()
    own, gaps = student.served_history(student.StudentRunConfig(sessions=4), 468, gen)
    assert (own, gaps) == (False, None)  # neither asked for


def test_sink_gaps_are_zero_for_about_half_the_sessions_and_uniform_up_to_the_most_for_the_rest():
    gaps = student.draw_sink_gaps(4000, 300.0, torch.Generator().manual_seed(0))
    far = gaps[gaps > 0]
    assert 0.45 < far.numel() / gaps.numel() < 0.55
    assert far.max() <= 300.0 and abs(far.mean().item() - 150.0) < 10.0


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    # q: [Lq, H, D], k/v: [Lk, H, D] -> [Lq, H, D]
    return F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)).transpose(0, 1)


def _sessions_attention_alone(text_lens, a, tv, history, q, k, v):
    """The pattern one session at a time: its text over itself, its media rows over [its text | its history | its
    media]; pad rows zero. Returns the output `[S, H, D]` and the media K/V `[B, M, H, D]` of every session."""
    b, tt = len(text_lens), sum(text_lens)
    out = torch.zeros_like(q)
    media_k, media_v = [], []
    start = 0
    for i, n in enumerate(text_lens):
        text = torch.arange(start, start + n)
        start += n
        media = torch.cat([torch.arange(tt + i * a, tt + (i + 1) * a),  # audio-L
                           torch.arange(tt + (b + i) * a, tt + (b + i + 1) * a),  # audio-R
                           torch.arange(tt + 2 * b * a + i * tv, tt + 2 * b * a + (i + 1) * tv)])  # video
        out[text] = _attend(q[text], k[text], v[text])
        keys = torch.cat([k[text]] + [hk[i] for hk, _ in history] + [k[media]])
        values = torch.cat([v[text]] + [hv[i] for _, hv in history] + [v[media]])
        out[media] = _attend(q[media], keys, values)
        media_k.append(k[media])
        media_v.append(v[media])
    return out, (torch.stack(media_k), torch.stack(media_v))


@pytest.mark.parametrize("commit", [False, True])
@pytest.mark.parametrize("held", [(), (3, 5)], ids=["no history", "history"])
def test_sessions_attention_equals_each_session_attending_alone(held, commit):
    gen = torch.Generator().manual_seed(6)
    text_lens, a, tv, h, d, layers = [5, 11, 2], 4, 6, 2, 8, 2
    b = len(text_lens)
    rows = session_batch.session_rows(text_lens, a, tv, torch.device("cpu"))
    assert rows.seq_len == 64 > sum(text_lens) + b * (2 * a + tv)  # pad rows too
    history = [[(torch.randn(b, n, h, d, generator=gen), torch.randn(b, n, h, d, generator=gen)) for n in held]
               for _ in range(layers)] if held else []
    attention = session_batch.SessionsAttention(rows, history, commit=commit)
    for layer in range(layers):
        q, k, v = torch.randn(rows.seq_len, 3, h, d, generator=gen).unbind(1)  # strided, as a block hands them in
        want, kv = _sessions_attention_alone(text_lens, a, tv, history[layer] if held else [], q, k, v)
        torch.testing.assert_close(attention(layer, q, k, v), want, atol=1e-5, rtol=0, msg=f"layer {layer}")
        if commit:
            torch.testing.assert_close(attention.committed[layer], kv, atol=0, rtol=0)
    assert len(attention.committed) == (layers if commit else 0)


def test_a_switched_session_changes_caption_at_request_one_and_keeps_the_shape_where_it_was():
    for seed in range(200):
        scenes = student.session_scenes(seed, switch=1.0)
        if scenes[1].motion == "still" and scenes[0].motion == "still":
            break
    else:
        pytest.fail("no still -> still switch in 200 seeds")
    at = plan_request(1).frame_start / world.FPS
    before = [float(c[0]) for c in scenes[0].centre(np.array([at]))]
    after = [float(c[0]) for c in scenes[1].centre(np.array([at]))]
    assert scenes[0].caption != scenes[1].caption or scenes[0] == scenes[1]
    np.testing.assert_allclose(after, before, atol=1e-6)
    clip = student.render_session(seed, switch=1.0)
    assert clip.captions == (scenes[0].caption, scenes[1].caption)
    assert clip.frames.shape[0] == student.SESSION_FRAMES and clip.wave.shape[1] == 405 * 800


def _balance_db(wave: torch.Tensor) -> float:
    return sound_of(wave.numpy(), world.SAMPLE_RATE)[1]


def test_a_sessions_sound_stands_its_own_offset_to_the_side_of_its_picture_with_sound_spread():
    seeds = [s for s in range(student.STUDENT_SEED, student.STUDENT_SEED + 40)
             if student.session_scenes(s, 0.35)[0].motion == "still"][:3]
    offsets = [student.sound_offset(s, 48.0) for s in seeds]
    assert len(set(offsets)) == 3 and offsets == [student.sound_offset(s, 48.0) for s in seeds]
    request0 = plan_request(0).num_audio_latents * 800  # samples of request 0's sound
    for seed, dx in zip(seeds, offsets):
        plain, moved = student.render_session(seed, 0.35), student.render_session(seed, 0.35, sound_spread=48.0)
        assert torch.equal(moved.frames, plain.frames) and moved.captions == plain.captions
        opening = world.moved_sideways(student.session_scenes(seed, 0.35)[0], dx)
        want = 20 * math.log10(math.tan(opening.x0 / world.WIDTH * math.pi / 2))
        assert _balance_db(moved.wave[:, :request0]) == pytest.approx(want, abs=0.1)  # request 0's sound
        assert abs(_balance_db(plain.wave[:, :request0])) < 0.1  # an opening stands at the centre
    assert student.sound_offset(seeds[0], 0.0) == 0.0
    spread = np.std([student.sound_offset(s, 48.0) for s in range(2000)])
    assert spread == pytest.approx(48.0, rel=0.05)


def test_with_one_spread_request_only_the_first_requests_sound_stands_aside_and_the_second_is_the_pictures():
    seed = next(s for s in range(student.STUDENT_SEED, student.STUDENT_SEED + 40)
                if [sc.motion for sc in student.session_scenes(s, 0.0)] == ["still", "still"]
                and abs(student.sound_offset(s, 48.0)) > 20)
    request0 = plan_request(0).num_audio_latents * 800
    plain = student.render_session(seed, 0.0)
    both = student.render_session(seed, 0.0, sound_spread=48.0)
    first = student.render_session(seed, 0.0, sound_spread=48.0, spread_requests=1)
    assert torch.equal(first.frames, plain.frames)
    assert torch.equal(first.wave[:, :request0], both.wave[:, :request0])  # request 0 aside as before
    assert abs(_balance_db(first.wave[:, :request0])) > 1.0
    assert torch.equal(first.wave[:, request0:], plain.wave[:, request0:])  # request 1 where its picture is
    assert abs(_balance_db(both.wave[:, request0:])) > 1.0


@pytest.mark.parametrize("value", ["0", "3"])
def test_a_spread_over_no_request_or_more_than_a_session_has_is_refused_naming_the_option(value, capsys):
    with pytest.raises(SystemExit):
        student.main(["--base", "b", "--state", "s", "--vae-root", "v", "--encoder-root", "e",
                      "--spread-requests", value])
    assert f"--spread-requests {value}: a session has 2 requests" in capsys.readouterr().err


def test_sessions_open_on_the_captions_own_scene():
    a, b = (student.session_scenes(seed, switch=0.0)[0] for seed in (1, 2))
    if a.caption == b.caption:
        assert a == b
    for seed in range(20):
        scene = student.session_scenes(seed, switch=0.0)[0]
        assert (scene.size, scene.x0, scene.y0, scene.phase) == (world.OPENING_SIZE, 160.0, 96.0, 0.0)


@torch.no_grad()
def test_each_requests_first_phase_weighs_first_phase_weight_in_the_student_loss(model):
    batch = session_batch.SessionBatch([_session(torch.Generator().manual_seed(3), (9, 7))], torch.device("cpu"))
    plain = student.session_loss(model, batch, torch.Generator().manual_seed(0), self_rollout=False)
    weighted = student.session_loss(model, batch, torch.Generator().manual_seed(0), self_rollout=False,
                                    first_phase_weight=4.0)
    phases = torch.tensor(plain.phases)
    firsts = [0, len(plan_request(0).phases)]  # request 0's opening, request 1's first phase
    assert len(phases) == 8 and weighted.phases == plain.phases and weighted.steps == plain.steps
    torch.testing.assert_close(plain.total, phases.mean())
    w = torch.ones(8)
    w[firsts] = 4.0
    torch.testing.assert_close(weighted.total, (w * phases).sum() / w.sum())
    assert not torch.isclose(weighted.total, plain.total)


def _commits_and_outputs(model, batch, self_commit: bool, monkeypatch):
    """Per phase: the video rows each commit forward took `[B, Tv, 96]`, and the student's last x0 prediction."""
    commits, predictions = [], []
    forward, mse = student.forward, student.F.mse_loss

    def recording_forward(model, batch, ph, video, *args, commit, **kw):
        if commit:
            commits.append(video.clone())
        return forward(model, batch, ph, video, *args, commit=commit, **kw)

    def recording_mse(x0_hat, target):
        predictions.append(x0_hat.detach().clone())
        return mse(x0_hat, target)

    monkeypatch.setattr(student, "forward", recording_forward)
    monkeypatch.setattr(student.F, "mse_loss", recording_mse)
    student.session_loss(model, batch, torch.Generator().manual_seed(0), self_rollout=True, self_commit=self_commit)
    monkeypatch.undo()
    return commits, predictions[student.STEPS - 1::student.STEPS]  # each phase's last step: its Euler end state


def _stats(rows):
    return rows.mean(dim=0), rows.std(dim=0, unbiased=False)


@torch.no_grad()
def test_a_self_committing_session_commits_its_own_output_renormalised_as_served(model, monkeypatch):
    gen = torch.Generator().manual_seed(4)
    switched = _session(gen, (9, 7))
    kept = _session(gen, (8, 8))
    kept = session_batch.Session((kept.texts[0], kept.texts[0]), kept.video, kept.audio)  # one prompt for both requests
    batch = session_batch.SessionBatch([switched, kept], torch.device("cpu"))
    phases = [ph for k in range(student.REQUESTS) for ph in plan_request(k).phases]

    clean, _ = _commits_and_outputs(model, batch, self_commit=False, monkeypatch=monkeypatch)
    for got, ph in zip(clean, phases, strict=True):
        torch.testing.assert_close(got, batch.clean(ph)[0])

    commits, outputs = _commits_and_outputs(model, batch, self_commit=True, monkeypatch=monkeypatch)
    first_of_1 = len(plan_request(0).phases)
    for b in range(2):
        # the session's first phase goes in as the student made it, and anchors the request's later phases
        torch.testing.assert_close(commits[0][b], outputs[0][b])
        for i in range(1, first_of_1):
            torch.testing.assert_close(_stats(commits[i][b]), _stats(commits[0][b]), atol=1e-4, rtol=0)
            assert not torch.allclose(commits[i][b], outputs[i][b], atol=1e-3)
    # request 1: the switched session's new prompt is its own anchor, the other keeps request 0's
    torch.testing.assert_close(commits[first_of_1][0], outputs[first_of_1][0])
    torch.testing.assert_close(_stats(commits[first_of_1][1]), _stats(commits[0][1]), atol=1e-4, rtol=0)
    for i in range(first_of_1 + 1, len(phases)):
        torch.testing.assert_close(_stats(commits[i][0]), _stats(commits[first_of_1][0]), atol=1e-4, rtol=0)


@pytest.mark.slow
def test_training_lowers_the_student_loss_and_exports_a_loadable_adapter(model, tmp_path):
    gen = torch.Generator().manual_seed(5)
    torch.manual_seed(0)
    m = build_random(PRESETS["tiny"], "cpu", torch.float32, 0)
    with torch.no_grad():  # a head of a trained model's scale (random init's is near zero: no gradient reaches in)
        m.final_layer.video_out.weight.mul_(30.0)
    adapter = student_weights.student_adapter(m, rank=8, seed=1)
    params = [p for p in m.parameters() if p.requires_grad]
    assert params and all("lora" in n for n, p in m.named_parameters() if p.requires_grad)
    opt = torch.optim.Adam(params, lr=3e-2)
    batch = session_batch.SessionBatch([_session(gen, (9, 9))], torch.device("cpu"))
    losses = []
    for _ in range(12):
        opt.zero_grad()
        loss = student.session_loss(m, batch, torch.Generator().manual_seed(0), self_rollout=False)
        loss.total.backward()
        opt.step()
        losses.append(loss.total.item())
    assert losses[-1] < 0.8 * losses[0], losses
    out = student.write_adapter(student_weights.adapter_spec(adapter, m.state_dict()), tmp_path / "lora")
    spec = load_adapter(out, m.args)
    assert spec.rank == 8
    target = "blocks.0.attn.qkv_proj"
    torch.testing.assert_close(spec.factors[target][1], adapter.layers[target].lora_B["taomate"].weight.detach())


@pytest.mark.slow
def test_training_the_base_too_changes_it_and_exports_a_base_and_adapter_that_reload_the_trained_model(
        trainer_inputs, tmp_path):
    from services.dit.model.checkpoint import load_dit
    from services.dit.model.lora import LoRAAdapter

    base_dir, cond = trainer_inputs
    cfg = student.StudentRunConfig(rank=4, sessions=1, max_steps=2, distinct=1, train_base=True, base_accum=1,
                                   warmup=1, log_every=1, base_lr=1e-2)
    state, adapter = student.train(cfg, base_dir, cond, tmp_path / "state")
    logged = [json.loads(line) for line in (tmp_path / "state" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, 2] and all(r["base"]["video"] or r["base"]["teacher"] for r in logged)
    # each logged step says where its time went, part by part
    assert all(set(r["timing"]) == {"sessions", "student_forward", "student_backward", "base", "optimizer"}
               and all(t >= 0 for t in r["timing"].values()) and r["timing"]["student_forward"] > 0 for r in logged)

    lora_dir = student.export(state, adapter, tmp_path / "lora", tmp_path / "trained_base")
    before = load_dit(base_dir, PRESETS["tiny"], "cpu", torch.float32)
    after = load_dit(tmp_path / "trained_base", PRESETS["tiny"], "cpu", torch.float32)
    changed = [n for n, p in after.named_parameters() if not torch.equal(p, dict(before.named_parameters())[n])]
    assert len(changed) > 20, changed  # the base's own weights moved, not only the LoRA's

    # the exported pair is the trained EMA model: LoRA on and LoRA off
    reference, _ = student.build(tmp_path / "trained_base", torch.device("cpu"), student.StudentRunConfig(rank=4))
    weights = reference.state_dict()
    weights.update({k: v for k, v in state.ema.shadow.items() if ".lora_" in k})
    reference.load_state_dict(weights)
    served = load_dit(tmp_path / "trained_base", PRESETS["tiny"], "cpu", torch.float32)
    served_lora = LoRAAdapter.load(served, lora_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(2)
    sess = _session(gen, (9, 9))
    batch = session_batch.SessionBatch([sess], torch.device("cpu"))
    ph = plan_request(0).phases[0]
    xv, xa = batch.clean(ph)
    with torch.no_grad():
        want, _ = session_batch.forward(reference, batch, ph, xv, xa, 1.0, 1.0, [], commit=False,
                                  texts=batch.refined_texts(reference, ph.request_index))
        got, _ = session_batch.forward(served, batch, ph, xv, xa, 1.0, 1.0, [], commit=False,
                                 texts=batch.refined_texts(served, ph.request_index))
        with served_lora.suspended():
            base_out, _ = session_batch.forward(served, batch, ph, xv, xa, 1.0, 1.0, [], commit=False,
                                          texts=batch.refined_texts(served, ph.request_index))
    torch.testing.assert_close(got, want, rtol=0, atol=5e-5)
    assert (got - base_out).abs().max() > 1e-4  # the adapter is not a no-op on the exported base


def test_a_caching_run_names_each_session_past_its_first_pass_instead_of_rendering_it_again():
    sessions = student.Sessions(0.35, distinct=3, encoded_after=5)  # a run resumed at sample 5
    first = [sessions[i] for i in range(5, 8)]
    assert all(isinstance(clip, student.SessionClip) for clip in first)
    assert [sessions[i] for i in range(8, 14)] == [student.SeenSession(first[i % 3].seed) for i in range(6)]
    uncached = student.Sessions(0.35, distinct=3)[8]  # a run whose conditioner keeps nothing renders it again
    assert uncached.seed == first[0].seed and torch.equal(uncached.frames, first[0].frames)


@pytest.mark.slow
def test_a_session_named_as_encoded_is_the_one_the_conditioner_kept_and_an_unknown_one_is_refused(trainer_inputs):
    _, cond = trainer_inputs
    clip = student.render_session(student.STUDENT_SEED + 7, 0.35)
    encoded = student.encode_session(cond, clip)
    assert student.encode_session(cond, student.SeenSession(clip.seed)) is encoded
    with pytest.raises(KeyError, match="seed 12345 .* was named as encoded"):
        student.encode_session(cond, student.SeenSession(12345))


@pytest.mark.slow
def test_a_student_over_distinct_sessions_renders_each_once_per_process_with_its_sound_spread(
        trainer_inputs, tmp_path, monkeypatch):
    base_dir, cond = trainer_inputs
    rendered = []
    real = student.render_session
    monkeypatch.setattr(student, "render_session",
                        lambda seed, *rest: rendered.append((seed, *rest)) or real(seed, *rest))
    cfg = student.StudentRunConfig(rank=4, sessions=2, max_steps=3, distinct=2, warmup=1, log_every=1,
                                   sound_spread=48.0)
    student.train(cfg, base_dir, cond, tmp_path / "state")
    seeds = [student.STUDENT_SEED, student.STUDENT_SEED + 1]  # step 0's; steps 1 and 2 name them
    assert sorted(rendered) == [(seed, cfg.switch, 48.0, student.REQUESTS) for seed in seeds]


@pytest.mark.slow
def test_a_resume_with_another_sound_spread_is_refused_and_a_state_from_before_the_knob_trained_without_it(
        trainer_inputs, tmp_path):
    from dataclasses import replace
    base_dir, cond = trainer_inputs
    cfg = student.StudentRunConfig(rank=4, sessions=1, max_steps=1, warmup=1, sound_spread=48.0)
    student.train(cfg, base_dir, cond, tmp_path / "f")
    with pytest.raises(ValueError, match="holds a run with {'sound_spread': 48.0}"):
        student.train(replace(cfg, sound_spread=0.0), base_dir, cond, tmp_path / "f")
    student.train(replace(cfg, sound_spread=0.0), base_dir, cond, tmp_path / "e")
    path = tmp_path / "e" / "state.pt"
    saved = torch.load(path, weights_only=False)
    del saved["meta"]["sound_spread"]  # as run E's states were saved
    torch.save(saved, path)
    with pytest.raises(ValueError, match="holds a run with {'sound_spread': 0.0}"):
        student.train(replace(cfg, max_steps=2), base_dir, cond, tmp_path / "e")
    assert student.train(replace(cfg, sound_spread=0.0, max_steps=2), base_dir, cond, tmp_path / "e")[0].step == 2
    with pytest.raises(ValueError, match="holds a run with {'spread_requests': 2}"):  # run F's states: both
        student.train(replace(cfg, sound_spread=0.0, spread_requests=1, max_steps=3), base_dir, cond, tmp_path / "e")


@pytest.mark.slow
def test_a_student_resumed_from_its_saved_state_trains_on_as_one_that_never_stopped(trainer_inputs, tmp_path):
    """A run that spans device calls (`run_from_scratch_gpu.sh`, FROM=) must train the model that one unbroken
    process would: every draw (the noise, the self-rollouts, the served history's commits and sink gaps) goes on
    from where the saved state left it, not from the seed again."""
    from dataclasses import replace

    base_dir, cond = trainer_inputs
    cfg = student.StudentRunConfig(rank=4, sessions=1, max_steps=4, distinct=1, train_base=True, base_accum=1,
                                   warmup=1, log_every=1, self_commit=0.5, sink_gap=100.0, served_from=1)
    unbroken, _ = student.train(cfg, base_dir, cond, tmp_path / "unbroken")
    student.train(replace(cfg, max_steps=2), base_dir, cond, tmp_path / "broken")
    resumed, _ = student.train(cfg, base_dir, cond, tmp_path / "broken")

    assert resumed.step == unbroken.step == 4
    want, got = unbroken.model.state_dict(), resumed.model.state_dict()
    differ = [name for name in want if not torch.equal(want[name], got[name])]
    assert not differ, f"{len(differ)} of {len(want)} tensors differ after the resume, e.g. {differ[:3]}"
    logs = [[json.loads(line)["x0"] for line in (tmp_path / d / "log.jsonl").read_text().splitlines()]
            for d in ("unbroken", "broken")]
    assert logs[0] == logs[1]
