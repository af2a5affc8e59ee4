"""LL-HLS of a live session: playlist rules (parts, hint, window, end), blocking reloads, the routes' headers and auth,
and an outside demuxer (FFmpeg's hls, through PyAV) reading a playlist while its session runs."""
from __future__ import annotations

import asyncio
import re
import time

import aiohttp
import av
import numpy as np
import pytest

from services.common.config import GatewayAuthConfig, GatewayBroadcastConfig
from services.gateway import hls
from services.gateway.access import Access
from services.gateway.broadcast import Broadcast, split_init_segment
from services.vae.mux import FragmentedMP4Muxer
from tests.gateway.fakes import FakeBehaviour, FakePipeline, Transcript, read_until, running_gateway, small_config, \
    ws_url

pytestmark = pytest.mark.cpu

FPS = 24
RATE = 32000
W, H = 64, 48
TIMING = hls.HlsTiming(part_target_s=1.5, target_duration_s=5)
# chunk frames of the tiny system's first two requests (the first phase in three chunks), as (request, frames)
TWO_REQUESTS = [(0, 5), (0, 12), (0, 17), (0, 34), (0, 34), (0, 17), (1, 34), (1, 34), (1, 34), (1, 17)]
DIRECTOR = "director-token-0123456789"
VIEWER = "viewer-token-0123456789ab"


def _broadcast(layout: list[tuple[int, int]], *, trailer: bool = False, retain_s: float = 60.0) -> Broadcast:
    """A broadcast fed real fMP4 chunks of the given (request, frames) layout, then the trailer if asked."""
    broadcast = Broadcast("s", GatewayBroadcastConfig(retain_s=retain_s), fps=FPS)
    muxer = FragmentedMP4Muxer(W, H, fps=FPS, sample_rate=RATE)
    phases: dict[int, int] = {}
    for index, (request, frames) in enumerate(layout):
        samples = frames * RATE // FPS
        data = muxer.encode(np.full((frames, H, W, 3), index * 20 % 255, np.uint8),
                            np.zeros((2, samples), np.float32))
        phase = phases[request] = phases.get(request, -1) + 1
        broadcast.publish({"transport_chunk_index": index, "kind": "media", "request_index": request,
                           "phase_index": phase, "num_frames": frames, "num_audio_samples": samples,
                           "audio_sample_rate": RATE}, data)
    if trailer:
        broadcast.publish({"transport_chunk_index": len(layout), "kind": "trailer",
                           "request_index": layout[-1][0] + 1, "phase_index": 0, "num_frames": 0,
                           "num_audio_samples": 0, "audio_sample_rate": RATE}, muxer.close())
        broadcast.end(chunks=len(layout) + 1, stopped=False)
    return broadcast


def _tags(text: str) -> list[tuple[str, str]]:
    """(tag, value) per line; a URI line is ('URI', line)."""
    out = []
    for line in text.splitlines():
        tag, _, value = line.partition(":") if line.startswith("#") else ("URI", "", line)
        out.append((tag, value))
    return out


def _attrs(value: str) -> dict[str, str]:
    return {k: v.strip('"') for k, v in re.findall(r'([A-Z-]+)=("[^"]*"|[^,]*)', value)}


def check_ll_hls_rules(text: str) -> None:
    """The RFC 8216bis rules a low-latency media playlist must keep (as far as this server writes them)."""
    tags = _tags(text)
    assert tags[0] == ("#EXTM3U", "") and int(dict(tags)["#EXT-X-VERSION"]) >= 9
    target = int(dict(tags)["#EXT-X-TARGETDURATION"])
    part_target = float(_attrs(dict(tags)["#EXT-X-PART-INF"])["PART-TARGET"])
    control = _attrs(dict(tags)["#EXT-X-SERVER-CONTROL"])
    assert control["CAN-BLOCK-RELOAD"] == "YES" and float(control["PART-HOLD-BACK"]) >= 3 * part_target
    assert [t for t, _ in tags].index("#EXT-X-MAP") < min(
        [i for i, (t, _) in enumerate(tags) if t in ("#EXT-X-PART", "#EXTINF")], default=len(tags))
    for tag, value in tags:
        if tag == "#EXT-X-PART":
            attrs = _attrs(value)
            assert float(attrs["DURATION"]) <= part_target and attrs["INDEPENDENT"] == "YES"
        if tag == "#EXTINF":
            assert round(float(value.rstrip(","))) <= target
    ended = "#EXT-X-ENDLIST" in dict(tags)
    assert ended != ("#EXT-X-PRELOAD-HINT" in dict(tags)), "a live list hints its next part, an ended one does not"


