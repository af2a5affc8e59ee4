"""A request's text rows run once per text timestep; its later phases take their recorded K/V
(`RuntimeConfig.reuse_text_kv`, `StreamingAttention(record=..., text_kv=...)`). Padded to a prompt-length bucket
(`RuntimeConfig.text_buckets`), the text rows give what the prompt's exact rows give."""

from dataclasses import replace

import pytest
import torch

import services.dit.stream.runtime as runtime_module
from services.dit.api import PromptUpdate, RuntimeConfig, SessionConfig
from services.dit.stream.attention import StreamingAttention
from services.dit.stream.kv_cache import CleanAVKVCache
from services.dit.model.layout import pack_layout
from services.dit.stream.schedule import model_t
from tests.dit.factories import TINY, tiny_model, tiny_runtime

pytestmark = pytest.mark.cpu

ARGS = TINY
PHASES = 6  # request 0 and two phases of request 1, which has a new prompt


def prompt(seed: int, event_id: str, tokens: int) -> PromptUpdate:
    return PromptUpdate(torch.randn(tokens, ARGS.text_dim, generator=torch.Generator().manual_seed(seed)), event_id)


def open_session(adapter_dir, reuse: bool, forwards: list | None = None, buckets: tuple[int, ...] = ()):
    model = tiny_model()
    rt = tiny_runtime(adapter_dir, model=model, reuse_text_kv=reuse, text_buckets=buckets)
    if forwards is not None:  # (text rows in the layout, text keys the media attend to) of every streaming forward
        def hook(module, args, kwargs):
            attention = args[4]
            if isinstance(attention, StreamingAttention):
                forwards.append((args[3].text_len, attention.text_keys))
        model.register_forward_pre_hook(hook, with_kwargs=True)
    return rt.open_session(SessionConfig(seed=5, width=96, height=64), prompt(1, "first", tokens=6))


def run(adapter_dir, reuse: bool, forwards: list | None = None, buckets: tuple[int, ...] = ()):
    session = open_session(adapter_dir, reuse, forwards, buckets)
    outs = [session.next_phase()]
    session.submit_prompt(prompt(2, "second", tokens=9))  # takes effect at request 1
    outs += [session.next_phase() for _ in range(PHASES - 1)]
    session.close()
    return outs


def test_reused_text_kv_gives_what_running_the_text_rows_gives(adapter_dir):
    reused, recomputed = run(adapter_dir, reuse=True), run(adapter_dir, reuse=False)
    for a, b in zip(reused, recomputed):
        torch.testing.assert_close(a.video, b.video, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.audio, b.audio, rtol=0, atol=0)  # the teacher's, no text reuse there


def test_text_rows_run_once_per_request_and_timestep(adapter_dir):
    forwards = []
    run(adapter_dir, reuse=True, forwards=forwards)
    # Forwards in order: phase 0's 3 students, then per phase its predecessor's commit and 3 students. Request 0
    # (6 tokens): phase 0's students (3 timesteps) and phase 1's commit (sigma 0) run their text rows (0-3); the
    # rest reuse, also request 1's first forward (15), the commit of request 0's last phase. Request 1 (9 tokens):
    # its phase 0 students and phase 1's commit (16-19).
    with_text = [i for i, (rows, _) in enumerate(forwards) if rows]
    assert with_text == [0, 1, 2, 3, 16, 17, 18, 19]
    assert len(forwards) == PHASES * 3 + PHASES - 1
    keys = [k for _, k in forwards]
    assert keys[:16] == [6] * 16 and keys[16:] == [9] * (len(forwards) - 16)


@pytest.mark.parametrize("reuse", [True, False])
def test_text_padded_to_a_bucket_gives_what_the_exact_rows_give(adapter_dir, reuse):
    forwards = []
    exact, padded = run(adapter_dir, reuse), run(adapter_dir, reuse, forwards, buckets=(8, 12, 64))
    for a, b in zip(exact, padded):
        torch.testing.assert_close(a.video, b.video, rtol=1e-5, atol=1e-5)
        assert torch.equal(a.audio, b.audio)
    # request 0's 6 tokens go to the bucket of 8 and request 1's 9 to the bucket of 12; the forwards see (and, with
    # reuse, record) only the real rows as keys
    with_text = [f for f in forwards if f[0]]
    assert with_text and all(f in ((8, 6), (12, 9)) for f in with_text)
    assert (12, 9) in with_text


