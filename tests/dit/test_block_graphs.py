"""The block stack as piecewise CUDA graphs (`BlockGraphs`): the pieces between the attention calls compute what the
block loop computes, only the captured shapes with the LoRA active replay, and a session's text-free forwards are
exactly the captured shapes, and with the text padded to a bucket so are the forwards that run it. On the CPU the
bank runs each piece eagerly (same bookkeeping); on a GPU they replay."""

import pytest
import torch

from services.dit.api import PromptUpdate, RuntimeConfig, SessionConfig
from services.dit.model.block_graphs import BlockGraphs
from services.dit.stream.geometry import Canvas
from services.dit.model.layout import pack_layout
from services.dit.model.lora import LoRAAdapter, random_adapter_spec
from services.dit.model.network import FullAttention
from services.dit.stream.runtime import DiTRuntime, block_graph_shapes, text_free_block_shapes
from tests.dit.factories import TINY, tiny_model

ARGS = TINY
PIECES = ARGS.num_layers + 1


def model_and_adapter(device: str, dtype: torch.dtype):
    model = tiny_model(device, dtype)
    return model, LoRAAdapter(model, random_adapter_spec(ARGS, device, seed=1), dtype)


def document(device: str, dtype: torch.dtype):
    g = torch.Generator().manual_seed(3)
    layout = pack_layout(text_len=5, audio_len_per_channel=6, video_rows=40, positions_text=torch.zeros(5, 3),
                         positions_audio=torch.rand(12, 3, generator=g), positions_video=torch.rand(40, 3, generator=g),
                         video_t=0.25, audio_t=0.5).to(device)
    video = torch.randn(40, ARGS.video_row_dim, generator=g).to(device)
    audio = torch.randn(12, ARGS.audio_channels, generator=g).to(device)
    text = torch.randn(5, ARGS.text_dim, generator=g).to(device, dtype)
    return (video, audio, text, layout), layout.seq_len, len(layout.timestep_values)


def forward_both_ways(device: str, dtype: torch.dtype):
    model, adapter = model_and_adapter(device, dtype)
    (video, audio, text, layout), rows, slots = document(device, dtype)
    with torch.no_grad():
        eager = model(video, audio, text, layout, FullAttention(layout))
        graphs = BlockGraphs(model, adapter, torch.device(device), 1)
        graphs.capture(rows, slots)
        graphs.seal()
        model.block_graphs = graphs
        replayed = model(video, audio, text, layout, FullAttention(layout))
        replays = graphs.bank.stats.replays
        with adapter.suspended():  # the teacher's path: LoRA off, not what the graphs hold
            teacher = model(video, audio, text, layout, FullAttention(layout))
        assert graphs.bank.stats.replays == replays
        model.block_graphs = None
        with adapter.suspended():
            teacher_eager = model(video, audio, text, layout, FullAttention(layout))
    return eager, replayed, replays, teacher, teacher_eager


@pytest.mark.parametrize("device, dtype", [pytest.param("cpu", torch.float32, marks=pytest.mark.cpu),
                                           pytest.param("cuda", torch.bfloat16, marks=pytest.mark.gpu)])
def test_replayed_pieces_compute_the_block_loop_bitwise(device, dtype):
    eager, replayed, replays, teacher, teacher_eager = forward_both_ways(device, dtype)
    assert replays == PIECES
    for a, b in zip(eager, replayed):
        assert torch.equal(a, b)
    for a, b in zip(teacher, teacher_eager):
        assert torch.equal(a, b)
    assert not torch.equal(eager[0], teacher[0])  # the LoRA matters, so running the graphs for the teacher would show


@pytest.mark.cpu
def test_only_a_captured_shape_replays_and_shapes_are_captured_once():
    model, adapter = model_and_adapter("cpu", torch.float32)
    graphs = BlockGraphs(model, adapter, torch.device("cpu"), 1)
    graphs.capture(128, 2)
    with pytest.raises(ValueError, match="already captured"):
        graphs.capture(128, 2)
    with adapter.suspended(), pytest.raises(ValueError, match="LoRA active"):
        graphs.capture(64, 1)
    tables = [torch.zeros(6, 6, ARGS.hidden_size)] * ARGS.num_layers
    assert graphs.covers(torch.zeros(128, ARGS.hidden_size), tables)
    assert not graphs.covers(torch.zeros(192, ARGS.hidden_size), tables)
    assert not graphs.covers(torch.zeros(128, ARGS.hidden_size), [torch.zeros(3, 6, ARGS.hidden_size)])
    assert graphs.shapes == [(128, 2)]
    # pieces captured for a Ulysses group of two replay only under a shard of that degree
    usp2 = BlockGraphs(model, adapter, torch.device("cpu"), 2)
    usp2.capture(128, 2)
    assert not usp2.covers(torch.zeros(128, ARGS.hidden_size), tables)
    with pytest.raises(ValueError, match="degree 3 must be >= 1 and divide num_heads=4"):
        BlockGraphs(model, adapter, torch.device("cpu"), 3)