# ---------------------------------------------------------------- the playlist (pure)

def test_each_request_is_a_segment_of_its_chunks_and_the_open_one_lists_parts_only():
    text = hls.build_playlist(_broadcast(TWO_REQUESTS), TIMING).render()
    check_ll_hls_rules(text)
    tags = _tags(text)
    assert dict(tags)["#EXT-X-MEDIA-SEQUENCE"] == "0" and '#EXT-X-MAP:URI="init.mp4"' in text
    parts = [_attrs(v) for t, v in tags if t == "#EXT-X-PART"]
    assert [p["URI"] for p in parts] == [f"part/{i}.m4s" for i in range(10)]
    assert [float(p["DURATION"]) for p in parts] == [round(f / FPS, 3) for _, f in TWO_REQUESTS]
    assert [v for t, v in tags if t == "URI"] == ["seg/0.m4s"]  # request 1 may still get parts: no URI yet
    assert [v for t, v in tags if t == "#EXTINF"] == [f"{119 / FPS:.3f},"]
    assert _attrs(dict(tags)["#EXT-X-PRELOAD-HINT"]) == {"TYPE": "PART", "URI": "part/10.m4s"}
    assert "#EXT-X-ENDLIST" not in text


def test_the_trailer_joins_the_last_segment_and_the_ended_list_closes():
    broadcast = _broadcast(TWO_REQUESTS, trailer=True)
    playlist = hls.build_playlist(broadcast, TIMING)
    text = playlist.render()
    check_ll_hls_rules(text)
    assert text.endswith("#EXT-X-ENDLIST\n") and "PRELOAD-HINT" not in text
    last = playlist.segments[-1]
    assert [s.msn for s in playlist.segments] == [0, 1] and [p.index for p in last.parts] == [6, 7, 8, 9, 10]
    trailer = last.parts[-1].duration_s
    assert 0 < trailer <= 3 * 1024 / RATE  # its AAC flush, read from its boxes (the broadcast counts 0 s)
    assert f"#EXTINF:{(119 / FPS + trailer):.3f}," in text and text.count("#EXTINF") == 2
    assert "#EXT-X-PART:" not in text  # an ended list is whole segments: players end at its last one


def test_the_window_slides_by_whole_requests_and_old_segments_drop_their_parts():
    layout = [(r, 6) for r in range(8) for _ in range(4)]  # 1 s requests
    broadcast = _broadcast(layout, retain_s=5.1)
    assert broadcast.chunks[0].index > 0 and broadcast.chunks[0].phase_index != 0  # a cut request at the front
    playlist = hls.build_playlist(broadcast, hls.HlsTiming(0.5, 1))
    text = playlist.render()
    check_ll_hls_rules(text)
    first = playlist.segments[0]
    assert int(dict(_tags(text))["#EXT-X-MEDIA-SEQUENCE"]) == first.msn == broadcast.chunks[0].request_index + 1
    assert all(len(s.parts) == 4 for s in playlist.segments)
    assert f"part/{first.parts[0].index}.m4s" not in text  # more than 3 target durations from the end
    assert f"seg/{first.msn}.m4s" in text and "part/31.m4s" in text


def test_a_chunk_longer_than_the_part_target_raises_it():
    playlist = hls.build_playlist(_broadcast([(0, 48), (0, 12)]), TIMING)
    assert playlist.part_target_s == 2.0
    check_ll_hls_rules(playlist.render())


