"""Streaming runtime and its KV cache: retention row counts per phase, the periodic audio drop, stable buffers."""

import pytest
import torch

from services.dit.api import PromptUpdate, SessionConfig
from services.dit.stream.geometry import check_canvas, plan_request
from services.dit.stream.kv_cache import kv_capacity
from tests.dit.factories import TINY, tiny_model, tiny_runtime

pytestmark = pytest.mark.cpu

ARGS = TINY


@pytest.mark.slow
def test_session_kv_rows_follow_retention_and_audio_reset():
    model = tiny_model()
    # audio reset every request so that the drop shows up after 5 phases (the default is 12)
    rt = tiny_runtime(model=model, audio_reset_requests=1)
    session = rt.open_session(SessionConfig(seed=2, width=96, height=64),
                              PromptUpdate(torch.randn(5, ARGS.text_dim), "e0"))
    kv = session.kv
    rpf = check_canvas(96, 64, (64,)).rows_per_frame
    assert kv.capacity == kv_capacity(check_canvas(96, 64, (64,)), 16)
    assert (kv.local_heads, kv.head_dim, len(kv.k)) == (ARGS.num_heads, ARGS.head_dim, ARGS.num_layers)
    ptrs = [t.data_ptr() for t in kv.k + kv.v]
    phases = [ph for k in range(2) for ph in plan_request(k).phases][:5]
    audio = [2 * ph.num_audio_latents for ph in phases]
    video = [ph.num_latents * rpf for ph in phases]
    inner, heads_flags = model.forward, []
    model.forward = lambda *a, heads=True, **kw: heads_flags.append(heads) or inner(*a, heads=heads, **kw)
    counts = []
    for _ in range(6):  # after phase k the cache holds the commits of phases 0..k-1 (a commit runs in the next phase)
        session.next_phase()
        counts.append((kv.audio_rows, kv.video_rows))
    assert counts[0] == (0, 0)
    assert counts[1] == (audio[0], video[0])
    assert counts[2] == (audio[0] + audio[1], video[0] + video[1])
    assert counts[3] == (audio[1] + audio[2], video[0] + video[1] + video[2])  # commit 0 became a video sink
    # request 1 starts by committing request 0's last phase, then drops the audio history
    assert counts[4] == (0, video[0] + video[2] + video[3])
    assert counts[5] == (audio[4], video[0] + video[3] + video[4])  # only request 1's own commit carries audio
    assert [t.data_ptr() for t in kv.k + kv.v] == ptrs
    # 2 requests x 9 teacher forwards + 6 phases x 3 students + 5 commits without heads
    assert len(heads_flags) == 2 * 9 + 6 * 3 + 5 and heads_flags.count(False) == 5
    session.close()
