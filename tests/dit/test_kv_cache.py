"""KV cache: transactional commits, sink + recent retention, audio drop every 12 requests, flat memory."""

import pytest
import torch

from services.dit.api import KVCacheError
from services.dit.stream.geometry import check_canvas, plan_request
from services.dit.stream.kv_cache import CleanAVKVCache, kv_capacity

pytestmark = pytest.mark.cpu

CANVAS = check_canvas(96, 64, (64,))
LAYERS, HEADS, DIM = 2, 2, 4


def make_cache() -> CleanAVKVCache:
    return CleanAVKVCache(LAYERS, kv_capacity(CANVAS, 16), HEADS, DIM, torch.float32, "cpu")


def rows_of(phase):
    return 2 * phase.num_audio_latents, phase.num_latents * CANVAS.rows_per_frame


def commit_fake(cache: CleanAVKVCache, tag: float, audio: int, video: int) -> None:
    """Stage fake K/V whose rows encode (tag, modality, row) so that moves can be checked."""
    cache.begin(audio, video)
    n = audio + video
    for layer in range(LAYERS):
        k, v = cache.work(layer, n, 0)
        ids = torch.arange(n, dtype=torch.float32)
        rows = torch.stack([torch.full((n,), tag), (ids >= audio).float(), ids, torch.full((n,), float(layer))], -1)
        k[cache.live:].copy_(rows[:, None, :].expand(n, HEADS, DIM))
        v[cache.live:].copy_(-rows[:, None, :].expand(n, HEADS, DIM))
        cache.stage(layer, k[cache.live:], v[cache.live:])
    cache.commit()


def run_requests(cache, num_requests, reset_every=12, on_commit=None):
    commit = 0
    for k in range(num_requests):
        if k > 0 and k % reset_every == 0:
            cache.drop_audio()
        for ph in plan_request(k).phases:
            commit_fake(cache, float(commit), *rows_of(ph))
            commit += 1
            if on_commit:
                on_commit(k, ph, cache)


def test_retention_sink_and_two_recent_by_row_counts():
    cache = make_cache()
    phases = [ph for k in range(2) for ph in plan_request(k).phases]
    a0, v0 = rows_of(phases[0])
    commit_fake(cache, 0.0, a0, v0)
    assert (cache.audio_rows, cache.video_rows) == (a0, v0)
    a1, v1 = rows_of(phases[1])
    commit_fake(cache, 1.0, a1, v1)
    assert (cache.audio_rows, cache.video_rows) == (a0 + a1, v0 + v1)  # 2 commits: both whole
    a2, v2 = rows_of(phases[2])
    commit_fake(cache, 2.0, a2, v2)  # 3 commits: commit 0 shrinks to its video rows (sink)
    assert (cache.audio_rows, cache.video_rows) == (a1 + a2, v0 + v1 + v2)
    a3, v3 = rows_of(phases[3])
    commit_fake(cache, 3.0, a3, v3)  # commit 1 evicted
    assert (cache.audio_rows, cache.video_rows) == (a2 + a3, v0 + v2 + v3)
    assert [r.index for r in cache.records] == [0, 2, 3]
    # contents moved intact: sink rows are commit 0's video rows, in order
    k = cache.k[1]
    sink = cache.records[0]
    assert torch.all(k[sink.start:sink.start + sink.rows, 0, 0] == 0.0)
    assert torch.all(k[sink.start:sink.start + sink.rows, 0, 1] == 1.0)
    assert torch.equal(k[sink.start:sink.start + sink.rows, 0, 2], torch.arange(a0, a0 + v0, dtype=torch.float32))
    last = cache.records[-1]
    assert torch.all(k[last.start:last.start + last.rows, :, 0] == 3.0)
    assert torch.equal(cache.v[1][:cache.live], -cache.k[1][:cache.live])
    assert torch.all(cache.k[1][:cache.live, 0, 3] == 1.0)


