"""The watch websocket against the fake pipeline (real fMP4): late joiners, viewer messages, auth, unknown ids, a
viewer stuck in a send."""
import asyncio
import io
import json

import aiohttp
import av
import pytest
from aiohttp.test_utils import TestServer
from prometheus_client import CollectorRegistry

from services.common.config import GatewayAuthConfig, GatewayBroadcastConfig
from services.gateway.access import Access
from services.gateway.broadcast import Broadcast
from services.gateway.metrics import GatewayMetrics
from services.gateway.protocol import MessageLimits
from services.gateway.watch import WatchConnection
from services.gateway.ws import _WebSocketSink
from tests.gateway.fakes import (
    FakeBehaviour,
    FakePipeline,
    Transcript,
    read_until,
    running_gateway,
    small_config,
    chunk_metadata,
    fmp4_chunks,
    ws_url,
)

pytestmark = pytest.mark.cpu

DIRECTOR_TOKEN = "d" * 24
VIEWER_TOKEN = "v" * 24


def _watch_url(server: TestServer, start: dict) -> str:
    return str(server.make_url(start["watch_url"])).replace("http://", "ws://", 1)


async def _watch(http: aiohttp.ClientSession, url: str, transcript: Transcript, **kwargs) -> None:
    async with http.ws_connect(url, **kwargs) as ws:
        await read_until(ws, transcript)


async def test_a_late_viewer_gets_the_init_then_the_director_bytes_from_the_newest_chunk_and_done():
    pipeline = FakePipeline(FakeBehaviour(num_chunks=10, chunk_delay_s=0.05))
    async with running_gateway(small_config(), pipeline) as server:
        director, viewer = Transcript(), Transcript()
        async with aiohttp.ClientSession() as http, http.ws_connect(ws_url(server)) as ws:
            await ws.send_json({"type": "session.start", "prompt": "a bar"})
            start = await read_until(ws, director, until="video.start")
            assert start["watch_url"] == f"/v1/realtime/video/watch/{start['request_id']}"
            assert start["hls_url"] == f"/v1/realtime/video/hls/{start['request_id']}/playlist.m3u8"
            for _ in range(3):
                await read_until(ws, director, until="video.chunk_metadata")
            watching = asyncio.ensure_future(_watch(http, _watch_url(server, start), viewer))
            await read_until(ws, director, until="session.done")
            await asyncio.wait_for(watching, 10)
    assert viewer.texts[0] == {**start, "role": "viewer"}
    init_meta, metas = viewer.texts[1], viewer.of_type("video.chunk_metadata")
    assert init_meta["type"] == "video.init_segment" and init_meta["byte_length"] == len(viewer.binaries[0])
    pairs = ["text:video.chunk_metadata", "binary"] * len(metas)
    assert viewer.order[1:] == ["text:video.init_segment", "binary", *pairs, "text:session.done"]
    first = metas[0]["transport_chunk_index"]
    assert first >= 2 and [m["transport_chunk_index"] for m in metas] == list(range(first, 11))
    director_metas = director.of_type("video.chunk_metadata")
    assert metas == director_metas[first:]  # the same wire dicts (byte_length differs on chunk 0 only)
    assert viewer.binaries[1:] == director.binaries[first:]
    assert director.binaries[0].startswith(viewer.binaries[0])  # the director's chunk 0 opens with that init
    assert viewer.of_type("session.done")[0] == {"type": "session.done", "request_id": start["request_id"],
                                                 "chunks": len(metas), "stopped": False}
    assert viewer.close_code == 1000
    with av.open(io.BytesIO(b"".join(viewer.binaries))) as container:
        frames = list(container.decode(video=0))
    assert frames[0].key_frame and len(frames) == 6 * (10 - first)
    with av.open(io.BytesIO(b"".join(viewer.binaries))) as container:
        assert sum(f.samples for f in container.decode(audio=0)) > 0


async def test_a_viewer_may_only_ping_and_the_director_leaving_ends_the_stream_for_it():
    pipeline = FakePipeline(FakeBehaviour(num_chunks=None, chunk_delay_s=0.05))
    async with running_gateway(small_config(), pipeline) as server:
        viewer = Transcript()
        async with aiohttp.ClientSession() as http:
            ws = await http.ws_connect(ws_url(server))
            await ws.send_json({"type": "session.start", "prompt": "p"})
            start = await read_until(ws, Transcript(), until="video.start")
            async with http.ws_connect(_watch_url(server, start)) as watcher:
                await read_until(watcher, viewer, until="video.chunk_metadata")
                for body in ({"type": "session.stop"}, {"type": "session.start", "prompt": "mine"},
                             {"type": "session.interaction", "interaction": {"event": {"prompt": "x"}}},
                             {"type": "session.start", "prompt": ""}):
                    await watcher.send_json(body)
                    error = await read_until(watcher, viewer, until="error")
                    assert error["code"] == "not_director" and error["fault"] == "client", error
                await watcher.send_str("not json")
                assert (await read_until(watcher, viewer, until="error"))["code"] == "invalid_json"
                await watcher.send_json({"type": "session.ping"})
                await read_until(watcher, viewer, until="session.pong")
                await ws.close()  # the director leaves
                done = await read_until(watcher, viewer, until="session.done")
                await read_until(watcher, viewer)
    assert done["stopped"] is True and viewer.close_code == 1000
    assert pipeline.records[0].cancelled and pipeline.records[0].updates == []


