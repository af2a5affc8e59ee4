"""The broadcast store: init split, retained window, late joiners, bounded viewer queues, skip-ahead and drop."""
import asyncio
import io

import av
import numpy as np
import pytest

from services.common.errors import InternalError
from services.common.config import GatewayBroadcastConfig
from services.gateway.broadcast import (
    BadFragment,
    Broadcast,
    Broadcasts,
    TooManyViewers,
    ViewerTooSlow,
    split_init_segment,
)
from services.vae.mux import FragmentedMP4Muxer
from tests.gateway.fakes import chunk_metadata, fmp4_chunks

pytestmark = pytest.mark.cpu

FPS = 24
RATE = 32000
W, H = 64, 48


def _config(**overrides) -> GatewayBroadcastConfig:
    return GatewayBroadcastConfig(**{"viewer_queue_chunks": 4, "viewer_max_skips": 2, "retain_s": 30.0,
                                     **overrides})


def test_init_segment_is_split_from_the_first_chunk_by_its_boxes():
    muxer = FragmentedMP4Muxer(W, H, fps=FPS, sample_rate=RATE)
    first = muxer.encode(np.zeros((6, H, W, 3), np.uint8), np.zeros((2, 8000), np.float32))
    init, fragment = split_init_segment(first)
    assert init == muxer.init_segment and fragment[4:8] == b"moof"
    assert split_init_segment(fragment) == (b"", fragment)
    with pytest.raises(BadFragment, match="claims"):
        split_init_segment(first[:-3])


async def test_late_viewer_starts_at_the_newest_media_chunk_and_decodes_from_it():
    chunks = fmp4_chunks(6)
    broadcast = Broadcast("s", _config(viewer_queue_chunks=8), fps=FPS)
    for i, data in enumerate(chunks[:3]):
        broadcast.publish(chunk_metadata(i, data), data)
    assert broadcast.init_segment is not None and broadcast.chunk(0).data == chunks[0][len(broadcast.init_segment):]
    with broadcast.subscribe() as viewer:
        for i, data in enumerate(chunks[3:], start=3):
            broadcast.publish(chunk_metadata(i, data, kind="trailer" if i == len(chunks) - 1 else "media"), data)
        broadcast.end(chunks=len(chunks), stopped=False)
        got = []
        while (chunk := await viewer.next()) is not None:
            got.append(chunk)
    assert [c.index for c in got] == [2, 3, 4, 5, 6]
    assert broadcast.init_segment + b"".join(c.data for c in got) == broadcast.init_segment + b"".join(chunks[2:])
    with av.open(io.BytesIO(broadcast.init_segment + b"".join(c.data for c in got))) as container:
        frames = list(container.decode(video=0))
        assert frames[0].key_frame and len(frames) == 4 * 6
    assert broadcast.num_viewers == 0


async def test_a_viewer_whose_queue_is_full_skips_ahead_then_is_dropped_after_repeated_skips():
    chunks = fmp4_chunks(14)
    broadcast = Broadcast("s", _config(viewer_queue_chunks=2, viewer_max_skips=1), fps=FPS)
    fast, slow = broadcast.subscribe(), broadcast.subscribe()
    fast_got = []
    for i, data in enumerate(chunks[:3]):
        broadcast.publish(chunk_metadata(i, data), data)
        fast_got.append((await fast.next()).index)
    assert slow.queued == 1 and slow.skips == 1 and slow.chunks_skipped == 2  # 0, 1 queued; 2 arrives: skip to 2
    assert (await slow.next()).index == 2  # it caught up: its run of skips starts again
    for i, data in enumerate(chunks[3:9], start=3):
        broadcast.publish(chunk_metadata(i, data), data)
        fast_got.append((await fast.next()).index)
    assert slow.skips == 3 and slow.dropped  # 3, 4 queued; skip at 5 (queue 5), 6; skip at 7 -> 2 in a row
    with pytest.raises(ViewerTooSlow):
        await slow.next()
    assert fast_got == list(range(9)) and broadcast.num_viewers == 1


async def test_retained_window_keeps_at_least_retain_s_of_media_and_readers_wait_for_the_next_chunk():
    chunks = fmp4_chunks(12)
    broadcast = Broadcast("s", _config(retain_s=1.0), fps=FPS)  # 6 frames = 0.25 s a chunk
    waiter = asyncio.ensure_future(broadcast.wait_for(9))
    for i, data in enumerate(chunks[:9]):
        broadcast.publish(chunk_metadata(i, data), data)
    await asyncio.sleep(0)
    assert not waiter.done()
    assert [c.index for c in broadcast.chunks] == [5, 6, 7, 8] and broadcast.chunk(4) is None
    broadcast.publish(chunk_metadata(9, chunks[9]), chunks[9])
    assert await asyncio.wait_for(waiter, 1) is True
    ender = asyncio.ensure_future(broadcast.wait_for(10))
    broadcast.end(chunks=10, stopped=True)
    assert await asyncio.wait_for(ender, 1) is False
    with broadcast.subscribe() as viewer:  # joining after the end: only the end
        assert await viewer.next() is None


async def test_max_viewers_and_ended_broadcasts_linger_then_go():
    now = [0.0]
    registry = Broadcasts(_config(max_viewers=1, linger_s=5.0), clock=lambda: now[0])
    broadcast = registry.open("s", fps=FPS)
    with broadcast.subscribe():
        with pytest.raises(TooManyViewers):
            broadcast.subscribe()
    broadcast.subscribe().close()
    broadcast.end(chunks=0, stopped=True)
    now[0] = 4.9
    assert registry.get("s") is broadcast
    now[0] = 5.0
    assert registry.get("s") is None and len(registry) == 0


async def test_chunks_out_of_order_are_refused():
    chunks = fmp4_chunks(2)
    broadcast = Broadcast("s", _config(), fps=FPS)
    with pytest.raises(InternalError, match="1 expected"):
        broadcast.publish(chunk_metadata(0, chunks[0]), chunks[0])
        broadcast.publish(chunk_metadata(2, chunks[1]), chunks[1])


async def test_an_ended_broadcast_is_forgotten_after_its_linger_without_any_later_lookup():
    registry = Broadcasts(_config(linger_s=0.05))
    registry.open("s", fps=FPS).end(chunks=0, stopped=True)
    assert "s" in registry._by_id
    await asyncio.sleep(0.2)
    assert "s" not in registry._by_id  # no get() or open() ran meanwhile
