"""Behaviour a client written for vLLM-Omni's `/v1/realtime/video` relies on (its handler and docs as reference)."""
import json

import aiohttp
import pytest

from services.gateway.protocol import MessageLimits, SessionInteraction, parse_client_text
from tests.gateway.fakes import (
    FakeBehaviour,
    FakePipeline,
    Transcript,
    read_until,
    running_gateway,
    small_config,
    ws_url,
)

pytestmark = pytest.mark.cpu

LIMITS = MessageLimits(max_start_bytes=4000, max_interaction_bytes=500, max_prompt_chars=100)


def parse(body) -> object:
    return parse_client_text(json.dumps(body), LIMITS)


def test_sampling_params_keys_that_are_no_request_field_fold_into_extra_params():
    # vLLM-Omni moves every sampling_params key that is not a VideoGenerationRequest field into extra_params
    # (after the top-level extra_params), so media-time pacing can be asked for there.
    msg = parse({"type": "session.start", "prompt": "p", "extra_params": {"a": 1, "b": 1},
                 "sampling_params": {"seed": 3, "pace_to_media_time": True, "pacing_lead_seconds": 0.25, "b": 2}})
    assert msg.seed == 3
    assert msg.pacing is not None and msg.pacing.lead_s == 0.25
    assert dict(msg.extra_params) == {"a": 1, "b": 2}


def test_size_video_params_and_seconds_resolve_like_video_generation_request():
    msg = parse({"type": "session.start", "prompt": "p", "size": "48x64", "width": 64, "height": 48})
    assert (msg.width, msg.height) == (48, 64)  # size wins over width/height
    msg = parse({"type": "session.start", "prompt": "p",
                 "video_params": {"width": 48, "height": 64, "fps": 24, "num_frames": 30}})
    assert (msg.width, msg.height, msg.fps, msg.num_frames) == (48, 64, 24, 30)
    msg = parse({"type": "session.start", "prompt": "p", "width": 64, "video_params": {"width": 48}})
    assert msg.width == 64  # a top-level field wins over video_params
    assert parse({"type": "session.start", "prompt": "p", "seconds": "10"}).num_frames == 240
    assert parse({"type": "session.start", "prompt": "p", "seconds": "10", "num_frames": 5}).num_frames == 5


def test_integral_float_transition_chunks_is_accepted():
    msg = parse({"type": "session.interaction",
                 "interaction": {"event_id": "e", "event": {"prompt": "p"}, "transition_chunks": 2.0}})
    assert msg == SessionInteraction(prompt="p", event_id="e", transition_chunks=2)


async def test_event_id_of_a_failed_interaction_may_be_reused():
    pipeline = FakePipeline(FakeBehaviour(num_chunks=6, chunk_delay_s=0.05, reject_prompts=frozenset({"bad"})))
    async with running_gateway(small_config(), pipeline) as server:
        t = Transcript()
        async with aiohttp.ClientSession() as http, http.ws_connect(ws_url(server)) as ws:
            await ws.send_json({"type": "session.start", "prompt": "p"})
            for prompt in ("bad", "ok"):
                await ws.send_json({"type": "session.interaction",
                                    "interaction": {"event_id": "x", "event": {"prompt": prompt}}})
                if prompt == "bad":
                    error = await read_until(ws, t, until="error")
            queued = await read_until(ws, t, until="session.interaction.queued")
            await read_until(ws, t, until="session.done")
    assert error["code"] == "interaction_failed" and error["event_id"] == "x"
    assert queued is not None and queued["event_id"] == "x"
    assert [e for e in t.of_type("error") if e is not error] == []


async def test_num_frames_ends_the_session_after_the_requests_that_hold_them():
    # TaoMate in vLLM-Omni publishes whole 5 s requests (124 frames, then 119 each, 4 phases per request) until
    # num_frames is covered, then ends the stream: 125 frames take 2 requests, i.e. 8 phases.
    pipeline = FakePipeline(FakeBehaviour(num_chunks=None, chunk_delay_s=0.01))
    async with running_gateway(small_config(), pipeline) as server:
        t = Transcript()
        async with aiohttp.ClientSession() as http, http.ws_connect(ws_url(server)) as ws:
            await ws.send_json({"type": "session.start", "prompt": "p", "num_frames": 125})
            done = await read_until(ws, t, until="session.done", timeout=5.0)
            await read_until(ws, t)
    metas = t.of_type("video.chunk_metadata")
    assert [m["kind"] for m in metas] == ["media"] * 8 + ["trailer"]
    assert done == {"type": "session.done", "request_id": t.texts[0]["request_id"], "chunks": 9, "stopped": False}
    assert t.texts[0]["config"]["num_frames"] == 125
    assert pipeline.records[0].cancelled and t.close_code == 1000


async def test_trailer_metadata_has_no_generation_chunk_index():
    pipeline = FakePipeline(FakeBehaviour(num_chunks=2))
    async with running_gateway(small_config(), pipeline) as server:
        t = Transcript()
        async with aiohttp.ClientSession() as http, http.ws_connect(ws_url(server)) as ws:
            await ws.send_json({"type": "session.start", "prompt": "p"})
            await read_until(ws, t, until="session.done")
    metas = t.of_type("video.chunk_metadata")
    assert [(m["kind"], m["generation_chunk_index"]) for m in metas] == [("media", 0), ("media", 1), ("trailer", None)]
