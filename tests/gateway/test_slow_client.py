"""A client that stops reading is dropped after `send_timeout_s`, whatever the gateway was sending it, and a
client that answers no websocket ping within half of `heartbeat_s`, even when nothing is being sent to it.

Before the sink bounded every send, only media chunks had a time limit: a client that read nothing held its
slot forever while the gateway waited to hand it a control message (video.start, session.queued, a pong). Before
the heartbeat, a queued client whose network path died kept its queue place for good.
"""
import asyncio
import base64
import json
import os
import socket
import struct

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from services.gateway.metrics import GatewayMetrics
from services.gateway.protocol import ChunkMetadata, Pong, SessionStart
from services.gateway.service import ClientGone, Outcome, SessionService
from services.gateway.ws import _WebSocketSink
from tests.gateway.fakes import (
    FakeBehaviour,
    FakePipeline,
    Transcript,
    healthz,
    read_until,
    run_good_session,
    running_gateway,
    small_config,
    ws_url,
)

pytestmark = pytest.mark.cpu

PAD_BYTES = 12 * 1024 * 1024  # echoed back in video.start: more than loopback's socket buffers hold


def _frame(text: str) -> bytes:
    """One masked client text frame (RFC 6455, section 5.2), mask key zero so the payload goes as is."""
    payload = text.encode()
    header = struct.pack("!BBQ", 0x81, 0x80 | 127, len(payload))
    return header + b"\0\0\0\0" + payload


def _open_without_reading(port: int, text: str) -> socket.socket:
    """Connect with a tiny receive buffer, upgrade to a websocket, send `text`, then never read again."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall((f"GET /v1/realtime/video HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
                  f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
    reply = b""
    while b"\r\n\r\n" not in reply:
        reply += sock.recv(4096)
    assert reply.startswith(b"HTTP/1.1 101"), reply[:200]
    sock.sendall(_frame(text))
    return sock


async def test_a_client_that_never_reads_video_start_loses_its_slot_to_the_next():
    config = small_config(num_slots=1, send_timeout_s=0.5, max_start_bytes=16 * 1024 * 1024,
                          max_frame_bytes=16 * 1024 * 1024)
    pipeline = FakePipeline(FakeBehaviour(num_chunks=2))
    start = json.dumps({"type": "session.start", "prompt": "never read",
                        "extra_params": {"pad": "x" * PAD_BYTES}})
    async with running_gateway(config, pipeline) as server:
        stuck = await asyncio.to_thread(_open_without_reading, server.port, start)
        try:
            await _wait_until_a_slot_is_taken(server)
            # The stuck client holds the only slot until its video.start times out; then this one runs.
            transcript = await asyncio.wait_for(run_good_session(server, "next in line"), 10.0)
        finally:
            stuck.close()
    assert len(transcript.of_type("video.chunk_metadata")) >= 2
    assert [r.request.prompt for r in pipeline.records] == ["next in line"]  # the stuck one never started


async def _wait_for_health(server, what: str, **expected) -> None:
    for _ in range(200):
        report = (await healthz(server))[1]
        if all(report[k] == v for k, v in expected.items()):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{what}: health stayed at {report}, never {expected}")


async def _wait_until_a_slot_is_taken(server) -> None:
    await _wait_for_health(server, "the stuck client's session.start never took the slot", sessions_active=1)


async def test_a_queued_client_that_answers_no_ping_loses_its_place():
    # While queued a client is sent next to nothing, so no send ever times out: only the heartbeat finds it gone.
    config = small_config(num_slots=1, heartbeat_s=0.4)
    pipeline = FakePipeline(FakeBehaviour(num_chunks=None, chunk_delay_s=0.05))
    async with running_gateway(config, pipeline) as server, aiohttp.ClientSession() as http:
        async with http.ws_connect(ws_url(server)) as running:  # answers pings itself, as browsers do
            await running.send_json({"type": "session.start", "prompt": "holds the slot"})
            reader = asyncio.ensure_future(read_until(running, Transcript(), timeout=30))
            await _wait_until_a_slot_is_taken(server)
            silent = await asyncio.to_thread(_open_without_reading, server.port,
                                             json.dumps({"type": "session.start", "prompt": "queued, then silent"}))
            try:
                await _wait_for_health(server, "the silent client never queued", sessions_queued=1)
                await _wait_for_health(server, "the silent client kept its queue place", sessions_queued=0)
                assert not reader.done()  # the running session goes on
            finally:
                silent.close()
                reader.cancel()


class _StuckWebSocket:
    """A websocket whose peer stopped reading: text frames go out, binary frames never finish."""

    closed = False

    def __init__(self):
        self.texts: list[str] = []

    async def send_str(self, text):
        self.texts.append(text)

    async def send_bytes(self, data):
        await asyncio.Event().wait()


class _Transport:
    aborted = False

    def abort(self):
        self.aborted = True


async def test_a_send_that_times_out_drops_the_connection_and_fails_every_later_send():
    transport = _Transport()
    sink = _WebSocketSink(_StuckWebSocket(), transport, timeout_s=0.2)
    metadata = ChunkMetadata(request_id="r", kind="media", transport_chunk_index=0, generation_chunk_index=0,
                             request_index=0, phase_index=0, num_frames=1, num_audio_samples=0,
                             audio_sample_rate=32000, byte_length=1, started_event_ids=(),
                             active_event_ids=(), completed_event_ids=(), timings={})
    with pytest.raises(ClientGone):
        await asyncio.wait_for(sink.send_media(metadata, b"x"), 5.0)
    assert transport.aborted
    with pytest.raises(ClientGone):  # at once: the stream may hold half a frame
        await asyncio.wait_for(sink.send(Pong()), 0.05)


async def test_a_session_whose_client_stops_reading_media_ends_and_frees_its_slot():
    pipeline = FakePipeline(FakeBehaviour(num_chunks=None))
    config = small_config(send_timeout_s=0.5)
    service = SessionService(config, pipeline, GatewayMetrics(CollectorRegistry()))
    session = service.open(SessionStart(prompt="p"), _WebSocketSink(_StuckWebSocket(), _Transport(), 0.5))
    outcome = await asyncio.wait_for(session.run(), 5.0)
    assert outcome == Outcome.DISCONNECTED
    assert service.scheduler.num_active == 0
    assert pipeline.records[0].cancelled
