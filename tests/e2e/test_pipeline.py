"""End to end on the CPU: the real encoder, DiT, VAE and gateway processes on the tiny preset.

One module-scoped fixture brings the four services up with `services.up.bring_up` on a temporary copy of
`configs/tiny_cpu.yaml` (own free ports, own checkpoint directory) and stops them at the end. Sessions are
driven through the real client library (`services.client.stream`) or raw aiohttp websockets where a test
needs every message. Chunks of the tiny preset at 24 fps: request 0 = 39 + 34 + 34 + 17 = 124 frames, every
later request = 34 + 34 + 34 + 17 = 119 frames.
"""
from __future__ import annotations

import asyncio
import io
import json
import pathlib
import re
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import av
import pytest
import yaml

from services.client import ClientOptions, stream
from services.up import SERVICES, bring_up
from tools.ports import free_ports

pytestmark = [pytest.mark.cpu, pytest.mark.e2e]

REPO = pathlib.Path(__file__).resolve().parents[2]
FPS = 24
SAMPLE_RATE = 32000
AAC_FRAME_SAMPLES = 1024
AUDIO_LATENT_HOP = 800  # samples per audio latent step: per-chunk audio counts are multiples of it
# frames per chunk: the session's first phase in three chunks (its first 5 frames, the rest of its first clip, the
# rest); every phase's last 5 frames wait for the next phase, which cross-fades them (the trailer has the last 5)
FIRST_TWO_REQUESTS = [5, 12, 17, 34, 34, 17, 34, 34, 34, 17]
FIRST_TWO_PHASES = [(0, 0), (0, 0), (0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2), (1, 3)]
DIT_ONLY_CANVAS = (320, 224)  # the gateway allows it in this profile, the DiT's short edges (192, 256) do not
SESSION_TIMEOUT_S = 150.0


@dataclass(frozen=True)
class System:
    ws_url: str
    http_url: str
    dit_metrics_url: str
    max_prompt_chars: int
    profile: pathlib.Path


@pytest.fixture(scope="module")
def system(tmp_path_factory) -> System:
    """The four real services on free ports; stopped when the module ends."""
    tmp = tmp_path_factory.mktemp("e2e")
    raw = yaml.safe_load((REPO / "configs" / "tiny_cpu.yaml").read_text())
    raw["profile"] = "tiny_cpu_e2e"
    raw["model"]["dir"] = str(tmp / "checkpoint")
    raw["model"]["write_if_missing"] = True
    ports = iter(free_ports(5))
    raw["endpoints"] = {name: f"127.0.0.1:{next(ports)}" for name in ("encoder", "dit", "vae")}
    dit_metrics = next(ports)
    raw["encoder"]["metrics_port"] = 0
    raw["vae"]["metrics_port"] = 0
    raw["dit"]["metrics_port"] = dit_metrics
    raw["gateway"]["port"] = port = next(ports)
    raw["gateway"]["allowed_canvases"] = [*raw["gateway"]["allowed_canvases"], list(DIT_ONLY_CANVAS)]
    profile = tmp / "profile.yaml"
    profile.write_text(yaml.safe_dump(raw))
    supervisor = bring_up(profile)
    procs = [supervisor.process(name) for name in SERVICES]
    try:
        yield System(ws_url=f"ws://127.0.0.1:{port}/v1/realtime/video", http_url=f"http://127.0.0.1:{port}",
                     dit_metrics_url=f"http://127.0.0.1:{dit_metrics}/metrics",
                     max_prompt_chars=int(raw["gateway"].get("max_prompt_chars", 2000)), profile=profile)
    finally:
        supervisor.stop_all()
    assert all(p.returncode is not None for p in procs)


# ---------------------------------------------------------------- helpers

def _healthz(system: System) -> dict[str, Any]:
    with urllib.request.urlopen(system.http_url + "/healthz", timeout=5) as reply:
        return json.loads(reply.read())


def _dit_active_sessions(system: System) -> float:
    with urllib.request.urlopen(system.dit_metrics_url, timeout=5) as reply:
        text = reply.read().decode()
    match = re.search(r"^vitascope_active_sessions\s+(\S+)$", text, re.MULTILINE)
    assert match is not None, "the DiT does not export vitascope_active_sessions"
    return float(match.group(1))


