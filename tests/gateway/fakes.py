"""Test doubles for the gateway: a fake Pipeline that streams REAL fragmented MP4, and a server helper.

The fake uses the shared `services.vae.mux.FragmentedMP4Muxer`, so browsers and PyAV can play
what it produces. Frames are a moving bar whose colour follows the current prompt; audio is a
tone. Prompt updates are installed at the next chunk boundary and reported in the chunk's
`completed_event_ids`, as the real backend does. A request is 4 chunks; with `request.hold.enabled`, request k >= 1
waits for a prompt update newer than the last installed one (forever, or `hold.max_seconds`, then the fallback
prompt if any), as the DiT does.
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
import numpy as np
from aiohttp.test_utils import TestServer
from prometheus_client import CollectorRegistry

from services.common.media import AUDIO_SAMPLE_RATE as SAMPLE_RATE
from services.common.config import GatewayConfig
from services.gateway.access import Access
from services.gateway.pipeline import (
    BackendBusy,
    InvalidRequest,
    MediaChunk,
    Pipeline,
    PipelineError,
    PipelineSession,
    SessionRequest,
    StageTimings,
)
from services.gateway.ws import create_app
from services.vae.mux import FragmentedMP4Muxer



@dataclass
class FakeBehaviour:
    """Knobs of the fake backend."""

    frames_per_chunk: int = 6
    num_chunks: int | None = 4
    """Chunks per session; None streams until cancelled."""
    chunk_delay_s: float = 0.0
    """Sleep before each chunk (simulated generation time)."""
    cancel_delay_s: float = 0.0
    start_error: PipelineError | None = None
    reject_prompts: frozenset[str] = frozenset()
    """Prompt updates with these texts raise InvalidRequest."""
    stall_after: int | None = None
    """Hang forever after this many chunks (to exercise the stall timeout)."""
    healthy: bool = True
    release_delay_s: float = 0.0
    """After a session's cancel returns, the backend stays busy this long (a DiT group releases its session only
    at its next check between forwards): a start meanwhile raises BackendBusy."""


@dataclass
class FakeRecord:
    """What happened to one fake session."""

    request: SessionRequest
    updates: list[tuple[str, str]] = field(default_factory=list)
    chunks: int = 0
    cancelled: bool = False
    closed: bool = False
    holds: list[int] = field(default_factory=list)
    """Request indexes at which the session held for a prompt (found none pending at the boundary)."""


class FakePipelineSession(PipelineSession):
    def __init__(self, behaviour: FakeBehaviour, record: FakeRecord, pipeline: "FakePipeline") -> None:
        self._b = behaviour
        self._pipeline = pipeline
        self.record = record
        req = record.request
        self._muxer = FragmentedMP4Muxer(req.width, req.height, fps=req.fps, sample_rate=SAMPLE_RATE)
        self._pending: list[tuple[str, str]] = []
        self._prompt = req.prompt
        self._active_event = ""
        self._cancelled = asyncio.Event()
        self._prompt_arrived = asyncio.Event()

    async def update_prompt(self, event_id: str, prompt: str) -> None:
        if prompt in self._b.reject_prompts:
            raise InvalidRequest(f"prompt {prompt!r} rejected by the fake", code="interaction_failed")
        self.record.updates.append((event_id, prompt))
        self._pending.append((event_id, prompt))
        self._prompt_arrived.set()

    async def cancel(self) -> None:
        if self._b.cancel_delay_s:
            await asyncio.sleep(self._b.cancel_delay_s)
        if not self.record.cancelled and self._b.release_delay_s:
            self._pipeline.busy_until = asyncio.get_running_loop().time() + self._b.release_delay_s
        self.record.cancelled = True
        self._cancelled.set()

    async def chunks(self) -> AsyncIterator[MediaChunk]:
        index = 0
        try:
            while not self._cancelled.is_set():
                if self._b.num_chunks is not None and index >= self._b.num_chunks:
                    break
                if self._b.stall_after is not None and index >= self._b.stall_after:
                    await self._cancelled.wait()
                    break
                await self._hold(index)
                if self._cancelled.is_set():
                    break
                if self._b.chunk_delay_s:
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._cancelled.wait(), self._b.chunk_delay_s)
                    if self._cancelled.is_set():
                        break
                completed = [eid for eid, _ in self._pending]
                if self._pending:
                    self._active_event, self._prompt = self._pending[-1]
                    self._pending.clear()
                frames, audio = self._render(index)
                data = self._muxer.encode(frames, audio)
                self.record.chunks += 1
                yield MediaChunk(
                    data=data, request_index=index // 4, phase_index=index % 4,
                    num_frames=frames.shape[0], num_audio_samples=audio.shape[1],
                    audio_sample_rate=SAMPLE_RATE, started_event_ids=tuple(completed),
                    active_event_ids=(self._active_event,), completed_event_ids=tuple(completed),
                    timings=StageTimings(text=0.001, dit=0.01, vae=0.005, mux=0.002),
                )
                index += 1
            tail = self._muxer.close()
            if tail:
                yield MediaChunk(data=tail, request_index=index // 4, phase_index=index % 4,
                                 num_frames=0, num_audio_samples=0, kind="trailer")
        finally:
            self.record.closed = True

    async def _hold(self, index: int) -> None:
        """At a request boundary after request 0 with hold on: wait for a prompt (or cancel, or the hold's end)."""
        hold = self.record.request.hold
        if not hold.enabled or index == 0 or index % 4 != 0 or self._pending:
            return
        self.record.holds.append(index // 4)
        self._prompt_arrived.clear()
        waits = [asyncio.ensure_future(self._prompt_arrived.wait()), asyncio.ensure_future(self._cancelled.wait())]
        try:
            await asyncio.wait(waits, timeout=hold.max_seconds or None, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        if not self._pending and not self._cancelled.is_set() and hold.fallback_prompt is not None:
            self._prompt = hold.fallback_prompt  # the hold expired

    def _render(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        req = self.record.request
        n = self._b.frames_per_chunk
        colour = np.frombuffer(hashlib.sha256(self._prompt.encode()).digest()[:3], np.uint8)
        frames = np.zeros((n, req.height, req.width, 3), np.uint8)
        frames[:] = colour // 3
        for k in range(n):
            x = ((index * n + k) * 4) % req.width
            frames[k, :, x:x + 8] = colour
        samples = n * SAMPLE_RATE // req.fps
        t = (np.arange(samples) + index * samples) / SAMPLE_RATE
        tone = (0.2 * np.sin(2 * np.pi * 440.0 * t)).astype(np.float32)
        return frames, np.stack([tone, tone])


class FakePipeline(Pipeline):
    """Pipeline double: records requests and streams muxed test patterns."""

    def __init__(self, behaviour: FakeBehaviour | None = None) -> None:
        self.behaviour = behaviour or FakeBehaviour()
        self.records: list[FakeRecord] = []
        self.busy_starts = 0
        """Starts refused with backend_busy (the previous session not yet released)."""
        self.busy_until = 0.0
        """Loop time until which the backend is still releasing a cancelled session."""
        self.down: list[str] = []
        """Stages reported not serving (a restarting stage)."""

    def stages_down(self) -> list[str]:
        return list(self.down)

    async def wait_ready(self, timeout_s: float) -> list[str]:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self.down and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
        return list(self.down)

    async def start(self, request: SessionRequest) -> PipelineSession:
        if self.behaviour.start_error is not None:
            raise self.behaviour.start_error
        if asyncio.get_running_loop().time() < self.busy_until:
            self.busy_starts += 1
            raise BackendBusy("dit: this DiT group already streams a session")
        record = FakeRecord(request)
        self.records.append(record)
        return FakePipelineSession(self.behaviour, record, self)

    async def health(self) -> bool:
        return self.behaviour.healthy


def small_config(**overrides) -> GatewayConfig:
    """A GatewayConfig with a tiny canvas and short timeouts for tests."""
    values = dict(
        host="127.0.0.1", port=0, model="fake-model", queue_limit=2, start_timeout_s=2.0,
        stall_timeout_s=5.0, max_start_bytes=64 * 1024, max_interaction_bytes=4 * 1024,
        max_frame_bytes=128 * 1024, max_prompt_chars=200, allowed_canvases=((64, 48), (48, 64)),
        default_canvas=(64, 48), queue_poll_s=0.05, drain_timeout_s=2.0,
    )
    values.update(overrides)
    return GatewayConfig(**values)


@contextlib.asynccontextmanager
async def running_gateway(config: GatewayConfig, pipeline: Pipeline, registry: CollectorRegistry | None = None,
                          access: Access | None = None) -> AsyncIterator[TestServer]:
    """Serve the gateway on 127.0.0.1 with an ephemeral port; yields the aiohttp TestServer."""
    server = TestServer(create_app(config, pipeline, registry, access), host="127.0.0.1", port=0)
    await server.start_server()
    try:
        yield server
    finally:
        await server.close()


@dataclass
class Transcript:
    """Frames one test connection received, in order."""

    texts: list[dict] = field(default_factory=list)
    binaries: list[bytes] = field(default_factory=list)
    order: list[str] = field(default_factory=list)
    """'text:<type>' or 'binary' per frame."""
    close_code: int | None = None

    def of_type(self, kind: str) -> list[dict]:
        return [m for m in self.texts if m["type"] == kind]


async def read_until(ws: aiohttp.ClientWebSocketResponse, transcript: Transcript, *,
                     until: str | None = None, timeout: float = 10.0) -> dict | None:
    """Read frames into `transcript` until a text message of type `until` (returned) or the close."""

    async def pump() -> dict | None:
        async for msg in ws:
            if msg.type == aiohttp.WSMsgType.TEXT:
                body = json.loads(msg.data)
                transcript.texts.append(body)
                transcript.order.append(f"text:{body['type']}")
                if until is not None and body["type"] == until:
                    return body
            elif msg.type == aiohttp.WSMsgType.BINARY:
                transcript.binaries.append(msg.data)
                transcript.order.append("binary")
        transcript.close_code = ws.close_code
        return None

    return await asyncio.wait_for(pump(), timeout)


def ws_url(server: TestServer) -> str:
    """The ws:// address of the server's realtime endpoint."""
    return str(server.make_url("/v1/realtime/video")).replace("http://", "ws://", 1)


async def run_good_session(server: TestServer, prompt: str = "a good session", token: str | None = None
                           ) -> Transcript:
    """Run one session to session.done and the server's close; fail if anything else happens."""
    transcript = Transcript()
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession() as http, http.ws_connect(ws_url(server), headers=headers) as ws:
        await ws.send_json({"type": "session.start", "prompt": prompt})
        done = await read_until(ws, transcript, until="session.done")
        await read_until(ws, transcript)
    if done is None or transcript.of_type("error"):
        raise AssertionError(f"session did not complete cleanly: {transcript.texts}")
    return transcript


async def healthz(server: TestServer) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http, http.get(server.make_url("/healthz")) as resp:
        return resp.status, await resp.json()


_W, _H, _FPS = 64, 48, 24
"""The canvas and rate of `fmp4_chunks`."""


def fmp4_chunks(num_chunks: int, frames: int = 6) -> list[bytes]:
    """Real fMP4 chunks as the VAE sends them: the first opens with the init segment, the last is the trailer."""
    muxer = FragmentedMP4Muxer(_W, _H, fps=_FPS, sample_rate=SAMPLE_RATE)
    out = []
    for i in range(num_chunks):
        video = np.full((frames, _H, _W, 3), (i * 40) % 255, np.uint8)
        t = (np.arange(frames * SAMPLE_RATE // _FPS) + i * frames * SAMPLE_RATE // _FPS) / SAMPLE_RATE
        tone = (0.2 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
        out.append(muxer.encode(video, np.stack([tone, tone])))
    out.append(muxer.close())
    return out


def chunk_metadata(index: int, data: bytes, *, kind: str = "media", frames: int = 6) -> dict:
    """A `video.chunk_metadata` wire dict for chunk `index` of `fmp4_chunks` (session "s")."""
    media = kind == "media"
    return {"type": "video.chunk_metadata", "request_id": "s", "kind": kind, "transport_chunk_index": index,
            "request_index": index // 4, "phase_index": index % 4, "num_frames": frames if media else 0,
            "num_audio_samples": frames * SAMPLE_RATE // _FPS if media else 1024,
            "audio_sample_rate": SAMPLE_RATE, "byte_length": len(data)}
