"""The CLI client against a live gateway with the fake pipeline."""
import asyncio
import logging
import os
import sys
from pathlib import Path

import av
import pytest

from services.client import ClientError, ClientOptions, PromptUpdate, build_parser, parse_update, stream, write_output
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


@pytest.mark.e2e
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


def held_stream(server, **kw) -> ClientOptions:
    """Options of a --hold run against the fake: 4 chunks of 6 frames (1 s of media) per request."""
    return ClientOptions(url=ws_url(server), prompt="a lake", hold=True, ping_interval_s=0.5, **kw)


async def test_unbounded_hold_with_no_update_left_stops_with_the_media_it_has(caplog):
    pipeline = FakePipeline(FakeBehaviour(num_chunks=None, frames_per_chunk=6, chunk_delay_s=0.01))
    caplog.set_level(logging.INFO, logger="services.client")
    async with running_gateway(small_config(), pipeline) as server:
        result = await asyncio.wait_for(stream(held_stream(
            server, seconds=5, hold_idle_s=1.0, updates=(PromptUpdate(1.0, "a storm"),))), 15)
    record = pipeline.records[0]
    assert record.holds[-1] == 2 and record.cancelled  # request 1 got the storm; request 2 waited for nothing
    assert [p for _, p in record.updates] == ["a storm"] and list(result.applied_at.values()) == [4]
    assert result.done is not None and result.done["stopped"] is True
    assert result.media_seconds == pytest.approx(2.0)  # everything generated before the hold
    assert "--hold" in result.stop_reason and "--hold-max-seconds" in result.stop_reason
    assert "--update" in result.stop_reason and "--seconds=5" in result.stop_reason
    assert any(r.levelno == logging.WARNING and "--hold-max-seconds" in r.getMessage() for r in caplog.records)
    assert "--hold-idle-seconds" in build_parser().format_help()


async def test_a_held_server_gets_the_next_scheduled_update_at_once():
    pipeline = FakePipeline(FakeBehaviour(num_chunks=None, frames_per_chunk=6, chunk_delay_s=0.01))
    async with running_gateway(small_config(), pipeline) as server:
        result = await asyncio.wait_for(stream(held_stream(
            server, seconds=1.5, hold_idle_s=1.0, updates=(PromptUpdate(3.0, "late"),))), 15)
    record = pipeline.records[0]
    assert record.holds == [1] and [p for _, p in record.updates] == ["late"]
    assert list(result.applied_at.values()) == [4]  # the media clock stood at 1 s: it lands at the held boundary
    assert result.stop_reason is None and result.done["stopped"] is True
    assert result.media_seconds == pytest.approx(1.5)


async def test_a_bounded_hold_is_left_to_the_server():
    pipeline = FakePipeline(FakeBehaviour(num_chunks=None, frames_per_chunk=6, chunk_delay_s=0.01))
    async with running_gateway(small_config(), pipeline) as server:
        result = await asyncio.wait_for(stream(held_stream(
            server, seconds=2, hold_max_seconds=0.4, hold_idle_s=0.05)), 15)
    assert pipeline.records[0].holds[0] == 1  # it held, and the hold ended by itself
    assert result.sent_updates == {} and result.stop_reason is None
    assert result.media_seconds == pytest.approx(2.0)
    with pytest.raises(ValueError, match="--hold-idle-seconds"):
        ClientOptions(url="ws://h/v1/realtime/video", prompt="p", hold_idle_s=0)
