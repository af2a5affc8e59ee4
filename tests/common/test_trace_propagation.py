"""Session ids and per-chunk trace context across the real gRPC plumbing: gateway → encoder, DiT → VAE.

The gateway's `GrpcPipeline` talks to the real `EncoderServicer`, `DiTServicer` and `VAEServicer` over an
in-process grpc.aio server; only the compute cores behind the servicers are small fakes (no weights), so
this checks the wire fields, call metadata and log lines, not generation.
"""
import asyncio
import io
import json
import logging
import time
import types
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from services.common import tracing
from services.common.logging_setup import JsonFormatter, log_context
from services.dit.api import HoldConfig, PhaseMeta, PhaseOutput, PhaseTimings
from services.dit.grpc_server import DiTServicer
from services.encoder.grpc_server import EncoderServicer
from services.encoder.service import Encoded
from services.gateway.grpc_pipeline import GrpcPipeline
from services.gateway.pipeline import SessionRequest
from services.vae.grpc_server import VAEServicer
from services.vae.service import Chunk
from vitascope.dit.v1 import dit_pb2_grpc
from vitascope.encoder.v1 import encoder_pb2_grpc
from vitascope.vae.v1 import vae_pb2_grpc

pytestmark = pytest.mark.cpu

SESSION = "video_stream-trace-test"
PROMPTS = ("a red fox in the snow", "a blue heron at dawn")
worker_log = logging.getLogger("tests.fake_dit_worker")


class FakeEncoder:
    def __init__(self) -> None:
        self.worker = ThreadPoolExecutor(1, "encoder")

    def encode(self, prompt: str) -> Encoded:
        return Encoded(embedding=torch.ones(3, 8), seconds=0.002)


class FakeDiTSession:
    canvas = types.SimpleNamespace(width=64, height=64)
    kv = None

    def __init__(self) -> None:
        self.count = 0
        self.cancel_token = types.SimpleNamespace(cancelled=False)

    def next_phase(self) -> PhaseOutput:
        worker_log.info("phase %d in a worker thread", self.count)  # runs under asyncio.to_thread
        time.sleep(0.01)
        i, self.count = self.count, self.count + 1
        meta = PhaseMeta(request_index=i // 2, phase_index=i % 2, num_frames=4, num_audio_samples=640,
                         num_video_latents=1, num_audio_latents=1, started_event_ids=(), active_event_id="",
                         completed_event_ids=(), superseded_event_ids=(), timings=PhaseTimings(student_s=0.01))
        return PhaseOutput(video=torch.zeros(1, 24, 4, 4), audio=torch.zeros(2, 1, 32), meta=meta)

    def submit_prompt(self, update) -> None:
        pass

    def cancel(self) -> None:
        self.cancel_token.cancelled = True

    def close(self) -> None:
        pass


class FakeDiT:
    def open(self, config, prompt, fallback) -> FakeDiTSession:
        return FakeDiTSession()

    def hold_config(self, enabled: bool, max_seconds: float) -> HoldConfig:
        return HoldConfig(enabled=enabled, max_seconds=max_seconds or None)


class FakeVAE:
    def __init__(self) -> None:
        self.decode_worker = ThreadPoolExecutor(1, "vae-decode")

    def open(self, width, height, fps, sample_rate):
        chunk = Chunk(data=b"\0" * 100, num_frames=4, num_audio_samples=640, video_decode_seconds=0.001,
                      audio_decode_seconds=0.001, mux_seconds=0.001)
        return types.SimpleNamespace(phase=lambda video, audio: (c for c in [chunk]), discard=lambda: None)


async def run_session(num_chunks: int) -> list:
    server = grpc.aio.server()
    encoder_pb2_grpc.add_EncoderServicer_to_server(EncoderServicer(FakeEncoder()), server)
    dit_pb2_grpc.add_DiTServicer_to_server(DiTServicer(FakeDiT()), server)
    vae_pb2_grpc.add_VAEServicer_to_server(VAEServicer(FakeVAE()), server)
    addr = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()  # started outside the session's log context: the stages must set their own
    pipeline = GrpcPipeline(addr, addr, addr)
    chunks = []
    try:
        with log_context(session_id=SESSION):
            request = SessionRequest(request_id=SESSION, prompt=PROMPTS[0], seed=1, width=64, height=64, fps=24)
            session = await pipeline.start(request)
            stream = session.chunks()
            async for chunk in stream:
                chunks.append(chunk)
                if len(chunks) == 1:
                    await session.update_prompt("e1", PROMPTS[1])
                if len(chunks) == num_chunks:
                    break
            await stream.aclose()
            await session.cancel()
    finally:
        await pipeline.close()
        await server.stop(0)
    return chunks


@pytest.fixture
def log_lines():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter("all-in-one"))
    root = logging.getLogger()
    saved_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield stream
    finally:
        root.removeHandler(handler)
        root.setLevel(saved_level)


def test_session_id_and_trace_follow_each_chunk_through_the_stages(log_lines):
    chunks = asyncio.run(asyncio.wait_for(run_session(num_chunks=3), 60))
    assert len(chunks) == 3
    text = log_lines.getvalue()
    assert not any(p in text for p in PROMPTS)  # prompts are never logged, only length and hash
    entries = [json.loads(line) for line in text.splitlines()]

    def by(logger: str, msg_prefix: str = "") -> list[dict]:
        return [e for e in entries if e["logger"] == logger and e["msg"].startswith(msg_prefix)]

    (root,) = by("services.gateway.grpc_pipeline", f"session {SESSION}: trace")
    trace_id, root_span = root["trace_id"], root["span_id"]
    tracing.SpanContext(trace_id, root_span)  # well-formed ids

    encodes = by("services.encoder.grpc_server", "prompt encoded")
    assert len(encodes) == 2  # the first prompt and the update
    assert {e["session_id"] for e in encodes} == {SESSION} and {e["trace_id"] for e in encodes} == {trace_id}
    assert len({e["span_id"] for e in encodes} | {root_span}) == 3  # one child span per encode
    assert encodes[0]["prompt_chars"] == len(PROMPTS[0]) and len(encodes[0]["prompt_sha256"]) == 12

    # The DiT got the session span as call metadata: its lines (and its worker thread's) carry both ids.
    workers = by("tests.fake_dit_worker")
    assert len(workers) >= 3 and all(e["session_id"] == SESSION and e["trace_id"] == trace_id for e in workers)
    phases = {(e["request_index"], e["phase_index"]): e for e in by("services.dit.grpc_server", "phase ")}
    assert all(e["session_id"] == SESSION and e["trace_id"] == trace_id for e in phases.values())
    assert len({e["span_id"] for e in phases.values()} | {root_span}) == len(phases) + 1

    # The VAE and the gateway log each chunk with the span the DiT made for its phase.
    decoded = by("services.vae.grpc_server", "chunk ")
    received = by("services.gateway.grpc_pipeline", "chunk ")
    assert len(decoded) >= 3 and len(received) == 3
    for entry in decoded + received:
        phase = phases[(entry["request_index"], entry["phase_index"])]
        assert entry["span_id"] == phase["span_id"] and entry["trace_id"] == trace_id
        assert entry["session_id"] == SESSION
    assert [e["chunk_index"] for e in received] == [0, 1, 2]
    assert [(c.request_index, c.phase_index) for c in chunks] == [(0, 0), (0, 1), (1, 0)]