@pytest.mark.cpu
def test_shapes_of_one_row_count_share_their_buffers_but_the_tables():
    model, adapter = model_and_adapter("cpu", torch.float32)
    graphs = BlockGraphs(model, adapter, torch.device("cpu"), 1)
    for rows, slots in ((128, 1), (128, 2), (192, 1)):
        graphs.capture(rows, slots)
    one, two, other = (graphs._buffers[k] for k in ((128, 1), (128, 2), (192, 1)))
    assert one.x is two.x and one.send is two.send and one.attn is two.attn and one.rows is two.rows
    assert one.tables.shape[1] == 3 and two.tables.shape[1] == 6
    assert other.x is not one.x


@pytest.mark.cpu
@pytest.mark.slow
def test_a_session_replays_every_text_free_forward():
    canvas = Canvas(96, 64)
    runs = []
    for with_graphs in (False, True):
        model, adapter = model_and_adapter("cpu", torch.float32)
        graphs = None
        if with_graphs:
            graphs = BlockGraphs(model, adapter, torch.device("cpu"), 1)
            for rows, slots in text_free_block_shapes([canvas], 1):
                graphs.capture(rows, slots)
            graphs.seal()
            model.block_graphs = graphs
        shapes = []  # (rows, timestep slots, text rows) of every forward with the LoRA active
        model.register_forward_pre_hook(lambda m, a: shapes.append(
            (a[3].seq_len, len(a[3].timestep_values), a[3].text_len)) if not adapter.suspended_depth else None)
        rt = DiTRuntime(model, RuntimeConfig.for_preset("tiny", max_text_tokens=16), adapter)
        text = torch.randn(7, ARGS.text_dim, generator=torch.Generator().manual_seed(4))
        session = rt.open_session(SessionConfig(seed=2, width=canvas.width, height=canvas.height), PromptUpdate(text))
        runs.append([session.next_phase() for _ in range(6)])
        session.close()
    for a, b in zip(*runs):
        assert torch.equal(a.video, b.video) and torch.equal(a.audio, b.audio)
    # 6 phases: 3 + 5 * 4 streaming forwards. The 15 without text rows have the captured shapes; a forward with its
    # text rows replays too where they do not change the padded row count (the pieces are the same computation).
    assert len(shapes) == 23 and sum(1 for *_, text in shapes if not text) == 15
    replayed = [s for s in shapes if s[:2] in graphs.shapes]
    assert {s for s in shapes if not s[2]} <= set(replayed)
    assert graphs.bank.stats.replays == len(replayed) * PIECES and graphs.bank.stats.misses == 0


@pytest.mark.cpu
@pytest.mark.slow
def test_with_text_buckets_a_session_replays_every_forward():
    canvas, buckets = Canvas(96, 64), (64,)
    runs, counts = [], []
    for with_graphs in (False, True):
        model, adapter = model_and_adapter("cpu", torch.float32)
        graphs = None
        if with_graphs:
            graphs = BlockGraphs(model, adapter, torch.device("cpu"), 1)
            for rows, slots in block_graph_shapes([canvas], 1, buckets):
                graphs.capture(rows, slots)
            graphs.seal()
            model.block_graphs = graphs
        forwards = []
        model.register_forward_pre_hook(lambda m, a: forwards.append(a[3].text_len) if not adapter.suspended_depth
                                        else None)
        config = RuntimeConfig.for_preset("tiny", max_text_tokens=16, text_buckets=buckets)
        rt = DiTRuntime(model, config, adapter)
        text = torch.randn(7, ARGS.text_dim, generator=torch.Generator().manual_seed(4))
        session = rt.open_session(SessionConfig(seed=2, width=canvas.width, height=canvas.height), PromptUpdate(text))
        runs.append([session.next_phase() for _ in range(6)])
        session.close()
        counts.append(forwards)
    for a, b in zip(*runs):
        assert torch.equal(a.video, b.video) and torch.equal(a.audio, b.audio)
    # the 8 forwards with text rows have the bucket's 64 (7 real), which puts request 0's phase 0 on 320 rows
    # instead of the exact rows' 256: a shape only the text rows' padded forwards have
    assert sorted(set(counts[1])) == [0, 64] and counts[1].count(64) == 8
    assert (320, 2) in graphs.shapes and (320, 2) not in text_free_block_shapes([canvas], 1)
    assert graphs.bank.stats.replays == len(counts[1]) * PIECES and graphs.bank.stats.misses == 0
