"""One live session, many viewers, on the real encoder, DiT, VAE and gateway processes (tiny preset, CPU).

The module's system runs with gateway auth on (a director token and a viewer token) and small viewer queues (2
chunks, 1 skip), so a viewer that reads nothing is dropped within a few chunks. A session of two 5 s requests is
watched by two viewers that join mid-stream and by one that never reads.
"""
from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import pathlib
import re
import socket
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import av
import pytest
import yaml

from services.up import bring_up
from tools.ports import free_ports

pytestmark = [pytest.mark.cpu, pytest.mark.e2e]

REPO = pathlib.Path(__file__).resolve().parents[2]
DIRECTOR_TOKEN = "director-token-0123456789"
VIEWER_TOKEN = "viewer-token-0123456789ab"
SESSION_TIMEOUT_S = 150.0
TWO_REQUESTS = 124 + 119  # frames


@dataclass(frozen=True)
class System:
    port: int
    http_url: str
    ws_url: str


@pytest.fixture(scope="module")
def system(tmp_path_factory) -> System:
    tmp = tmp_path_factory.mktemp("broadcast")
    raw = yaml.safe_load((REPO / "configs" / "tiny_cpu.yaml").read_text())
    raw["profile"] = "tiny_cpu_broadcast"
    raw["model"]["dir"] = str(tmp / "checkpoint")
    raw["model"]["write_if_missing"] = True
    ports = iter(free_ports(4))
    raw["endpoints"] = {name: f"127.0.0.1:{next(ports)}" for name in ("encoder", "dit", "vae")}
    for stage in ("encoder", "dit", "vae"):
        raw[stage]["metrics_port"] = 0
    (tmp / "directors").write_text(DIRECTOR_TOKEN + "\n")
    (tmp / "viewers").write_text(VIEWER_TOKEN + "\n")
    raw["gateway"].update(port=(port := next(ports)), auth={
        "enabled": True, "tokens_file": str(tmp / "directors"), "viewer_tokens_file": str(tmp / "viewers")},
        broadcast={"viewer_queue_chunks": 2, "viewer_max_skips": 1})
    profile = tmp / "profile.yaml"
    profile.write_text(yaml.safe_dump(raw))
    supervisor = bring_up(profile)
    try:
        yield System(port, f"http://127.0.0.1:{port}", f"ws://127.0.0.1:{port}")
    finally:
        supervisor.stop_all()


@dataclass
class Stream:
    """What one websocket received."""

    texts: list[dict[str, Any]] = field(default_factory=list)
    binaries: list[bytes] = field(default_factory=list)
    close_code: int | None = None

    def of_type(self, kind: str) -> list[dict[str, Any]]:
        return [m for m in self.texts if m["type"] == kind]

    @property
    def metas(self) -> list[dict[str, Any]]:
        return self.of_type("video.chunk_metadata")


async def _read(ws: aiohttp.ClientWebSocketResponse, out: Stream, *, until: str = "session.done",
                on_binary=None) -> dict[str, Any] | None:
    """Read into `out` until a text message of type `until` (returned) or the close."""
    async def pump() -> dict[str, Any] | None:
        while True:
            msg = await ws.receive()
            if msg.type == aiohttp.WSMsgType.TEXT:
                out.texts.append(body := json.loads(msg.data))
                if body["type"] == until:
                    return body
            elif msg.type == aiohttp.WSMsgType.BINARY:
                out.binaries.append(msg.data)
                if on_binary is not None:
                    await on_binary(len(out.binaries))
            else:
                out.close_code = ws.close_code
                return None
    return await asyncio.wait_for(pump(), SESSION_TIMEOUT_S)


async def _watch(http: aiohttp.ClientSession, system: System, path: str, out: Stream) -> None:
    async with http.ws_connect(system.ws_url + path, headers={"Authorization": f"Bearer {VIEWER_TOKEN}"},
                               max_msg_size=0) as ws:
        await _read(ws, out)
        await _read(ws, out, until="-")  # the close after session.done


