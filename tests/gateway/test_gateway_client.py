"""The CLI client against a live gateway with the fake pipeline."""
import asyncio
import os
import sys
from pathlib import Path

import av
import pytest

from services.client import ClientError, ClientOptions, PromptUpdate, parse_update, stream, write_output
from tests.gateway.fakes import FakeBehaviour, FakePipeline, running_gateway, small_config, ws_url

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parents[2]


def decode_counts(path: Path) -> tuple[int, int, list[int]]:
    """(video frames, audio samples per channel, video pts) decoded with PyAV."""
    with av.open(str(path)) as container:
        frames = list(container.decode(video=0))
    with av.open(str(path)) as container:
        samples = sum(f.samples for f in container.decode(audio=0))
    return len(frames), samples, [f.pts for f in frames]


async def test_cli_streams_sends_updates_and_writes_a_playable_mp4(tmp_path):
    pipeline = FakePipeline(FakeBehaviour(num_chunks=None, frames_per_chunk=6, chunk_delay_s=0.01))
    out = tmp_path / "out.mp4"
    async with running_gateway(small_config(), pipeline) as server:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "services.client", "--url", ws_url(server), "--prompt", "a lake",
            "--seconds", "2", "--update", '1s:"a storm"', "--out", str(out),
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )
        stdout, _ = await asyncio.wait_for(proc.communicate(), 60)
    text = stdout.decode()
    assert proc.returncode == 0, text
    assert text.count(" media ") >= 8 and " ms " in text and "real-time factor" in text
    assert "applied ['cli-" in text
    record = pipeline.records[0]
    assert [p for _, p in record.updates] == ["a storm"] and record.cancelled
    frames, samples, pts = decode_counts(out)
    assert frames == 48  # stop is sent once 2 s of media arrived; chunks are 6 frames at 24 fps
    assert pts == sorted(pts) and len(set(pts)) == frames
    assert abs(samples - 2 * 32000) <= 2048


async def test_remux_writes_a_progressive_mp4_with_the_same_frames(tmp_path):
    pipeline = FakePipeline(FakeBehaviour(num_chunks=4))
    async with running_gateway(small_config(), pipeline) as server:
        result = await stream(ClientOptions(url=ws_url(server), prompt="p", seconds=100))
    assert result.done == {"type": "session.done", "request_id": result.request_id,
                           "chunks": len(result.chunks), "stopped": False}
    fragmented, progressive = tmp_path / "f.mp4", tmp_path / "p.mp4"
    write_output(result, fragmented, remux=False)
    write_output(result, progressive, remux=True)
    assert b"moof" in fragmented.read_bytes() and b"moof" not in progressive.read_bytes()
    assert decode_counts(progressive)[0] == decode_counts(fragmented)[0] == 24
    assert result.time_to_first_chunk_s is not None and result.media_seconds == pytest.approx(1.0)


async def test_client_reports_server_rejection():
    async with running_gateway(small_config(), FakePipeline()) as server:
        with pytest.raises(ClientError, match="canvas_not_allowed"):
            await stream(ClientOptions(url=ws_url(server), prompt="p", width=640, height=480))


def test_update_syntax():
    assert parse_update("10s:a storm") == PromptUpdate(10.0, "a storm")
    assert parse_update("2.5:x") == PromptUpdate(2.5, "x")
    assert parse_update('3s:"quoted prompt"') == PromptUpdate(3.0, "quoted prompt")
    for bad in ("storm", "s:x", "10s:", "-1s:x", '4s:""'):
        with pytest.raises(ValueError, match="must look like"):
            parse_update(bad)
    with pytest.raises(ValueError, match="--clock"):
        ClientOptions(url="ws://h/v1/realtime/video", prompt="p", clock="sundial")
