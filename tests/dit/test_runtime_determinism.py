"""Streaming runtime: bitwise determinism, output shapes/metadata, teacher audio published exactly."""

import pytest
import torch

from services.dit.api import RuntimeConfig, SessionConfig
from services.dit.stream.geometry import check_canvas, plan_request
from services.dit.stream.runtime import DiTRuntime, patchify, request_noise
from tests.dit.factories import TINY, tiny_prompt, tiny_runtime

pytestmark = pytest.mark.cpu

ARGS = TINY
PHASES = 6  # request 0 and the first two phases of request 1 (teacher tail, audio continuity)


def make_runtime(adapter_dir, **config) -> DiTRuntime:
    return tiny_runtime(adapter_dir, **config)


prompt = tiny_prompt


def run(adapter_dir, seed=7, phases=PHASES, teacher_log=None, update=None, **config):
    """`phases` phases of a session on prompt 1; `update` (a prompt) sent after the first phase, so it applies from
    request 1; `config`: RuntimeConfig keywords."""
    rt = make_runtime(adapter_dir, **config)
    if teacher_log is not None:
        inner = rt.teacher.run

        def logged(*a, **kw):
            out = inner(*a, **kw)
            teacher_log.append(out[-1].clone())
            return out

        rt.teacher.run = logged
    session = rt.open_session(SessionConfig(seed=seed, width=96, height=64), prompt(1, "first"))
    outs = [session.next_phase()]
    if update is not None:
        session.submit_prompt(update)
    outs += [session.next_phase() for _ in range(phases - 1)]
    session.close()
    return outs



@pytest.fixture(scope="module")
def first_run(adapter_dir):
    log = []
    return run(adapter_dir, teacher_log=log), log


@pytest.mark.slow
def test_same_seed_and_script_is_bitwise_identical(adapter_dir, first_run):
    a, _ = first_run
    b = run(adapter_dir)
    for x, y in zip(a, b):
        assert torch.equal(x.video, y.video) and torch.equal(x.audio, y.audio)
        assert (x.meta.request_index, x.meta.phase_index) == (y.meta.request_index, y.meta.phase_index)
    c = run(adapter_dir, seed=8, phases=1)
    assert not torch.equal(a[0].video, c[0].video) and not torch.equal(a[0].audio, c[0].audio)


def test_phase_shapes_and_metadata(first_run):
    outs, _ = first_run
    plans = [ph for k in range(2) for ph in plan_request(k).phases][:PHASES]
    for out, ph in zip(outs, plans):
        m = out.meta
        assert (m.request_index, m.phase_index) == (ph.request_index, ph.phase_index)
        assert out.video.shape == (ph.num_latents, 24, 4, 6) and out.video.dtype == torch.float32
        assert out.audio.shape == (2, ph.num_audio_latents, 32) and out.audio.dtype == torch.float32
        assert (m.num_frames, m.num_audio_samples) == (ph.num_frames, ph.num_audio_latents * 800)
        assert m.active_event_id == "first"
        assert torch.isfinite(out.video).all() and torch.isfinite(out.audio).all()
        assert m.timings.student_s > 0
        assert (m.timings.commit_s > 0) == (out is not outs[0])  # each phase runs the commit of the one before
    assert outs[0].meta.started_event_ids == ("first",) and outs[0].meta.completed_event_ids == ("first",)
    assert outs[0].meta.timings.teacher_s > 0 and outs[1].meta.timings.teacher_s == 0


def test_published_audio_is_the_teachers_clean_latent(first_run):
    outs, teacher = first_run
    assert len(teacher) == 2  # one teacher run per request
    req0 = torch.cat([o.audio for o in outs[:4]], dim=1)
    assert torch.equal(req0, teacher[0])
    req1 = torch.cat([o.audio for o in outs[4:6]], dim=1)
    assert torch.equal(req1, teacher[1][:, :req1.shape[1]])