def _stuck_viewer(system: System, path: str) -> socket.socket:
    """A viewer that completes the websocket handshake, then reads nothing (a 4 KiB receive buffer)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", system.port))
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall((f"GET {path}?token={VIEWER_TOKEN} HTTP/1.1\r\nHost: 127.0.0.1:{system.port}\r\n"
                  f"Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                  "Sec-WebSocket-Version: 13\r\n\r\n").encode())
    reply = b""
    while b"\r\n\r\n" not in reply:
        reply += sock.recv(1)
    assert reply.startswith(b"HTTP/1.1 101"), reply
    return sock


def _metric(system: System, name: str, labels: str = "") -> float:
    with urllib.request.urlopen(system.http_url + "/metrics", timeout=5) as reply:
        text = reply.read().decode()
    match = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def _decode(data: bytes) -> tuple[list[av.VideoFrame], int]:
    """The video frames and the audio sample count of an fMP4 stream."""
    with av.open(io.BytesIO(data)) as container:
        video = list(container.decode(video=0))
    with av.open(io.BytesIO(data)) as container:
        samples = sum(f.samples for f in container.decode(audio=0))
    return video, samples


START = {"type": "session.start", "prompt": "a lighthouse in a storm", "seed": 11, "num_frames": TWO_REQUESTS}


async def _direct_alone(system: System) -> Stream:
    """The same session with no viewer at all."""
    out = Stream()
    async with aiohttp.ClientSession() as http, http.ws_connect(
            system.ws_url + "/v1/realtime/video", max_msg_size=0,
            headers={"Authorization": f"Bearer {DIRECTOR_TOKEN}"}) as ws:
        await ws.send_str(json.dumps(START))
        await _read(ws, out)
    return out


async def test_late_viewers_get_the_director_bytes_from_a_keyframe_and_a_stuck_viewer_changes_nothing(system):
    director, early, late = Stream(), Stream(), Stream()
    stuck: list[socket.socket] = []
    watchers: list[asyncio.Future] = []
    async with aiohttp.ClientSession() as http:
        ws = await http.ws_connect(system.ws_url + "/v1/realtime/video", max_msg_size=0,
                                   headers={"Authorization": f"Bearer {DIRECTOR_TOKEN}"})
        await ws.send_str(json.dumps(START))
        start = await _read(ws, director, until="video.start")
        stuck.append(_stuck_viewer(system, start["watch_url"]))

        async def join(count: int) -> None:
            if count in (3, 7):
                watchers.append(asyncio.ensure_future(_watch(http, system, start["watch_url"],
                                                             early if count == 3 else late)))

        done = await _read(ws, director, on_binary=join)
        await asyncio.wait_for(asyncio.gather(*watchers), 30)
        await ws.close()
    dropped = _metric(system, "vitascope_viewers_dropped_total", '{reason="too_slow"}')
    stuck[0].close()

    assert done == {"type": "session.done", "request_id": start["request_id"], "chunks": len(director.metas),
                    "stopped": False}
    assert [m["transport_chunk_index"] for m in director.metas] == list(range(len(director.metas)))
    assert [len(b) for b in director.binaries] == [m["byte_length"] for m in director.metas]
    frames, samples = _decode(b"".join(director.binaries))
    assert len(frames) == TWO_REQUESTS and samples > 0  # the director's stream is whole

    for viewer in (early, late):
        assert viewer.texts[0] == {**start, "role": "viewer"} and viewer.texts[1]["type"] == "video.init_segment"
        init = viewer.binaries[0]
        assert director.binaries[0].startswith(init) and len(init) == viewer.texts[1]["byte_length"]
        first = viewer.metas[0]["transport_chunk_index"]
        assert first > 0 and [m["transport_chunk_index"] for m in viewer.metas] == list(
            range(first, len(director.metas)))
        assert viewer.binaries[1:] == director.binaries[first:]  # byte-identical from its first chunk on
        frames, samples = _decode(b"".join(viewer.binaries))
        assert frames[0].key_frame and samples > 0
        assert len(frames) == sum(m["num_frames"] for m in director.metas[first:])
        assert viewer.of_type("session.done")[0]["chunks"] == len(viewer.metas) and viewer.close_code == 1000
    assert early.metas[0]["transport_chunk_index"] < late.metas[0]["transport_chunk_index"]
    assert dropped >= 1, "the viewer that reads nothing was not dropped"
    alone = await _direct_alone(system)
    assert alone.binaries == director.binaries, "the viewers changed the director's stream"


async def test_a_viewer_needs_its_token_and_may_only_ping(system):
    async with aiohttp.ClientSession() as http:
        ws = await http.ws_connect(system.ws_url + "/v1/realtime/video",
                                   headers={"Authorization": f"Bearer {DIRECTOR_TOKEN}"})
        await ws.send_str(json.dumps({"type": "session.start", "prompt": "a quiet harbour"}))
        start = await _read(ws, Stream(), until="video.start")
        async with http.get(system.http_url + start["watch_url"]) as reply:
            assert reply.status == 401 and (await reply.json())["code"] == "unauthorized"
        async with http.get(system.http_url + "/v1/realtime/video", params={"token": VIEWER_TOKEN}) as reply:
            assert reply.status == 403 and (await reply.json())["code"] == "not_director"
        async with http.get(system.http_url + "/v1/realtime/video/watch/video_stream-none",
                            params={"token": VIEWER_TOKEN}) as reply:
            assert reply.status == 404 and (await reply.json())["code"] == "unknown_session"
        viewer = Stream()
        async with http.ws_connect(system.ws_url + start["watch_url"], params={"token": VIEWER_TOKEN},
                                   max_msg_size=0) as watcher:
            for body in ({"type": "session.stop"},
                         {"type": "session.interaction", "interaction": {"event": {"prompt": "a ship"}}}):
                await watcher.send_str(json.dumps(body))
                error = await _read(watcher, viewer, until="error")
                assert error["code"] == "not_director" and error["request_id"] == start["request_id"]
            await watcher.send_str(json.dumps({"type": "session.ping"}))
            await _read(watcher, viewer, until="session.pong")
            await _read(watcher, viewer, until="video.chunk_metadata")  # still streaming
            await ws.send_str(json.dumps({"type": "session.stop"}))
            done = await _read(watcher, viewer)
            await _read(watcher, viewer, until="-")
        await ws.close()
    assert done["stopped"] is True and viewer.close_code == 1000
    assert not [m for m in viewer.texts if m["type"] == "error" and m["code"] != "not_director"]
