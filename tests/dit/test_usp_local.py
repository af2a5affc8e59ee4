"""`UlyssesHandle.local()`: forwards inside it run unsharded on one rank, with no collective, and equal the
single-device model (the audio teacher's short documents use it)."""
import socket

import pytest
import torch
import torch.distributed as dist

from services.dit.group import ulysses as sp
from services.dit.model.layout import pack_layout
from services.dit.model.network import FullAttention
from services.dit.model.shard import NoShard
from tests.dit.factories import TINY, tiny_model

pytestmark = pytest.mark.cpu
ARGS = TINY


@pytest.fixture
def one_rank_group():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _document():
    g = torch.Generator().manual_seed(2)
    layout = pack_layout(text_len=7, audio_len_per_channel=11, video_rows=0,
                         positions_text=torch.rand(7, 3, generator=g), positions_audio=torch.rand(22, 3, generator=g),
                         positions_video=torch.zeros(0, 3), video_t=0.3, text_t=0.3, audio_t=0.3)
    inputs = (torch.zeros(0, ARGS.video_row_dim), torch.randn(22, ARGS.audio_channels, generator=g),
              torch.randn(7, ARGS.text_dim, generator=g))
    return layout, inputs


def test_local_forwards_issue_no_collective_and_equal_the_plain_model(one_rank_group, monkeypatch):
    model = tiny_model()
    layout, inputs = _document()
    with torch.no_grad():
        plain = model(*inputs, layout, FullAttention(layout))
    calls = []
    real = sp.dist.all_to_all_single
    monkeypatch.setattr(sp.dist, "all_to_all_single", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    handle = sp.install_ulysses(model, None, 0, 1)
    with torch.no_grad():
        with handle.local(), handle.local():  # nestable
            local = model(*inputs, layout, FullAttention(layout))
            assert isinstance(model.sequence_shard, NoShard)
        assert calls == []
        assert model.sequence_shard is handle.shard
        sharded = model(*inputs, layout, FullAttention(layout))
    assert len(calls) == 2 * ARGS.num_layers  # q/k/v to heads and back, per block
    for a, b in zip(local, plain):
        assert torch.equal(a, b)
    for a, b in zip(sharded, plain):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
