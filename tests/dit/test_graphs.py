"""CUDA graph bank: prompt buckets, keying, sealing and misses (CPU, eager bank); replay == eager bitwise (GPU)."""

import pytest
import torch

from services.dit.attention import StreamingAttention
from services.dit.graphs import (CudaGraphBank, GraphError, GraphKey, PromptBuckets, commit_replay_views,
                                 layout_tag, packed_forward, signature_of)
from services.dit.kv_cache import CleanAVKVCache
from services.dit.layout import pack_layout
from services.dit.model import PRESETS, FullAttention, build_random

ARGS = PRESETS["tiny"]


def teacher_layout(tt=5, a=6, tail=0, t=0.4):
    gen = torch.Generator().manual_seed(3)
    row_t = ([1.0] * tail + [t] * (a - tail)) * 2
    return pack_layout(text_len=tt, audio_len_per_channel=a, video_rows=0,
                       positions_text=torch.rand(tt, 3, generator=gen),
                       positions_audio=torch.rand(2 * a, 3, generator=gen), positions_video=torch.zeros(0, 3),
                       video_t=t, text_t=t, audio_timesteps=row_t)


def teacher_inputs(layout, seed, device="cpu", dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [torch.zeros(0, 96).to(device), torch.randn(layout.audio_rows, 32, generator=gen).to(device),
            torch.randn(layout.text_len, ARGS.text_dim, generator=gen).to(device, dtype),
            (torch.rand(layout.seq_len, 3, generator=gen) * 10).to(device)]


@pytest.mark.cpu
def test_prompt_buckets():
    b = PromptBuckets()
    assert [b.bucket(n) for n in (1, 128, 129, 300, 512)] == [128, 128, 256, 384, 512]
    with pytest.raises(GraphError, match="exceeds the largest bucket 512"):
        b.bucket(513)
    with pytest.raises(GraphError, match="positive int"):
        b.bucket(0)
    with pytest.raises(GraphError, match="strictly increasing"):
        PromptBuckets((256, 128))
    with pytest.raises(GraphError, match="positive ints"):
        PromptBuckets(())
    rows = torch.randn(100, 8)
    padded, n = PromptBuckets((64, 128)).pad(rows)
    assert padded.shape == (128, 8) and n == 100
    assert torch.equal(padded[:100], rows) and (padded[100:] == 0).all()
    same, n = PromptBuckets((100,)).pad(rows)
    assert same is rows and n == 100


@pytest.mark.cpu
def test_keys_distinguish_shape_dtype_tag_and_history():
    x, y = torch.zeros(4, 8), torch.zeros(4, 8, dtype=torch.bfloat16)
    assert signature_of([x]) == (((4, 8), "float32"),)
    k = GraphKey.for_inputs("student", [x], tag=(1,), history_rows=10)
    assert k == GraphKey.for_inputs("student", [torch.ones(4, 8)], tag=(1,), history_rows=10)
    others = [GraphKey.for_inputs("student", [y], (1,), 10), GraphKey.for_inputs("student", [x], (2,), 10),
              GraphKey.for_inputs("student", [x], (1,), 11), GraphKey.for_inputs("commit", [x], (1,), 10),
              GraphKey.for_inputs("student", [torch.zeros(5, 8)], (1,), 10)]
    assert len({k, *others}) == 6
    with pytest.raises(GraphError, match="history_rows"):
        GraphKey.for_inputs("student", [x], history_rows=-1)
    with pytest.raises(GraphError, match="expected a tensor"):
        signature_of([x, 3])


@pytest.mark.cpu
def test_cpu_bank_capture_run_seal_and_misses():
    bank = CudaGraphBank("cpu")
    assert not bank.enabled
    calls = []

    def fn(a, b):
        calls.append(1)
        return a * 2 + b

    a, b = torch.ones(3), torch.arange(3.0)
    key = GraphKey.for_inputs("teacher", [a, b], tag=("step", 0))
    out = bank.capture(key, fn, [a, b])
    assert torch.equal(out, a * 2 + b) and key in bank and len(bank) == 1
    with pytest.raises(GraphError, match="already captured"):
        bank.capture(key, fn, [a, b])
    with pytest.raises(GraphError, match="do not match the key"):
        bank.capture(GraphKey.for_inputs("teacher", [a, b], tag=("step", 1)), fn, [a])
    got = bank.run(key, lambda *_: pytest.fail("the captured callable must run"), [b, a])
    assert torch.equal(got, b * 2 + a)
    with pytest.raises(GraphError, match="do not match graph"):
        bank.run(key, fn, [torch.ones(4), a])
    bank.seal()
    late = GraphKey.for_inputs("teacher", [a, b], tag=("step", 5))
    with pytest.raises(GraphError, match="after seal"):
        bank.capture(late, fn, [a, b])
    assert torch.equal(bank.run(late, fn, [a, b]), a * 2 + b)  # eager, counted
    assert bank.stats.misses == 1 and bank.stats.missed_keys == [late] and bank.stats.captured == 1
    with pytest.raises(GraphError, match="warmup"):
        CudaGraphBank("cpu", warmup=0)


@pytest.mark.cpu
def test_packed_forward_equals_direct_model_call():
    model = build_random(ARGS, "cpu", torch.float32, seed=0)
    layout = teacher_layout()
    video, audio, text, pos = teacher_inputs(layout, seed=1)
    fn = packed_forward(model, layout, FullAttention(layout))
    from dataclasses import replace
    with torch.no_grad():
        want = model(video, audio, text, replace(layout, positions=pos), FullAttention(layout))
        got = fn(video, audio, text, pos)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    tag = layout_tag(layout, "tail", 0)
    assert tag[:4] == (5, 6, 0, layout.seq_len) and tag[-2:] == ("tail", 0)
    assert layout_tag(teacher_layout(t=0.7)) != layout_tag(layout)  # other timestep -> other graph


@pytest.mark.cpu
def test_commit_replay_views_stages_every_layer():
    cache = CleanAVKVCache(num_layers=3, capacity=64, local_heads=2, head_dim=4, dtype=torch.float32, device="cpu")
    cache.begin(4, 6)
    for layer in range(3):  # what a replayed commit graph does: write rows in place, no Python staging
        k, v = cache.work(layer, 10, 3)
        k[:10].fill_(layer + 1)
        v[:10].fill_(-layer - 1)
    commit_replay_views(cache, media_rows=10, text_rows=3)
    cache.commit()
    assert cache.live == 10
    assert (cache.k[2][:10] == 3).all() and (cache.v[1][:10] == -2).all()


@pytest.mark.gpu
def test_teacher_forward_replay_is_bitwise_eager():
    dev = torch.device("cuda")
    model = build_random(ARGS, dev, torch.bfloat16, seed=0)
    bank = CudaGraphBank(dev)
    layouts = [teacher_layout(tail=0, t=0.3).to(dev), teacher_layout(tail=2, t=0.6).to(dev)]
    keys, fns = [], []
    for i, lay in enumerate(layouts):
        fn = packed_forward(model, lay, FullAttention(lay))
        inputs = teacher_inputs(lay, seed=10 + i, device=dev, dtype=torch.bfloat16)
        key = GraphKey.for_inputs("teacher", inputs, tag=layout_tag(lay, "step", i))
        bank.capture(key, fn, inputs)
        keys.append(key)
        fns.append(fn)
    bank.seal()
    for rep in range(3):
        for i, lay in enumerate(layouts):
            inputs = teacher_inputs(lay, seed=100 + 7 * rep + i, device=dev, dtype=torch.bfloat16)
            with torch.no_grad():
                eager = [o.clone() for o in fns[i](*inputs)]
            replay = bank.run(keys[i], fns[i], inputs)
            assert all(torch.equal(r, e) for r, e in zip(replay, eager))
    assert bank.stats.replays == 6 and bank.stats.misses == 0


@pytest.mark.gpu
def test_student_forward_with_kv_history_replay_is_bitwise_eager():
    dev = torch.device("cuda")
    model = build_random(ARGS, dev, torch.bfloat16, seed=0)
    cache = CleanAVKVCache(ARGS.num_layers, 256, ARGS.num_heads, ARGS.head_dim, torch.bfloat16, dev)
    cache.begin(8, 24)
    for layer in range(ARGS.num_layers):
        cache.stage(layer, torch.randn(32, ARGS.num_heads, ARGS.head_dim, device=dev, dtype=torch.bfloat16),
                    torch.randn(32, ARGS.num_heads, ARGS.head_dim, device=dev, dtype=torch.bfloat16))
    cache.commit()
    gen = torch.Generator().manual_seed(2)
    tt, a, tv = 5, 4, 16
    lay = pack_layout(text_len=tt, audio_len_per_channel=a, video_rows=tv,
                      positions_text=torch.rand(tt, 3, generator=gen),
                      positions_audio=torch.rand(2 * a, 3, generator=gen),
                      positions_video=torch.rand(tv, 3, generator=gen), video_t=0.5, audio_t=0.5).to(dev)
    fn = packed_forward(model, lay, StreamingAttention(lay, cache))

    def inputs(seed):
        g = torch.Generator().manual_seed(seed)
        return [torch.randn(tv, 96, generator=g).to(dev), torch.randn(2 * a, 32, generator=g).to(dev),
                torch.randn(tt, ARGS.text_dim, generator=g).to(dev, torch.bfloat16),
                torch.rand(lay.seq_len, 3, generator=g).to(dev)]

    bank = CudaGraphBank(dev)
    key = GraphKey.for_inputs("student", inputs(0), tag=layout_tag(lay), history_rows=cache.live)
    bank.capture(key, fn, inputs(0))
    bank.seal()
    for seed in (1, 2):
        with torch.no_grad():
            eager = [o.clone() for o in fn(*inputs(seed))]
        replay = bank.run(key, fn, inputs(seed))
        assert all(torch.equal(r, e) for r, e in zip(replay, eager))


@pytest.mark.gpu
def test_commit_forward_replay_stages_the_same_rows_as_eager():
    dev = torch.device("cuda")
    model = build_random(ARGS, dev, torch.bfloat16, seed=0)
    cache = CleanAVKVCache(ARGS.num_layers, 256, ARGS.num_heads, ARGS.head_dim, torch.bfloat16, dev)
    gen = torch.Generator().manual_seed(4)
    tt, a, tv = 5, 4, 16
    lay = pack_layout(text_len=tt, audio_len_per_channel=a, video_rows=tv,
                      positions_text=torch.rand(tt, 3, generator=gen),
                      positions_audio=torch.rand(2 * a, 3, generator=gen),
                      positions_video=torch.rand(tv, 3, generator=gen), video_t=1.0, audio_t=1.0).to(dev)
    nm, hist = lay.num_media, cache.live

    def inputs(seed):
        g = torch.Generator().manual_seed(seed)
        return [torch.randn(tv, 96, generator=g).to(dev), torch.randn(2 * a, 32, generator=g).to(dev),
                torch.randn(tt, ARGS.text_dim, generator=g).to(dev, torch.bfloat16),
                torch.rand(lay.seq_len, 3, generator=g).to(dev)]

    cache.begin(2 * a, tv)
    fn = packed_forward(model, lay, StreamingAttention(lay, cache, commit=True))
    bank = CudaGraphBank(dev)
    key = GraphKey.for_inputs("commit", inputs(0), tag=layout_tag(lay), history_rows=hist)
    bank.capture(key, fn, inputs(0))
    bank.seal()
    cache.rollback()
    cache.begin(2 * a, tv)
    with torch.no_grad():
        eager = [o.clone() for o in fn(*inputs(1))]
    eager_rows = [cache.k[layer][hist:hist + nm].clone() for layer in range(ARGS.num_layers)]
    cache.rollback()
    cache.begin(2 * a, tv)
    replay = bank.run(key, fn, inputs(1))
    commit_replay_views(cache, nm, tt)
    cache.commit()
    assert all(torch.equal(r, e) for r, e in zip(replay, eager))
    assert all(torch.equal(cache.k[layer][hist:hist + nm], eager_rows[layer]) for layer in range(ARGS.num_layers))
    assert cache.live == hist + nm and bank.stats.replays == 1