def _wait_idle(system: System, timeout_s: float = 30.0) -> None:
    """Wait until the gateway and the DiT both report no session; fail with what they last said."""
    deadline = time.monotonic() + timeout_s
    while True:
        health, dit = _healthz(system), _dit_active_sessions(system)
        if health["sessions_active"] == 0 and health["sessions_queued"] == 0 and dit == 0:
            assert health["ok"] is True
            return
        if time.monotonic() > deadline:
            pytest.fail(f"not idle after {timeout_s:.0f} s: healthz={health}, dit active sessions={dit}")
        time.sleep(0.2)


@dataclass
class RawSession:
    """Everything one raw websocket session received."""

    texts: list[dict[str, Any]] = field(default_factory=list)
    metas: list[dict[str, Any]] = field(default_factory=list)
    data: bytearray = field(default_factory=bytearray)
    close_code: int | None = None

    def of_type(self, kind: str) -> list[dict[str, Any]]:
        return [m for m in self.texts if m["type"] == kind]


async def _raw_session(url: str, start: dict[str, Any], *, on_video_start=(), stop_after: int | None = None,
                       on_chunk=None) -> RawSession:
    """Send `start`, then the messages in `on_video_start` after video.start; send session.stop after
    `stop_after` binary frames; `on_chunk(ws, index)` runs after every binary frame. Ends at session.done,
    at the server's close, or when the timeout fires."""
    out = RawSession()
    async with aiohttp.ClientSession() as http, http.ws_connect(url, max_msg_size=0) as ws:
        await ws.send_str(json.dumps(start))

        async def read() -> None:
            while True:
                msg = await ws.receive()
                if msg.type == aiohttp.WSMsgType.CLOSE:
                    out.close_code = msg.data  # the code the server sent, whatever became of the handshake
                    return
                if msg.type in (aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.CLOSING, aiohttp.WSMsgType.ERROR):
                    return
                if msg.type == aiohttp.WSMsgType.TEXT:
                    message = json.loads(msg.data)
                    out.texts.append(message)
                    if message["type"] == "video.chunk_metadata":
                        out.metas.append(message)
                    elif message["type"] == "video.start":
                        for body in on_video_start:
                            await ws.send_str(json.dumps(body))
                    elif message["type"] == "session.done":
                        return
                elif msg.type == aiohttp.WSMsgType.BINARY:
                    assert len(msg.data) == out.metas[-1]["byte_length"]
                    out.data.extend(msg.data)
                    count = len(out.metas)
                    if on_chunk is not None:
                        await on_chunk(ws, count - 1)
                    if stop_after is not None and count == stop_after:
                        await ws.send_str(json.dumps({"type": "session.stop"}))

        await asyncio.wait_for(read(), SESSION_TIMEOUT_S)
        if out.close_code is None and not ws.closed:  # the gateway closes after session.done
            msg = await asyncio.wait_for(ws.receive(), 10)
            if msg.type == aiohttp.WSMsgType.CLOSE:
                out.close_code = msg.data
    return out


def _decode(data: bytes) -> tuple[list[av.VideoFrame], list[av.AudioFrame]]:
    with av.open(io.BytesIO(data)) as container:
        video = list(container.decode(video=0))
    with av.open(io.BytesIO(data)) as container:
        audio = list(container.decode(audio=0))
    return video, audio


# ---------------------------------------------------------------- the main session: 2 requests, an update, stop

UPDATE_ID = "e2e-update-1"
LATE_UPDATE_ID = "e2e-update-2"


