"""LL-HLS and recordings on the real encoder, DiT, VAE and gateway processes (tiny preset, CPU).

The module's system records every session (`gateway.recordings_dir`). One session of two 5 s requests is read, while
it runs, by FFmpeg's hls demuxer (through PyAV), which must decode every frame the director got; its ended playlist
keeps the LL-HLS rules, and its segments are the director's bytes; its recording is a progressive MP4 with every
frame and every audio sample the director was sent.
"""
from __future__ import annotations

import asyncio
import json
import pathlib
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import av
import pytest
import yaml

from services.up import bring_up
from tests.gateway.test_hls import check_ll_hls_rules
from tools.ports import free_ports

pytestmark = [pytest.mark.cpu, pytest.mark.e2e]

REPO = pathlib.Path(__file__).resolve().parents[2]
SESSION_TIMEOUT_S = 180.0
TWO_REQUESTS = 124 + 119  # frames


@dataclass(frozen=True)
class System:
    http_url: str
    ws_url: str
    recordings: pathlib.Path


@pytest.fixture(scope="module")
def system(tmp_path_factory) -> System:
    tmp = tmp_path_factory.mktemp("hls")
    raw = yaml.safe_load((REPO / "configs" / "tiny_cpu.yaml").read_text())
    raw["profile"] = "tiny_cpu_hls"
    raw["model"]["dir"] = str(tmp / "checkpoint")
    raw["model"]["write_if_missing"] = True
    ports = iter(free_ports(4))
    raw["endpoints"] = {name: f"127.0.0.1:{next(ports)}" for name in ("encoder", "dit", "vae")}
    for stage in ("encoder", "dit", "vae"):
        raw[stage]["metrics_port"] = 0
    raw["gateway"].update(port=(port := next(ports)), recordings_dir=str(tmp / "recordings"))
    profile = tmp / "profile.yaml"
    profile.write_text(yaml.safe_dump(raw))
    supervisor = bring_up(profile)
    try:
        yield System(f"http://127.0.0.1:{port}", f"ws://127.0.0.1:{port}/v1/realtime/video", tmp / "recordings")
    finally:
        supervisor.stop_all()


@dataclass
class Director:
    """What the director's websocket got."""

    start: dict[str, Any] = field(default_factory=dict)
    metas: list[dict[str, Any]] = field(default_factory=list)
    binaries: list[bytes] = field(default_factory=list)
    done: dict[str, Any] | None = None
    second_request: threading.Event = field(default_factory=threading.Event)
    """Set at the first chunk of request 1: request 0 is then a whole segment of the playlist."""


async def _direct(system: System, director: Director) -> None:
    async with aiohttp.ClientSession() as http, http.ws_connect(system.ws_url, max_msg_size=0) as ws:
        await ws.send_str(json.dumps({"type": "session.start", "prompt": "a lighthouse at dusk",
                                      "num_frames": TWO_REQUESTS}))
        async for msg in ws:
            if msg.type == aiohttp.WSMsgType.BINARY:
                director.binaries.append(msg.data)
                if director.metas[-1]["request_index"] == 1:
                    director.second_request.set()
                continue
            if msg.type != aiohttp.WSMsgType.TEXT:
                break
            body = json.loads(msg.data)
            if body["type"] == "video.start":
                director.start = body
            elif body["type"] == "video.chunk_metadata":
                director.metas.append(body)
            elif body["type"] == "session.done":
                director.done = body
            elif body["type"] == "error":
                raise AssertionError(f"the session failed: {body}")


def _read_hls(url: str) -> tuple[int, int, float]:
    """(video frames, audio samples) FFmpeg's hls demuxer decodes from the playlist at `url`, and when it opened."""
    container = av.open(url, options={"live_start_index": "0"}, timeout=60)
    opened = time.monotonic()
    frames = samples = 0
    for frame in container.decode():
        if isinstance(frame, av.VideoFrame):
            frames += 1
        else:
            samples += frame.samples
    container.close()
    return frames, samples, opened


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as reply:
        return reply.read()


async def test_a_live_session_reads_over_ll_hls_and_is_recorded_whole(system: System):
    director = Director()
    directing = asyncio.ensure_future(asyncio.wait_for(_direct(system, director), SESSION_TIMEOUT_S))
    second = asyncio.to_thread(director.second_request.wait, SESSION_TIMEOUT_S)
    await asyncio.wait({directing, asyncio.ensure_future(second)}, return_when=asyncio.FIRST_COMPLETED)
    assert director.second_request.is_set() and not directing.done(), "the session ended before request 1"
    playlist_url = system.http_url + director.start["hls_url"]
    frames, samples, opened = await asyncio.to_thread(_read_hls, playlist_url)
    await directing
    assert director.done is not None and director.done["stopped"] is False
    ended = time.monotonic()
    assert opened < ended, "the demuxer opened the playlist only after the session ended"

    sent_frames = sum(m["num_frames"] for m in director.metas)
    fed = sum(m["num_audio_samples"] for m in director.metas)
    assert frames == sent_frames >= TWO_REQUESTS
    assert fed - 3 * 1024 <= samples < fed + 1024  # the demuxer ends its audio within an AAC frame or so of `fed`

    text = _get(playlist_url).decode()
    check_ll_hls_rules(text)
    assert text.count("#EXTINF") == 2 and text.endswith("#EXT-X-ENDLIST\n")
    base = playlist_url.rsplit("/", 1)[0]
    by_request: dict[int, bytes] = {}
    for index, (meta, data) in enumerate(zip(director.metas, director.binaries)):
        request = 1 if meta["kind"] == "trailer" else meta["request_index"]  # the trailer joins the last one
        if index == 0:
            assert _get(f"{base}/init.mp4") == data[: len(data) - len(_get(f"{base}/part/0.m4s"))]
            data = _get(f"{base}/part/0.m4s")
        by_request[request] = by_request.get(request, b"") + data
    for request, data in by_request.items():
        assert _get(f"{base}/seg/{request}.m4s") == data, f"segment {request}"

    listing = json.loads(_get(system.http_url + "/v1/recordings"))["recordings"]
    deadline = time.monotonic() + 30
    while not listing and time.monotonic() < deadline:  # finalized on the gateway's worker thread
        await asyncio.sleep(0.2)
        listing = json.loads(_get(system.http_url + "/v1/recordings"))["recordings"]
    (entry,) = [r for r in listing if r["name"] == f"{director.start['request_id']}.mp4"]
    recording = system.recordings / entry["name"]
    assert _get(system.http_url + entry["url"]) == recording.read_bytes()
    with av.open(str(recording)) as container:
        assert container.streams.video[0].frames == sent_frames
        shown = sum(p.duration for p in container.demux(audio=0) if p.size and p.pts >= 0)
    assert shown == fed  # the edit list plays exactly the samples the session fed the encoder
    assert entry["duration_s"] == pytest.approx(max(sent_frames / 24, fed / 32000), abs=1e-3)