def test_a_token_rides_on_every_uri():
    text = hls.build_playlist(_broadcast(TWO_REQUESTS), TIMING).render(token="a b/c")
    uris = re.findall(r'URI="([^"]+)"', text) + [v for t, v in _tags(text) if t == "URI"]
    assert len(uris) == 13 and all(u.endswith("?token=a%20b%2Fc") for u in uris)


def test_blocking_requests_parse_reach_and_wait_as_the_spec_says():
    assert hls.parse_blocking_request({}) is None
    assert hls.parse_blocking_request({"_HLS_msn": "3", "_HLS_part": "1"}) == hls.BlockingRequest(3, 1)
    for bad in ({"_HLS_part": "1"}, {"_HLS_msn": "-1"}, {"_HLS_msn": "1", "_HLS_part": "x"}):
        with pytest.raises(hls.HlsRequestError) as caught:
            hls.parse_blocking_request(bad)
        assert caught.value.status == 400
    live = hls.build_playlist(_broadcast(TWO_REQUESTS), TIMING)  # newest part: (1, 3)
    limit = TIMING.advance_part_limit
    assert live.satisfies(hls.BlockingRequest(1, 3)) and not live.satisfies(hls.BlockingRequest(1, 4))
    assert live.satisfies(hls.BlockingRequest(0, 9))  # past the parts of a complete segment: its successor's part 0
    assert live.satisfies(hls.BlockingRequest(0)) and not live.satisfies(hls.BlockingRequest(1))
    for fine in (hls.BlockingRequest(1, 3 + limit), hls.BlockingRequest(2, limit - 1), hls.BlockingRequest(3)):
        live.check_reach(fine, limit)
    for too_far in (hls.BlockingRequest(4), hls.BlockingRequest(1, 4 + limit), hls.BlockingRequest(2, limit)):
        with pytest.raises(hls.HlsRequestError, match="past the newest"):
            live.check_reach(too_far, limit)
    ended = hls.build_playlist(_broadcast(TWO_REQUESTS, trailer=True), TIMING)
    assert ended.satisfies(hls.BlockingRequest(9, 0))
    ended.check_reach(hls.BlockingRequest(9, 0), limit)


# ---------------------------------------------------------------- the routes (in-process gateway)

async def _start(http: aiohttp.ClientSession, server, transcript: Transcript, **start) -> dict:
    ws = await http.ws_connect(ws_url(server))
    await ws.send_json({"type": "session.start", "prompt": "p", **start})
    video_start = await read_until(ws, transcript, until="video.start")
    video_start["ws"] = ws
    return video_start


async def _chunks(ws, transcript: Transcript, count: int) -> None:
    """Read frames until `count` chunks' bytes are in."""
    while len(transcript.binaries) < count:
        msg = await ws.receive(timeout=10)
        if msg.type == aiohttp.WSMsgType.BINARY:
            transcript.binaries.append(msg.data)
        elif msg.type == aiohttp.WSMsgType.TEXT:
            transcript.texts.append(msg.json())
        else:
            raise AssertionError(f"the websocket ended after {len(transcript.binaries)} chunks: {msg}")


async def test_a_blocking_reload_and_the_hinted_part_wait_for_the_part_and_wake_when_it_arrives():
    # The fake holds before request 1 until a prompt update arrives: nothing is published in between.
    pipeline = FakePipeline(FakeBehaviour(num_chunks=8))
    async with running_gateway(small_config(), pipeline) as server, aiohttp.ClientSession() as http:
        transcript = Transcript()
        start = await _start(http, server, transcript, extra_params={"hold_for_prompt": True})
        ws, base = start["ws"], server.make_url(start["hls_url"].rsplit("/", 1)[0])
        await _chunks(ws, transcript, 4)
        async with http.get(f"{base}/playlist.m3u8", params={"_HLS_msn": "3"}) as reply:
            assert reply.status == 400 and (await reply.json())["code"] == "hls_too_far_ahead"
        reload = asyncio.ensure_future(http.get(f"{base}/playlist.m3u8", params={"_HLS_msn": "1", "_HLS_part": "0"}))
        hinted = asyncio.ensure_future(http.get(f"{base}/part/4.m4s"))
        await asyncio.sleep(0.5)
        assert not reload.done() and not hinted.done()
        woken_at = time.monotonic()
        await ws.send_json({"type": "session.interaction", "interaction": {"event": {"prompt": "go on"}}})
        reply = await asyncio.wait_for(reload, 5)
        text = await reply.text()
        assert reply.status == 200 and time.monotonic() - woken_at < 2
        assert 'URI="part/4.m4s"' in text and reply.headers["Cache-Control"] == "no-cache"
        check_ll_hls_rules(text)
        part = await asyncio.wait_for(hinted, 5)
        await _chunks(ws, transcript, 5)
        assert part.status == 200 and await part.read() == transcript.binaries[4]
        await ws.close()