@pytest.fixture(scope="module")
def main_session(system: System) -> RawSession:
    """Two requests and the first chunk of a third (11 chunks: the first phase comes as three): a prompt update sent
    right after video.start, i.e. during request 0; a second update right after the 6th chunk (the last of request
    0); a ping during request 1; session.stop after the 11th chunk.

    The first update goes out before the first chunk because the gateway forwards it as soon as the DiT session
    has started, long before the DiT finishes request 0. The second one reaches the DiT while it works on
    request 1 at the latest: flow control keeps it at most `dit.max_phases_ahead` (2) phases ahead of the
    chunks the gateway has received, so it lands at request 2 (chunk 10), not later."""
    async def ping_and_update(ws, index: int) -> None:
        if index == 5:
            await ws.send_str(json.dumps(late_update))
        if index == 7:
            await ws.send_str(json.dumps({"type": "session.ping"}))

    start = {"type": "session.start", "prompt": "a lake at dawn", "seed": 7, "width": 320, "height": 192,
             "format": "m4s"}
    update = {"type": "session.interaction",
              "interaction": {"event_id": UPDATE_ID, "event": {"prompt": "a storm rolls in over the lake"}}}
    late_update = {"type": "session.interaction",
                   "interaction": {"event_id": LATE_UPDATE_ID, "event": {"prompt": "the lake freezes over"}}}
    return asyncio.run(_raw_session(system.ws_url, start, on_video_start=[update], stop_after=11,
                                    on_chunk=ping_and_update))


def _media(session: RawSession) -> list[dict[str, Any]]:
    return [m for m in session.metas if m["kind"] == "media"]


def test_stream_decodes_to_the_announced_frames_samples_and_duration(main_session):
    # session.stop: the chunks in flight still come, then the muxer's closing bytes as a trailer chunk.
    kinds = [m["kind"] for m in main_session.metas]
    assert kinds == ["media"] * (len(kinds) - 1) + ["trailer"]
    trailer = main_session.metas[-1]
    # the decoder's held-back last 5 frames, the audio held back with them and the muxer's closing bytes
    assert trailer["num_frames"] == 5 and trailer["byte_length"] > 0
    assert abs(trailer["num_audio_samples"] - 5 * SAMPLE_RATE / FPS) < AUDIO_LATENT_HOP
    metas = _media(main_session)
    assert len(metas) >= 11
    assert [m["num_frames"] for m in metas[:10]] == FIRST_TWO_REQUESTS
    assert [(m["request_index"], m["phase_index"]) for m in metas[:10]] == FIRST_TWO_PHASES
    assert [m["transport_chunk_index"] for m in metas] == list(range(len(metas)))
    assert [m["generation_chunk_index"] for m in metas[:10]] == [0, 0, 0, 1, 2, 3, 4, 5, 6, 7]  # one per phase
    assert all(m["audio_sample_rate"] == SAMPLE_RATE for m in metas)
    frames = sum(m["num_frames"] for m in main_session.metas)  # the trailer's held-back frames too
    fed = sum(m["num_audio_samples"] for m in main_session.metas)  # the trailer's held-back audio too
    assert abs(fed - frames * SAMPLE_RATE / FPS) < AUDIO_LATENT_HOP  # the DiT keeps audio with video

    video, audio = _decode(bytes(main_session.data))
    assert len(video) == frames
    assert (video[0].width, video[0].height) == (320, 192)
    assert [f.time for f in video] == pytest.approx([i / FPS for i in range(frames)])  # monotonic, no gaps
    starts = [sum(m["num_frames"] for m in main_session.metas[:i]) for i in range(len(main_session.metas))]
    assert [i for i, f in enumerate(video) if f.key_frame] == starts  # every chunk starts with a keyframe

    assert audio[0].pts == 0 and audio[0].sample_rate == SAMPLE_RATE and audio[0].layout.nb_channels == 2
    assert all(b.pts - a.pts == a.samples for a, b in zip(audio, audio[1:]))  # contiguous, monotonic
    decoded = sum(f.samples for f in audio)
    # Even though the session ended with session.stop, the trailer carried what the AAC encoder still held:
    # every fed sample is there; the last AAC frame is padded to 1024 samples.
    assert fed <= decoded < fed + AAC_FRAME_SAMPLES
    assert abs(decoded / SAMPLE_RATE - frames / FPS) < (AUDIO_LATENT_HOP + AAC_FRAME_SAMPLES) / SAMPLE_RATE