async def test_watching_an_unknown_session_is_404_and_auth_takes_a_viewer_token_that_cannot_start():
    auth = GatewayAuthConfig(enabled=True, tokens_env="T")
    access = Access(auth, [DIRECTOR_TOKEN], viewer_tokens=[VIEWER_TOKEN])
    pipeline = FakePipeline(FakeBehaviour(num_chunks=None, chunk_delay_s=0.05))
    async with running_gateway(small_config(auth=auth), pipeline, access=access) as server:
        async with aiohttp.ClientSession() as http:
            async with http.get(server.make_url("/v1/realtime/video/watch/nope"),
                                headers={"Authorization": f"Bearer {VIEWER_TOKEN}"}) as reply:
                assert reply.status == 404 and (await reply.json())["code"] == "unknown_session"
            async with http.get(server.make_url("/v1/realtime/video"),
                                params={"token": VIEWER_TOKEN}) as reply:
                assert reply.status == 403 and (await reply.json())["code"] == "not_director"
            ws = await http.ws_connect(ws_url(server), headers={"Authorization": f"Bearer {DIRECTOR_TOKEN}"})
            await ws.send_json({"type": "session.start", "prompt": "p"})
            start = await read_until(ws, Transcript(), until="video.start")
            path = start["watch_url"]
            async with http.get(server.make_url(path)) as reply:
                assert reply.status == 401 and (await reply.json())["code"] == "unauthorized"
            async with http.get(server.make_url(path), params={"token": "w" * 24}) as reply:
                assert reply.status == 401
            for token in (VIEWER_TOKEN, DIRECTOR_TOKEN):  # a director token may watch too
                url = str(server.make_url(path).with_query(token=token)).replace("http://", "ws://", 1)
                async with http.ws_connect(url) as watcher:
                    got = Transcript()
                    await read_until(watcher, got, until="video.chunk_metadata")
                    assert got.texts[0]["role"] == "viewer"
            await ws.close()


async def test_a_session_refuses_viewers_past_max_viewers_and_counts_them_in_metrics():
    pipeline = FakePipeline(FakeBehaviour(num_chunks=None, chunk_delay_s=0.05))
    config = small_config(broadcast={"max_viewers": 1})
    async with running_gateway(config, pipeline) as server:
        async with aiohttp.ClientSession() as http:
            ws = await http.ws_connect(ws_url(server))
            await ws.send_json({"type": "session.start", "prompt": "p"})
            start = await read_until(ws, Transcript(), until="video.start")
            async with http.ws_connect(_watch_url(server, start)) as watcher:
                await read_until(watcher, Transcript(), until="video.chunk_metadata")
                async with http.get(server.make_url(start["watch_url"])) as reply:
                    assert reply.status == 503 and (await reply.json())["code"] == "too_many_viewers"
                async with http.get(server.make_url("/metrics")) as reply:
                    text = await reply.text()
                assert "vitascope_viewers 1.0" in text
            await ws.close()


class _StuckWebSocket:
    """A viewer's websocket whose peer stopped reading: text goes out, a binary frame never finishes, nothing comes
    in; aborting its transport ends the pending receive."""

    closed = False

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.gone = asyncio.Event()

    async def send_str(self, text):
        self.texts.append(text)

    async def send_bytes(self, data):
        await self.gone.wait()
        raise ConnectionResetError("aborted")

    async def receive(self):
        await self.gone.wait()
        return aiohttp.WSMessage(aiohttp.WSMsgType.CLOSED, None, None)

    async def close(self, **_kwargs):
        self.closed = True


class _Transport:
    def __init__(self, ws: _StuckWebSocket) -> None:
        self._ws = ws
        self.aborted = False

    def abort(self):
        self.aborted = True
        self._ws.gone.set()


async def test_a_viewer_stuck_in_a_send_is_aborted_as_soon_as_it_falls_behind_too_often():
    chunks = fmp4_chunks(8)
    broadcast = Broadcast("s", GatewayBroadcastConfig(viewer_queue_chunks=1, viewer_max_skips=1), fps=24,
                          start={"type": "video.start", "request_id": "s"})
    ws = _StuckWebSocket()
    transport = _Transport(ws)
    metrics = GatewayMetrics(CollectorRegistry())
    connection = WatchConnection(ws, _WebSocketSink(ws, transport, timeout_s=60.0), broadcast.subscribe(),
                                 MessageLimits(100, 100, 100), metrics)
    serving = asyncio.ensure_future(connection.serve())
    for i, data in enumerate(chunks[:4]):  # chunk 0 goes out and sticks; 1 queued; 2 skips; 3 skips again: dropped
        broadcast.publish(chunk_metadata(i, data), data)
        await asyncio.sleep(0.01)
    await asyncio.wait_for(serving, 2)  # long before the 60 s send timeout
    assert transport.aborted and broadcast.num_viewers == 0
    assert metrics.viewers_dropped_total.labels(reason="too_slow")._value.get() == 1
    assert metrics.viewers_dropped_total.labels(reason="send_timeout")._value.get() == 0
    assert [json.loads(t)["type"] for t in ws.texts] == ["video.start", "video.init_segment"]
