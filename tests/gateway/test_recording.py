"""Session recordings: appended per chunk, finalized into a progressive MP4 that plays with every frame and sample,
recovered after a crash, retained, listed and served behind the tokens; the box reader under it."""
from __future__ import annotations

import asyncio
import contextlib
import struct
import time
from pathlib import Path

import aiohttp
import av
import numpy as np
import pytest

from services.common.config import GatewayAuthConfig
from services.gateway import isobmff, remux
from services.gateway.access import Access
from services.gateway.broadcast import split_init_segment
from services.gateway.pipeline import InvalidRequest
from services.gateway.recording import PARTIAL_SUFFIX, Recordings, stamp_creation_time
from services.gateway.ws import SERVICE_KEY
from services.vae.mux import FragmentedMP4Muxer
from tests.gateway.fakes import FakeBehaviour, FakePipeline, Transcript, read_until, run_good_session, \
    running_gateway, small_config, ws_url

pytestmark = pytest.mark.cpu

FPS = 24
RATE = 32000
W, H = 64, 48
DIRECTOR = "director-token-0123456789"
VIEWER = "viewer-token-0123456789ab"


def _stream(num_chunks: int, frames: int = 6) -> tuple[bytes, list[bytes]]:
    """(init segment, fragments) as the VAE writes them, the trailer last."""
    muxer = FragmentedMP4Muxer(W, H, fps=FPS, sample_rate=RATE)
    chunks = []
    for i in range(num_chunks):
        tone = (0.2 * np.sin(np.arange(frames * RATE // FPS) / 10)).astype(np.float32)
        chunks.append(muxer.encode(np.full((frames, H, W, 3), i * 30 % 255, np.uint8), np.stack([tone, tone])))
    chunks.append(muxer.close())
    init, first = split_init_segment(chunks[0])
    return init, [first, *chunks[1:]]


def _played(path: Path) -> tuple[int, int, int]:
    """(video frames decoded, audio samples decoded, audio samples the demuxer presents: its packets' durations)."""
    with av.open(str(path)) as container:
        shown = sum(p.duration for p in container.demux(audio=0) if p.size and p.pts >= 0)
    with av.open(str(path)) as container:
        frames = samples = 0
        for frame in container.decode():
            if isinstance(frame, av.VideoFrame):
                frames += 1
            else:
                samples += frame.samples
    return frames, samples, shown


def _top_level(path: Path) -> list[str]:
    data = path.read_bytes()
    return [b.type for b in isobmff.iter_boxes(data)]


async def test_a_session_is_recorded_as_a_progressive_mp4_with_every_frame_and_sample(tmp_path):
    config = small_config(recordings_dir=str(tmp_path))
    async with running_gateway(config, FakePipeline(FakeBehaviour(num_chunks=8))) as server:
        transcript = await run_good_session(server)
        await server.app[SERVICE_KEY].recordings.idle()
    session_id = transcript.of_type("video.start")[0]["request_id"]
    path = tmp_path / f"{session_id}.mp4"
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # the partial file is gone
    assert _top_level(path) == ["ftyp", "moov", "mdat"]  # progressive: no fragments, the index first
    fed = sum(m["num_audio_samples"] for m in transcript.of_type("video.chunk_metadata"))
    frames, samples, shown = _played(path)
    assert frames == 8 * 6 and shown == fed == 8 * 6 * RATE // FPS
    assert fed <= samples < fed + 1024  # the decoder's last AAC frame is whole; the edit list ends at `fed`
    info = remux.read_movie_info(path)
    assert info.duration_s == pytest.approx(2.0) and abs(info.created - time.time()) < 60
    with av.open(str(path)) as container:  # the audio edit list skips the encoder's priming, as streamed
        assert container.streams.audio[0].duration == fed and container.streams.video[0].frames == 48


async def test_the_file_being_written_plays_as_fragmented_mp4_up_to_its_last_chunk(tmp_path):
    # The fake holds before request 1: 4 chunks are out, the session still runs.
    config = small_config(recordings_dir=str(tmp_path))
    async with running_gateway(config, FakePipeline(FakeBehaviour(num_chunks=8))) as server, \
            aiohttp.ClientSession() as http, http.ws_connect(ws_url(server)) as ws:
        await ws.send_json({"type": "session.start", "prompt": "p", "extra_params": {"hold_for_prompt": True}})
        transcript = Transcript()
        for _ in range(4):
            await read_until(ws, transcript, until="video.chunk_metadata")
        partial, frames = tmp_path / f"{transcript.texts[0]['request_id']}{PARTIAL_SUFFIX}", 0
        for _ in range(100):  # the writes are on the worker thread
            with contextlib.suppress(av.error.FFmpegError):  # read as a write lands
                if partial.exists() and (frames := (await asyncio.to_thread(_played, partial))[0]) == 24:
                    break
            await asyncio.sleep(0.05)
        assert frames == 24 and _top_level(partial)[:2] == ["ftyp", "moov"]


async def test_a_partial_file_left_by_a_dead_gateway_is_finalized_at_start_up(tmp_path):
    init, fragments = _stream(6)
    cut = fragments[5][: len(fragments[5]) // 2]  # the gateway died while writing chunk 5
    (tmp_path / f"crashed{PARTIAL_SUFFIX}").write_bytes(stamp_creation_time(init, 1_700_000_000)
                                                       + b"".join(fragments[:5]) + cut)
    (tmp_path / f"empty{PARTIAL_SUFFIX}").write_bytes(init + fragments[0][:100])  # nothing whole: deleted
    recordings = Recordings(tmp_path)
    await recordings.start()
    await recordings.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["crashed.mp4"]
    frames, samples, shown = _played(tmp_path / "crashed.mp4")
    assert frames == 5 * 6 and samples >= 5 * 6 * RATE // FPS - 3 * 1024  # the AAC encoder held its last ones back
    assert remux.read_movie_info(tmp_path / "crashed.mp4").created == 1_700_000_000


def test_remux_keeps_interleaving_and_edit_list_and_refuses_a_file_without_fragments(tmp_path):
    init, fragments = _stream(3)
    source, target = tmp_path / "in.mp4", tmp_path / "out.mp4"
    source.write_bytes(init + b"".join(fragments))
    info = remux.remux(source, target, audio_samples=3 * 6 * RATE // FPS)
    assert info.duration_s == pytest.approx(0.75)
    data = target.read_bytes()
    moov = next(b for b in isobmff.iter_boxes(data) if b.type == "moov")
    traks = [b for b in isobmff.children(data, moov) if b.type == "trak"]
    assert [isobmff.find_path(data, t, "edts/elst") is not None for t in traks] == [False, True]
    elst = isobmff.find_path(data, traks[1], "edts/elst")
    _, duration, media_time = struct.unpack_from(">IQq", data, elst.offset + elst.header + 4)
    assert media_time == 1024 and duration == 3 * 6 * RATE // FPS * 3  # movie timescale 96000 = 3 x 32000
    offsets = []
    for trak in traks:  # one chunk per fragment and track, video before audio within a fragment
        stco = isobmff.find_path(data, trak, "mdia/minf/stbl/stco")
        (count,) = struct.unpack_from(">I", data, stco.offset + stco.header + 4)
        offsets.append(struct.unpack_from(f">{count}I", data, stco.offset + stco.header + 8))
    assert len(offsets[0]) == 3 and offsets[0][1] < offsets[1][1] < offsets[0][2]
    source.write_bytes(init)
    with pytest.raises(remux.RemuxError, match="no whole fragment"):
        remux.remux(source, target)


def test_a_trun_that_leans_on_the_track_defaults_is_read():
    # tfhd with default duration and size, trun with only flags per sample (first a sync sample)
    tfhd = isobmff.full_box(b"tfhd", 0, 0x020018, struct.pack(">III", 1, 1000, 7))
    trun = isobmff.full_box(b"trun", 0, 0x000401, struct.pack(">Ii", 3, 100), struct.pack(">III", 0, 0x10000, 0x10000))
    moof = isobmff.box(b"moof", isobmff.full_box(b"mfhd", 0, 0, struct.pack(">I", 1)),
                       isobmff.box(b"traf", tfhd, isobmff.full_box(b"tfdt", 1, 0, struct.pack(">Q", 5000)), trun))
    (run,) = isobmff.parse_moof(moof, next(isobmff.iter_boxes(moof)), {})
    assert (run.track_id, run.base_time, run.data_offset) == (1, 5000, 100)
    assert run.durations == (1000,) * 3 and run.sizes == (7,) * 3 and run.sync == (True, False, False)


async def test_retention_keeps_the_newest_recordings_within_their_age(tmp_path):
    init, fragments = _stream(2)
    now = 1_800_000_000.0
    for name, age in (("old", 5000), ("mid", 300), ("new", 200), ("newest", 100)):
        (tmp_path / "src").write_bytes(stamp_creation_time(init, now - age) + b"".join(fragments))
        remux.remux(tmp_path / "src", tmp_path / f"{name}.mp4")
    (tmp_path / "src").unlink()
    recordings = Recordings(tmp_path, max_count=2, max_age_s=1000, clock=lambda: now)
    await recordings.start()
    assert [r.name for r in await recordings.list()] == ["newest.mp4", "new.mp4"]
    await recordings.close()


async def test_each_finalized_recording_applies_the_retention(tmp_path):
    config = small_config(recordings_dir=str(tmp_path), recordings_max_count=1)
    async with running_gateway(config, FakePipeline(FakeBehaviour(num_chunks=4))) as server:
        await run_good_session(server, "first")
        await server.app[SERVICE_KEY].recordings.idle()
        second = await run_good_session(server, "second")
        await server.app[SERVICE_KEY].recordings.idle()
    assert [p.name for p in tmp_path.iterdir()] == [f"{second.of_type('video.start')[0]['request_id']}.mp4"]


async def test_a_session_without_media_leaves_no_recording(tmp_path):
    config = small_config(recordings_dir=str(tmp_path))
    pipeline = FakePipeline(FakeBehaviour(start_error=InvalidRequest("refused by the fake")))
    async with running_gateway(config, pipeline) as server, aiohttp.ClientSession() as http, \
            http.ws_connect(ws_url(server)) as ws:
        await ws.send_json({"type": "session.start", "prompt": "p"})
        await read_until(ws, Transcript(), until="error")
        await server.app[SERVICE_KEY].recordings.idle()
    assert list(tmp_path.iterdir()) == []


async def test_recordings_are_listed_and_served_to_director_tokens_only(tmp_path):
    (tmp_path / "t").write_text(DIRECTOR)
    auth = GatewayAuthConfig(enabled=True, tokens_file=str(tmp_path / "t"))
    config = small_config(auth=auth, recordings_dir=str(tmp_path / "rec"))
    access = Access(auth, [DIRECTOR], viewer_tokens=[VIEWER])
    async with running_gateway(config, FakePipeline(FakeBehaviour(num_chunks=4)), access=access) as server, \
            aiohttp.ClientSession() as http:
        transcript = await run_good_session(server, token=DIRECTOR)
        await server.app[SERVICE_KEY].recordings.idle()
        listing_url = server.make_url("/v1/recordings")
        for headers, status in (({}, 401), ({"Authorization": f"Bearer {VIEWER}"}, 403)):
            async with http.get(listing_url, headers=headers) as reply:
                assert reply.status == status and (await reply.json())["type"] == "error"
        async with http.get(listing_url, params={"token": DIRECTOR}) as reply:
            (entry,) = (await reply.json())["recordings"]
        name = f"{transcript.of_type('video.start')[0]['request_id']}.mp4"
        assert entry["name"] == name and entry["url"] == f"/v1/recordings/{name}"
        assert entry["bytes"] == (tmp_path / "rec" / name).stat().st_size and entry["duration_s"] == 1.0
        assert entry["created"].endswith("Z")
        bearer = {"Authorization": f"Bearer {DIRECTOR}"}
        async with http.get(server.make_url(entry["url"]), headers=bearer) as reply:
            assert reply.status == 200 and reply.headers["Content-Type"] == "video/mp4"
            assert await reply.read() == (tmp_path / "rec" / name).read_bytes()
        async with http.get(server.make_url(entry["url"]), headers={**bearer, "Range": "bytes=0-7"}) as reply:
            assert reply.status == 206 and (await reply.read())[4:8] == b"ftyp"
        for missing in ("nothing.mp4", f"x{PARTIAL_SUFFIX}", "..%2Ft"):
            async with http.get(server.make_url(f"/v1/recordings/{missing}"), headers=bearer) as reply:
                assert reply.status == 404, missing


@pytest.mark.parametrize("fields, message", [
    ({"recordings_dir": " "}, "recordings_dir is empty"),
    ({"recordings_dir": "/r", "recordings_max_count": 0}, "recordings_max_count=0"),
    ({"recordings_dir": "/r", "recordings_max_age_s": -1.0}, "recordings_max_age_s=-1.0"),
    ({"recordings_max_count": 3}, "without gateway.recordings_dir"),
    ({"hls_part_target_s": 6.0}, "hls_part_target_s=6.0"),
])
def test_the_recording_and_hls_fields_are_validated(fields, message):
    with pytest.raises(ValueError, match=message):
        small_config(**fields)