def test_prompt_update_is_acked_and_applied_at_the_next_request(main_session):
    texts, metas = main_session.texts, _media(main_session)
    acks = [m for m in texts if m["type"] == "session.interaction.queued"]
    assert [a["event_id"] for a in acks] == [UPDATE_ID, LATE_UPDATE_ID]
    assert not main_session.of_type("error")
    ack_at = texts.index(acks[0])
    first_of_request_1 = metas[6]
    assert (first_of_request_1["request_index"], first_of_request_1["phase_index"]) == (1, 0)
    assert texts.index(first_of_request_1) > ack_at  # acknowledged before it took effect
    for m in metas[:6]:
        # the first prompt has no event id: no list holds an empty one
        assert m["started_event_ids"] == m["active_event_ids"] == m["completed_event_ids"] == []
    assert UPDATE_ID in first_of_request_1["completed_event_ids"]
    assert UPDATE_ID in first_of_request_1["started_event_ids"]
    for m in metas[6:10]:
        assert m["active_event_ids"] == [UPDATE_ID]
    for m in metas[7:]:
        assert UPDATE_ID not in m["completed_event_ids"]  # completed once, at its boundary


def test_update_sent_after_chunk_6_is_applied_at_chunk_10(main_session):
    """Flow control: the DiT runs at most two phases ahead of the chunks the gateway received, so an update
    sent after the last chunk of request 0 lands at the first chunk of request 2, not a request later."""
    texts, metas = main_session.texts, _media(main_session)
    ack = next(m for m in texts if m.get("event_id") == LATE_UPDATE_ID)
    assert ack["type"] == "session.interaction.queued"
    assert texts.index(ack) > texts.index(metas[5])
    applied = [i for i, m in enumerate(metas) if LATE_UPDATE_ID in m["completed_event_ids"]]
    assert applied == [10]
    assert (metas[10]["request_index"], metas[10]["phase_index"]) == (2, 0)
    assert metas[10]["active_event_ids"] == [LATE_UPDATE_ID]


def test_stop_ends_with_session_done_stopped(main_session):
    texts = main_session.texts
    done = main_session.of_type("session.done")
    assert len(done) == 1 and texts[-1] is done[0]
    assert done[0]["stopped"] is True
    assert done[0]["chunks"] == len(main_session.metas)
    assert main_session.of_type("session.pong")  # the ping during request 1 was answered
    assert main_session.close_code == aiohttp.WSCloseCode.OK


# ---------------------------------------------------------------- disconnect, queueing, bad input

def test_client_disconnect_frees_the_dit_session(system):
    _wait_idle(system)
    seen: dict[str, Any] = {}

    async def disconnect_after_first_chunk() -> None:
        async with aiohttp.ClientSession() as http:
            ws = await http.ws_connect(system.ws_url, max_msg_size=0)
            await ws.send_str(json.dumps({"type": "session.start", "prompt": "a red kite", "width": 320,
                                          "height": 192}))
            async for msg in ws:
                if msg.type == aiohttp.WSMsgType.BINARY:
                    break
            seen["health"] = await asyncio.to_thread(_healthz, system)
            seen["dit"] = await asyncio.to_thread(_dit_active_sessions, system)
            # Leave without session.stop or a close frame: drop the TCP connection under the websocket.
            ws._conn.transport.abort()

    asyncio.run(asyncio.wait_for(disconnect_after_first_chunk(), SESSION_TIMEOUT_S))
    assert seen["health"]["sessions_active"] == 1 and seen["dit"] == 1  # the session was really running
    _wait_idle(system)

    result = asyncio.run(stream(ClientOptions(url=system.ws_url, prompt="a second kite", seconds=1.0,
                                              width=320, height=192)))
    assert result.done["stopped"] is True and result.errors == []
    assert len(result.chunks) >= 1 and result.chunks[0].num_frames == 5  # a session's first fragment