def test_a_bucket_record_holds_what_the_real_rows_record(adapter_dir):
    records = []
    for buckets in ((), (64,)):
        session = open_session(adapter_dir, reuse=True, buckets=buckets)
        session.next_phase()
        records.append(session._request.text_kv)
        session.close()
    exact, padded = records
    assert len(padded) == 3 and {kv.shape[2] for kv in padded.values()} == {6}
    # the text rows' own attention sees the real rows only: a pad key moves the second layer's K/V by ~1e-4 here
    for t, kv in exact.items():
        torch.testing.assert_close(padded[t], kv, rtol=0, atol=1e-5)


def test_text_buckets_must_hold_the_longest_prompt():
    with pytest.raises(ValueError, match="the largest must hold a prompt of max_text_tokens=16 rows"):
        RuntimeConfig.for_preset("tiny", max_text_tokens=16, text_buckets=(8, 12))
    with pytest.raises(ValueError, match="strictly increasing"):
        RuntimeConfig.for_preset("tiny", max_text_tokens=16, text_buckets=(16, 8))


def test_only_the_commit_timestep_outlives_the_last_phase(adapter_dir):
    session = open_session(adapter_dir, reuse=True)
    for _ in range(4):  # request 0 whole
        session.next_phase()
    request = session._pending_commit[0]
    assert list(request.text_kv) == [model_t(0.0)]
    (layers, pair, rows, heads, dim), = {tuple(kv.shape) for kv in request.text_kv.values()}
    assert (layers, pair, rows, heads, dim) == (ARGS.num_layers, 2, 6, ARGS.num_heads, ARGS.head_dim)
    session.close()


def test_a_failed_forward_records_nothing_and_the_retry_matches(adapter_dir, monkeypatch):
    clean = run(adapter_dir, reuse=True)[:3]

    class FailingOnce(StreamingAttention):
        armed = True

        def __call__(self, layer, q, k, v):
            out = super().__call__(layer, q, k, v)
            if self.commit and layer == ARGS.num_layers - 1 and FailingOnce.armed:
                FailingOnce.armed = False  # the first commit, which records the sigma-0 text K/V
                raise RuntimeError("injected failure in the last layer")
            return out

    monkeypatch.setattr(runtime_module, "StreamingAttention", FailingOnce)
    session = open_session(adapter_dir, reuse=True)
    outs = [session.next_phase()]
    with pytest.raises(RuntimeError, match="injected"):
        session.next_phase()
    assert model_t(0.0) not in session._request.text_kv  # layers 0..L-2 recorded, but the forward did not finish
    outs += [session.next_phase(), session.next_phase()]  # the retried phase 1, then phase 2
    session.close()
    for a, b in zip(outs, clean):
        assert torch.equal(a.video, b.video) and torch.equal(a.audio, b.audio)


def layout(text_len: int):
    return pack_layout(text_len=text_len, audio_len_per_channel=2, video_rows=4,
                       positions_text=torch.zeros(text_len, 3), positions_audio=torch.zeros(4, 3),
                       positions_video=torch.zeros(4, 3), video_t=0.5, audio_t=0.5)


def test_recorded_text_kv_and_text_rows_do_not_mix():
    cache = CleanAVKVCache(2, 64, local_heads=2, head_dim=4, dtype=torch.float32, device="cpu")
    kv = torch.zeros(2, 2, 3, 2, 4)
    with pytest.raises(ValueError, match="the layout must have none"):
        StreamingAttention(layout(3), cache, text_kv=kv)
    with pytest.raises(ValueError, match="the layout must have none"):
        StreamingAttention(layout(0), cache, text_kv=torch.zeros(2, 2, 3, 2, 5))
    with pytest.raises(ValueError, match="record=True needs text rows"):
        StreamingAttention(layout(0), cache, record=True)
    assert StreamingAttention(layout(0), cache, text_kv=kv).text_keys == 3


def test_padded_text_counts_its_real_rows_first():
    cache = CleanAVKVCache(2, 64, local_heads=2, head_dim=4, dtype=torch.float32, device="cpu")
    padded = replace(layout(4), text_valid=torch.tensor([True, True, False, False]))
    assert StreamingAttention(padded, cache, record=True).text_keys == 2
    holes = replace(layout(4), text_valid=torch.tensor([True, False, True, False]))
    with pytest.raises(ValueError, match="real rows first"):
        StreamingAttention(holes, cache)