def test_clean_video_renormalised_to_first_phase_statistics(first_run):
    # per feature of the DiT's video rows [Tv, 96] (a latent channel at one of the 2x2 patch places), as the
    # official runtime: the population mean and std of each of the 96 columns
    outs, _ = first_run
    rows = [patchify(out.video) for out in outs]
    ref_mean, ref_std = rows[0].mean(dim=0), rows[0].std(dim=0, unbiased=False)
    for r in rows[1:]:
        assert torch.allclose(r.mean(dim=0), ref_mean, atol=1e-4)
        assert torch.allclose(r.std(dim=0, unbiased=False), ref_std, atol=1e-4)


def test_every_request_draws_request_0s_noise_shapes_and_drops_its_transport_prefix():
    # As the official sampler: each request draws the noise of a whole 37-latent / 207-audio-latent request (the
    # audio after a discarded draw of that video shape); a later request drops the leading 2 video latents and
    # 207 - A audio latents per channel, the place of the previous request's tail. The video seed wraps at 2**63.
    canvas = check_canvas(96, 64, (64,))
    full = plan_request(0)
    shape = (24, full.num_latents, canvas.latent_height, canvas.latent_width)  # [C, F, h, w]
    for seed, k in ((5, 0), (5, 1), (5, 2), (5, 3), (2**63 - 1, 1)):
        plan = plan_request(k)
        video, audio = request_noise(seed, plan, canvas, 24, 32)
        gen = torch.Generator().manual_seed((seed + k * 1_000_003) % 2**63)
        want_video = torch.randn(shape, generator=gen)[:, full.num_latents - plan.num_latents:].transpose(0, 1)
        gen = torch.Generator().manual_seed(seed + k)
        torch.randn(shape, generator=gen)
        want_audio = torch.randn(2 * full.num_audio_latents, 32, generator=gen).view(2, full.num_audio_latents, 32)
        assert torch.equal(video, want_video), (seed, k)
        assert torch.equal(audio, want_audio[:, full.num_audio_latents - plan.num_audio_latents:]), (seed, k)


def _stats(out):
    rows = patchify(out.video)  # [Tv, 96]
    return rows.mean(dim=0), rows.std(dim=0, unbiased=False)


@pytest.mark.slow
def test_with_the_prompt_anchor_an_update_renormalises_to_the_first_phase_of_its_own_request(adapter_dir):
    outs = run(adapter_dir, update=prompt(2, "second"), renormalise_anchor="prompt")
    first_request, second_request = outs[:4], outs[4:]
    assert second_request[0].meta.started_event_ids == ("second",)
    for out in first_request[1:]:
        torch.testing.assert_close(_stats(out), _stats(first_request[0]), atol=1e-4, rtol=0)
    # the update's first phase is not pulled to the first prompt's statistics: it is the new anchor
    assert not torch.allclose(_stats(second_request[0])[0], _stats(first_request[0])[0], atol=1e-2)
    for out in second_request[1:]:
        torch.testing.assert_close(_stats(out), _stats(second_request[0]), atol=1e-4, rtol=0)


@pytest.mark.slow
def test_with_the_session_anchor_an_update_stays_renormalised_to_the_sessions_first_phase(adapter_dir):
    outs = run(adapter_dir, update=prompt(2, "second"), renormalise_anchor="session")
    assert outs[4].meta.started_event_ids == ("second",)
    for out in outs[1:]:
        torch.testing.assert_close(_stats(out), _stats(outs[0]), atol=1e-4, rtol=0)


@pytest.mark.slow
def test_the_prompt_anchor_changes_no_byte_of_a_session_without_an_update(adapter_dir, first_run):
    outs = run(adapter_dir, renormalise_anchor="prompt")
    for got, want in zip(outs, first_run[0], strict=True):
        assert torch.equal(got.video, want.video) and torch.equal(got.audio, want.audio)


def test_an_unknown_renormalise_anchor_is_refused_with_its_name():
    with pytest.raises(ValueError, match="renormalise_anchor='request'"):
        RuntimeConfig.for_preset("tiny", renormalise_anchor="request")