async def test_media_answers_are_cdn_cacheable_with_their_types_and_misses_are_named_404s():
    pipeline = FakePipeline(FakeBehaviour(num_chunks=8))
    async with running_gateway(small_config(), pipeline) as server, aiohttp.ClientSession() as http:
        transcript = Transcript()
        start = await _start(http, server, transcript)
        await read_until(start["ws"], transcript, until="session.done")
        await start["ws"].close()
        base = server.make_url(start["hls_url"].rsplit("/", 1)[0])
        init, first = split_init_segment(transcript.binaries[0])
        async with http.get(f"{base}/playlist.m3u8") as reply:
            assert reply.headers["Content-Type"].startswith("application/vnd.apple.mpegurl")
            assert reply.headers["Cache-Control"] == "public, max-age=60"  # ended: it no longer changes
            check_ll_hls_rules(await reply.text())
        expected = {"init.mp4": (init, "video/mp4"), "part/0.m4s": (first, "video/iso.segment"),
                    "part/5.m4s": (transcript.binaries[5], "video/iso.segment"),
                    "seg/0.m4s": (first + b"".join(transcript.binaries[1:4]), "video/iso.segment")}
        for name, (body, kind) in expected.items():
            async with http.get(f"{base}/{name}") as reply:
                assert reply.status == 200 and await reply.read() == body, name
                assert reply.headers["Content-Type"] == kind
                assert reply.headers["Cache-Control"] == "public, max-age=86400, immutable"
        for name, code in (("part/99.m4s", "unknown_part"), ("seg/7.m4s", "unknown_segment")):
            async with http.get(f"{base}/{name}") as reply:
                assert reply.status == 404 and (await reply.json())["code"] == code
                assert reply.headers["Cache-Control"] == "no-store"
        async with http.get(server.make_url("/v1/realtime/video/hls/nobody/playlist.m3u8")) as reply:
            assert reply.status == 404 and (await reply.json())["code"] == "unknown_session"


@pytest.mark.slow
async def test_a_wait_for_media_that_does_not_come_ends_in_503():
    config = small_config(hls_part_target_s=0.5, hls_target_duration_s=1)  # waits end after 3 s
    async with running_gateway(config, FakePipeline(FakeBehaviour(num_chunks=8))) as server, \
            aiohttp.ClientSession() as http:
        transcript = Transcript()
        start = await _start(http, server, transcript, extra_params={"hold_for_prompt": True})
        await _chunks(start["ws"], transcript, 4)
        began = time.monotonic()
        async with http.get(server.make_url(start["hls_url"]), params={"_HLS_msn": "1", "_HLS_part": "0"}) as reply:
            assert reply.status == 503 and (await reply.json())["code"] == "hls_wait_timeout"
            assert reply.headers["Retry-After"] == "1"
        assert 2.9 < time.monotonic() - began < 5
        await start["ws"].close()