def test_second_client_waits_in_the_queue_then_runs(system):
    _wait_idle(system)
    ended: dict[str, float] = {}

    async def first() -> Any:
        result = await stream(ClientOptions(url=system.ws_url, prompt="first in line", seconds=2.0,
                                            width=320, height=192))
        ended["first"] = time.monotonic()
        return result

    async def second() -> Any:
        while (await asyncio.to_thread(_healthz, system))["sessions_active"] == 0:
            await asyncio.sleep(0.05)
        started = time.monotonic()
        result = await stream(ClientOptions(url=system.ws_url, prompt="second in line", seconds=1.0,
                                            width=320, height=192))
        return started, result

    async def both():
        return await asyncio.wait_for(asyncio.gather(first(), second()), SESSION_TIMEOUT_S)

    a, (b_started, b) = asyncio.run(both())
    assert a.queue_positions == [] and len(a.chunks) >= 2 and a.done["stopped"] is True
    assert b.queue_positions[:1] == [1]
    assert b.errors == [] and b.done["stopped"] is True
    assert len(b.chunks) >= 1 and b.chunks[0].num_frames == 5
    assert b_started + b.time_to_first_chunk_s > ended["first"]  # it ran only after the first ended
    _wait_idle(system)


def test_prompt_over_the_encoder_token_limit_is_rejected_and_the_server_stays_healthy(system):
    _wait_idle(system)
    prompt = "word " * 300  # ≈ 900 tokens > encoder.max_tokens = 256, but 1500 chars < the gateway's limit
    assert len(prompt) < system.max_prompt_chars
    got = asyncio.run(_raw_session(system.ws_url, {"type": "session.start", "prompt": prompt, "width": 320,
                                                   "height": 192}))
    errors = got.of_type("error")
    assert len(errors) == 1 and errors[0]["code"] == "invalid_request"
    assert "max_tokens=256" in errors[0]["message"]
    assert got.metas == [] and not got.of_type("session.done")
    _wait_idle(system)

    # The same prompt as an update: only the update fails, the session goes on.
    bad = {"type": "session.interaction", "interaction": {"event_id": "too-long", "event": {"prompt": prompt}}}
    got = asyncio.run(_raw_session(system.ws_url, {"type": "session.start", "prompt": "a calm sea",
                                                   "width": 320, "height": 192},
                                   on_video_start=[bad], stop_after=2))
    errors = got.of_type("error")
    assert [(e["code"], e.get("event_id")) for e in errors] == [("interaction_failed", "too-long")]
    assert not got.of_type("session.interaction.queued")
    assert len(got.metas) >= 2 and got.of_type("session.done")[0]["stopped"] is True
    _wait_idle(system)


def test_canvas_the_gateway_allows_but_the_dit_rejects(system):
    _wait_idle(system)
    width, height = DIT_ONLY_CANVAS
    got = asyncio.run(_raw_session(system.ws_url, {"type": "session.start", "prompt": "a narrow lake",
                                                   "width": width, "height": height}))
    errors = got.of_type("error")
    assert len(errors) == 1 and errors[0]["code"] == "invalid_request"
    assert f"{width}x{height}" in errors[0]["message"]
    assert got.metas == []
    _wait_idle(system)
    result = asyncio.run(stream(ClientOptions(url=system.ws_url, prompt="a wide lake", seconds=1.0,
                                              width=320, height=192)))
    assert result.errors == [] and len(result.chunks) >= 1


def test_dit_session_cancelled_after_its_last_check_is_released(system):
    """Regression: a cancel that lands inside the KV commit (which now runs at the start of the next phase) used
    to leave the runtime holding the session, so every later DiT open failed with NoCapacity."""
    import torch

    from services.common.config import load_profile
    from services.dit.api import PromptUpdate, SessionConfig
    from services.dit.api import SessionCancelled
    from services.dit.service import DiTService

    service = DiTService(load_profile(system.profile))
    service.start()
    text = PromptUpdate(torch.zeros(8, service.runtime.model.args.text_dim))
    session = service.open(SessionConfig(seed=0, width=320, height=192), text, None)
    session.next_phase()  # its commit runs first in the next phase
    commit = session.kv.commit

    def cancel_then_commit() -> None:  # the client's cancel arrives during the phase's final forward
        session.cancel()
        commit()

    session.kv.commit = cancel_then_commit
    with pytest.raises(SessionCancelled):  # the runtime itself releases the session (services/dit/stream/runtime.py)
        session.next_phase()
    assert service.runtime.active_session is None
    service.open(SessionConfig(seed=1, width=320, height=192), text, None).close()  # the group is free again
