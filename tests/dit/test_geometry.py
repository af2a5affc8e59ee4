"""Geometry (requests, phases, audio rounding, canvases) and the global RoPE timeline."""

import pytest
import torch

from services.dit.api import CANVAS_SHORT_EDGES, InvalidCanvas, RuntimeConfig
from services.dit.stream.geometry import audio_boundary, check_canvas, plan_request, plans_of_every_shape
from services.dit.stream.timeline import Timeline

pytestmark = pytest.mark.cpu


def test_request_0_geometry():
    r = plan_request(0)
    assert (r.num_frames, r.num_latents, r.num_audio_latents) == (124, 37, 207)
    assert [p.num_frames for p in r.phases] == [39, 34, 34, 17]
    assert [p.num_latents for p in r.phases] == [12, 10, 10, 5]
    assert [p.num_audio_latents for p in r.phases] == [65, 57, 56, 29]
    assert [p.frame_start for p in r.phases] == [0, 39, 73, 107]
    assert r.phases[0].num_audio_samples == 65 * 800


def test_later_requests_geometry_and_continuity():
    end_frame, end_audio = 124, 207
    for k in range(1, 40):
        r = plan_request(k)
        assert (r.num_frames, r.num_latents) == (119, 35)
        assert [p.num_latents for p in r.phases] == [10, 10, 10, 5]
        assert [p.num_frames for p in r.phases] == [34, 34, 34, 17]
        assert r.num_audio_latents in (198, 199)
        assert r.frame_start == end_frame and r.audio_start == end_audio
        assert sum(p.num_audio_latents for p in r.phases) == r.num_audio_latents
        end_frame, end_audio = r.frame_start + r.num_frames, r.audio_start + r.num_audio_latents
    # audio stays locked to video: 40 latents per 24 frames, within half a latent
    assert abs(end_audio - end_frame * 40 / 24) <= 0.5


def test_audio_boundaries_round_half_to_even():
    # 3 frames -> 5 latents exactly; frame 1 -> 1.667 -> 2; frame 73 -> 121.67 -> 122
    assert [audio_boundary(f) for f in (0, 1, 3, 73, 107, 124)] == [0, 2, 5, 122, 178, 207]


def test_plans_of_every_shape_hold_every_request_shape_a_long_session_meets():
    def shape(plan):
        return plan.num_audio_latents, tuple((ph.num_latents, ph.num_audio_latents) for ph in plan.phases)

    few = plans_of_every_shape()
    assert [p.request_index for p in few] == [0, 1, 2, 3]
    assert {shape(plan_request(k)) for k in range(300)} == {shape(p) for p in few}


def test_canvases():
    full = CANVAS_SHORT_EDGES["full"]
    c = check_canvas(864, 480, full)
    assert c.rows_per_frame == 405 and (c.latent_height, c.latent_width) == (30, 54)
    assert check_canvas(1376, 768, full).rows_per_frame == 1032
    assert check_canvas(1920, 1088, full).rows_per_frame == 2040
    with pytest.raises(InvalidCanvas, match=r"640x352: short edge 352 is not one of the allowed short edges "
                                            r"\(480, 768, 1088\)"):
        check_canvas(640, 352, full)
    with pytest.raises(InvalidCanvas, match=r"short edge 512 is not one of the allowed short edges"):
        check_canvas(896, 512, full)
    with pytest.raises(InvalidCanvas, match=r"height=490 is not a multiple of 32 .*480, 768, 1088"):
        check_canvas(864, 490, full)
    assert RuntimeConfig.for_preset("tiny").canvases == CANVAS_SHORT_EDGES["tiny"]
    with pytest.raises(ValueError, match="preset='huge'"):
        RuntimeConfig.for_preset("huge")


def test_timeline_request0_matches_the_base_layout():
    from diffusers.modular_pipelines.minimax_h3.before_denoise import (_frame_position_grid,
                                                                        _temporal_position_grid)

    canvas = check_canvas(864, 480, CANVAS_SHORT_EDGES["full"])
    L = 11
    tl = Timeline(canvas, origin=L)
    text = tl.text(0, L)
    assert torch.equal(text[:, 0], torch.arange(L, dtype=torch.float32)) and not text[:, 1:].any()
    ref_t = _temporal_position_grid(37, float(L)).float()
    ref_hw, ref_w = _frame_position_grid(30, 54, 2, 2)
    video = torch.cat([tl.video(p) for p in plan_request(0).phases]).view(37, 405, 3)
    assert torch.equal(video[:, 0, 0], ref_t)
    assert torch.equal(video[5, :, 1:], ref_hw.float())
    audio = tl.audio(0, 207)
    assert torch.equal(audio[:207, 0], L + torch.arange(207, dtype=torch.float32))
    assert torch.all(audio[:207, 2] == float(ref_w[0])) and torch.all(audio[207:, 2] == float(ref_w[-1]))
    assert not audio[:, 1].any()


def test_timeline_later_requests_are_global_and_text_right_aligned():
    canvas = check_canvas(96, 64, CANVAS_SHORT_EDGES["tiny"])
    tl = Timeline(canvas, origin=7)
    r1 = plan_request(1)
    start = 7 + 124 * 5 / 3
    assert tl.media_start(1) == pytest.approx(start)
    text = tl.text(1, 20)  # a longer prompt: ends right before the request's media
    assert text[-1, 0].item() == pytest.approx(start - 1, abs=1e-4)
    assert text[0, 0].item() == pytest.approx(start - 20, abs=1e-4)
    v = tl.video(r1.phases[0]).view(10, canvas.rows_per_frame, 3)[:, 0, 0]
    spans = [4, 4, 4, 1, 4, 4, 4, 4, 1]  # request 1's latents are latents 37.. of the session (37 % 5 == 2)
    expect = [start + 5 / 3 * sum(spans[:i]) for i in range(10)]
    assert v.tolist() == pytest.approx(expect, abs=1e-3)
    a = tl.audio(r1.audio_start, 3)
    assert a[:3, 0].tolist() == [7 + 207.0, 7 + 208.0, 7 + 209.0]


def test_timeline_video_of_later_requests_continues_the_base_grid():
    from diffusers.modular_pipelines.minimax_h3.before_denoise import _temporal_position_grid

    # The session's latents lie on one grid of the base model's (1, 4, 4, 4, 4) spans counted from the session's
    # first latent: request k >= 1 starts at latent 37 + 35 (k - 1), i.e. 2 past a span cycle, not at its start.
    canvas = check_canvas(96, 64, CANVAS_SHORT_EDGES["tiny"])
    L = 9
    tl = Timeline(canvas, origin=L)
    phases = [ph for k in range(3) for ph in plan_request(k).phases]
    times = torch.cat([tl.video(ph).view(ph.num_latents, canvas.rows_per_frame, 3)[:, 0, 0] for ph in phases])
    assert torch.equal(times, _temporal_position_grid(37 + 2 * 35, float(L)).float())


def test_the_shared_request_lengths_are_the_clip_and_phase_layout():
    # services.common.media states them for the gateway (no torch there); the plans here build them from clips
    from services.common.media import FIRST_REQUEST_FRAMES, LATER_REQUEST_FRAMES, PHASES_PER_REQUEST

    for k, frames in ((0, FIRST_REQUEST_FRAMES), (1, LATER_REQUEST_FRAMES), (2, LATER_REQUEST_FRAMES)):
        plan = plan_request(k)
        assert (plan.num_frames, len(plan.phases)) == (frames, PHASES_PER_REQUEST)