async def test_hls_needs_a_viewer_token_and_a_query_token_rides_into_the_listed_uris(tmp_path):
    (tmp_path / "t").write_text(DIRECTOR)
    auth = GatewayAuthConfig(enabled=True, tokens_file=str(tmp_path / "t"))
    access = Access(auth, [DIRECTOR], viewer_tokens=[VIEWER])
    async with running_gateway(small_config(auth=auth), FakePipeline(FakeBehaviour(num_chunks=8)),
                               access=access) as server, aiohttp.ClientSession() as http:
        transcript = Transcript()
        ws = await http.ws_connect(ws_url(server), headers={"Authorization": f"Bearer {DIRECTOR}"})
        await ws.send_json({"type": "session.start", "prompt": "p"})
        start = await read_until(ws, transcript, until="video.start")
        await read_until(ws, transcript, until="session.done")
        await ws.close()
        url = server.make_url(start["hls_url"])
        async with http.get(url) as reply:
            assert reply.status == 401 and reply.headers["WWW-Authenticate"] == "Bearer"
        async with http.get(url, headers={"Authorization": f"Bearer {VIEWER}"}) as reply:
            assert reply.status == 200 and "token=" not in await reply.text()
        async with http.get(url, params={"token": VIEWER}) as reply:
            text = await reply.text()
        uris = re.findall(r'URI="([^"]+)"', text) + [line for line in text.splitlines() if line.startswith("seg/")]
        assert uris and all(u.endswith(f"?token={VIEWER}") for u in uris)
        assert uris[1] == f"seg/0.m4s?token={VIEWER}"
        async with http.get(url.join(aiohttp.client.URL(uris[1]))) as reply:
            first_request = split_init_segment(transcript.binaries[0])[1] + b"".join(transcript.binaries[1:4])
            assert reply.status == 200 and await reply.read() == first_request


async def test_pages_on_allowed_origins_get_cors_headers():
    config = small_config(auth=GatewayAuthConfig(allowed_origins=("https://player.example",)))
    async with running_gateway(config, FakePipeline(FakeBehaviour(num_chunks=4))) as server, \
            aiohttp.ClientSession() as http:
        transcript = Transcript()
        start = await _start(http, server, transcript)
        await read_until(start["ws"], transcript, until="session.done")
        await start["ws"].close()
        url = server.make_url(start["hls_url"])
        async with http.get(url, headers={"Origin": "https://player.example"}) as reply:
            assert reply.headers["Access-Control-Allow-Origin"] == "https://player.example"
            assert reply.headers["Vary"] == "Origin"
        async with http.get(url, headers={"Origin": "https://elsewhere.example"}) as reply:
            assert reply.status == 200 and "Access-Control-Allow-Origin" not in reply.headers
        async with http.options(url, headers={"Origin": "https://player.example",
                                              "Access-Control-Request-Headers": "authorization"}) as reply:
            assert reply.status == 204 and "Authorization" in reply.headers["Access-Control-Allow-Headers"]


@pytest.mark.slow
async def test_ffmpegs_hls_demuxer_reads_the_playlist_while_the_session_runs():
    pipeline = FakePipeline(FakeBehaviour(num_chunks=24, frames_per_chunk=6, chunk_delay_s=0.1))
    async with running_gateway(small_config(), pipeline) as server, aiohttp.ClientSession() as http:
        transcript = Transcript()
        start = await _start(http, server, transcript)
        began, opened = time.monotonic(), {}

        def play() -> tuple[int, int]:
            container = av.open(str(server.make_url(start["hls_url"])), options={"live_start_index": "0"})
            opened["at"] = time.monotonic() - began
            frames = samples = 0
            for frame in container.decode():
                if isinstance(frame, av.VideoFrame):
                    frames += 1
                else:
                    samples += frame.samples
            return frames, samples

        reading = asyncio.ensure_future(asyncio.to_thread(play))
        await read_until(start["ws"], transcript, until="session.done")
        done_at = time.monotonic() - began
        frames, samples = await asyncio.wait_for(reading, 30)
        await start["ws"].close()
    fed = 24 * 6 * RATE // FPS
    assert opened["at"] < done_at, "the demuxer opened the playlist only after the session ended"
    assert frames == 24 * 6
    assert fed <= samples < fed + 1024  # all the audio, the last AAC frame's padding at most