def test_audio_dropped_at_request_12():
    counts = {}
    cache = make_cache()
    run_requests(cache, 13, on_commit=lambda k, ph, c: counts.__setitem__((k, ph.phase_index),
                                                                          (c.audio_rows, c.video_rows)))
    p11, p12 = plan_request(11).phases, plan_request(12).phases
    # before the reset: the two most recent commits carry their audio
    assert counts[(11, 3)][0] == rows_of(p11[2])[0] + rows_of(p11[3])[0]
    # first commit of request 12: older audio is gone, only the new commit's audio is cached
    assert counts[(12, 0)][0] == rows_of(p12[0])[0]
    sink_video = rows_of(plan_request(0).phases[0])[1]
    assert counts[(12, 0)][1] == sink_video + rows_of(p11[3])[1] + rows_of(p12[0])[1]
    assert counts[(12, 1)][0] == rows_of(p12[0])[0] + rows_of(p12[1])[0]
    # without the reset the same commit would still see request 11's last audio
    other = make_cache()
    counts2 = {}
    run_requests(other, 13, reset_every=100, on_commit=lambda k, ph, c: counts2.__setitem__(
        (k, ph.phase_index), c.audio_rows))
    assert counts2[(12, 0)] == rows_of(p11[3])[0] + rows_of(p12[0])[0]
    # requests 1..11 never drop audio
    assert all(counts[key][0] > 0 for key in counts)


def test_memory_flat_over_50_requests():
    cache = make_cache()
    ptrs = [t.data_ptr() for t in cache.k + cache.v]
    nbytes = cache.nbytes
    lives = []
    run_requests(cache, 50, on_commit=lambda k, ph, c: lives.append((c.live, len(c.records))))
    assert [t.data_ptr() for t in cache.k + cache.v] == ptrs
    assert cache.nbytes == nbytes
    assert max(n for _, n in lives) <= 3
    steady = [live for live, _ in lives[8:]]
    assert max(steady) <= cache.capacity
    assert max(lives[-40:]) <= max(lives[8:48])  # no growth late in the run
    assert cache.num_commits == 200


def test_rollback_leaves_history_bitwise():
    cache = make_cache()
    commit_fake(cache, 0.0, 10, 12)
    commit_fake(cache, 1.0, 8, 12)
    before_k = [k[:cache.live].clone() for k in cache.k]
    before = (cache.live, [(r.index, r.start, r.audio_rows, r.video_rows) for r in cache.records])
    cache.begin(8, 12)
    k, v = cache.work(0, 20, 0)
    k[cache.live:].fill_(123.0)
    cache.stage(0, k[cache.live:], v[cache.live:])
    cache.rollback()
    assert (cache.live, [(r.index, r.start, r.audio_rows, r.video_rows) for r in cache.records]) == before
    assert all(torch.equal(a[:cache.live], b) for a, b in zip(cache.k, before_k))
    assert cache.num_commits == 2


def test_commit_with_unstaged_layer_is_rejected_and_rolled_back():
    cache = make_cache()
    cache.begin(4, 6)
    k, v = cache.work(0, 10, 0)
    cache.stage(0, k[cache.live:], v[cache.live:])
    with pytest.raises(KVCacheError, match=r"unstaged layers \[1\]"):
        cache.commit()
    assert not cache.in_transaction and cache.live == 0 and cache.num_commits == 0


def test_misuse_and_overflow_raise_readable_errors():
    cache = make_cache()
    with pytest.raises(KVCacheError, match="without begin"):
        cache.commit()
    with pytest.raises(KVCacheError, match="capacity"):
        cache.work(0, cache.capacity + 1, 0)
    cache.begin(2, 2)
    with pytest.raises(KVCacheError, match="already open"):
        cache.begin(2, 2)
    with pytest.raises(KVCacheError, match="expected"):
        cache.stage(0, torch.zeros(3, HEADS, DIM), torch.zeros(3, HEADS, DIM))
    cache.rollback()
    cache.release()
    assert cache.released and cache.nbytes == 0
    with pytest.raises(KVCacheError, match="released"):
        cache.begin(1, 1)
