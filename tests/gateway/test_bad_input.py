"""Bad input: each case gets an `error` with its own code, the server stays healthy, others continue.

Which cases close the connection is the table in `services/gateway/protocol.py`'s docstring.
"""
import asyncio

import aiohttp
import pytest

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

START = {"type": "session.start", "prompt": "fine prompt"}
HUGE_INT = "9" * 400  # valid JSON, a Python int, too large for a float
TOO_LONG_INT = "1" * 5000  # valid JSON, above Python's int-string conversion limit


async def assert_server_recovers(server, pipeline: FakePipeline | None = None) -> None:
    """Health is OK with no leaked session, and a fresh (short) session runs to completion."""
    behaviour = (pipeline or server.fake).behaviour
    behaviour.num_chunks, behaviour.chunk_delay_s, behaviour.cancel_delay_s = 2, 0.0, 0.0
    for _ in range(100):
        status, report = await healthz(server)
        if report["sessions_active"] == 0 and report["sessions_queued"] == 0:
            break
        await asyncio.sleep(0.05)
    assert status == 200 and report["sessions_active"] == 0 and report["sessions_queued"] == 0
    await run_good_session(server)


@pytest.fixture
async def server():
    pipeline = FakePipeline(FakeBehaviour(num_chunks=6, chunk_delay_s=0.05))
    async with running_gateway(small_config(), pipeline) as srv:
        srv.fake = pipeline
        yield srv


async def rejected_start(server, frame, *, binary: bool = False) -> tuple[dict | None, Transcript]:
    """Send one frame as the first message and read until the server closes."""
    t = Transcript()
    async with aiohttp.ClientSession() as http, http.ws_connect(ws_url(server)) as ws:
        if binary:
            await ws.send_bytes(frame)
        elif isinstance(frame, str):
            await ws.send_str(frame)
        else:
            await ws.send_json(frame)
        error = await read_until(ws, t, until="error")
        await read_until(ws, t)
    return error, t


async def error_during_session(server, frame, *, binary: bool = False) -> tuple[dict, dict, Transcript]:
    """Start a session, send one bad frame while it streams; return (error, done, transcript)."""
    t = Transcript()
    async with aiohttp.ClientSession() as http, http.ws_connect(ws_url(server)) as ws:
        await ws.send_json(START)
        await read_until(ws, t, until="video.chunk_metadata")
        if binary:
            await ws.send_bytes(frame)
        elif isinstance(frame, str):
            await ws.send_str(frame)
        else:
            await ws.send_json(frame)
        error = await read_until(ws, t, until="error")
        done = await read_until(ws, t, until="session.done")
    assert done is not None and done["stopped"] is False and done["chunks"] >= 6, "session must continue"
    return error, done, t


# ------------------------------------------------------------------ connection stays open


async def test_non_json_text_before_start_keeps_connection_usable(server):
    t = Transcript()
    async with aiohttp.ClientSession() as http, http.ws_connect(ws_url(server)) as ws:
        await ws.send_str("this is not json {")
        error = await read_until(ws, t, until="error")
        await ws.send_json(START)
        done = await read_until(ws, t, until="session.done")
    assert error["code"] == "invalid_json" and error["fault"] == "client" and done["stopped"] is False
    await assert_server_recovers(server)


async def test_non_json_text_during_session(server):
    error, _, _ = await error_during_session(server, "{{{")
    assert error["code"] == "invalid_json" and error["request_id"].startswith("video_stream-")
    await assert_server_recovers(server)


async def test_binary_frame_from_client(server):
    error, _, _ = await error_during_session(server, b"\x00\x01binary", binary=True)
    assert error["code"] == "binary_not_allowed"
    await assert_server_recovers(server)


async def test_unknown_message_type(server):
    error, _, _ = await error_during_session(server, {"type": "session.teleport"})
    assert error["code"] == "unknown_type" and "session.teleport" in error["message"]
    await assert_server_recovers(server)


async def test_interaction_missing_event(server):
    error, _, _ = await error_during_session(server, {"type": "session.interaction", "interaction": {"event_id": "a"}})
    assert error["code"] == "missing_field" and error["event_id"] == "a"
    await assert_server_recovers(server)


async def test_interaction_prompt_of_wrong_type(server):
    error, _, _ = await error_during_session(
        server, {"type": "session.interaction", "interaction": {"event": {"prompt": ["not", "text"]}}})
    assert error["code"] == "invalid_type"
    await assert_server_recovers(server)


async def test_oversize_interaction(server):
    big = {"type": "session.interaction", "interaction": {"event": {"prompt": "p"}}, "pad": "x" * 5000}
    error, _, _ = await error_during_session(server, big)
    assert error["code"] == "message_too_large"
    await assert_server_recovers(server)


async def test_empty_prompt_update(server):
    error, _, _ = await error_during_session(
        server, {"type": "session.interaction", "interaction": {"event_id": "e", "event": {"prompt": " "}}})
    assert error["code"] == "empty_prompt" and error["event_id"] == "e"
    await assert_server_recovers(server)


async def test_second_session_start(server):
    error, done, t = await error_during_session(server, START)
    assert error["code"] == "session_already_started"
    assert len(t.of_type("video.start")) == 1 and len(server.fake.records) == 1
    await assert_server_recovers(server)


async def test_duplicate_event_id(server):
    t = Transcript()
    update = {"type": "session.interaction", "interaction": {"event_id": "dup", "event": {"prompt": "one"}}}
    async with aiohttp.ClientSession() as http, http.ws_connect(ws_url(server)) as ws:
        await ws.send_json(START)
        await read_until(ws, t, until="video.chunk_metadata")
        await ws.send_json(update)
        await ws.send_json(update)
        error = await read_until(ws, t, until="error")
        done = await read_until(ws, t, until="session.done")
    assert error["code"] == "event_id_conflict" and error["event_id"] == "dup"
    assert [q["event_id"] for q in t.of_type("session.interaction.queued")] == ["dup"]
    assert server.fake.records[0].updates == [("dup", "one")] and done["stopped"] is False
    await assert_server_recovers(server)


async def test_interaction_after_stop(server):
    server.fake.behaviour.cancel_delay_s = 0.2
    t = Transcript()
    async with aiohttp.ClientSession() as http, http.ws_connect(ws_url(server)) as ws:
        await ws.send_json(START)
        await read_until(ws, t, until="video.chunk_metadata")
        await ws.send_json({"type": "session.stop"})
        await ws.send_json({"type": "session.interaction",
                            "interaction": {"event_id": "late", "event": {"prompt": "too late"}}})
        error = await read_until(ws, t, until="error")
        done = await read_until(ws, t, until="session.done")
    assert error["code"] == "session_stopped" and error["event_id"] == "late"
    assert done["stopped"] is True and server.fake.records[0].updates == []
    await assert_server_recovers(server)


async def test_interaction_before_start(server):
    t = Transcript()
    async with aiohttp.ClientSession() as http, http.ws_connect(ws_url(server)) as ws:
        await ws.send_json({"type": "session.interaction", "interaction": {"event": {"prompt": "early"}}})
        error = await read_until(ws, t, until="error")
        await ws.send_json(START)
        done = await read_until(ws, t, until="session.done")
    assert error["code"] == "session_not_started" and done is not None
    await assert_server_recovers(server)


# ------------------------------------------------------------------ rejected session.start closes


@pytest.mark.parametrize("frame,code", [
    pytest.param({"type": "session.start"}, "missing_field", id="missing-prompt"),
    pytest.param({"type": "session.start", "prompt": "p", "seed": "seven"}, "invalid_type", id="wrong-type-seed"),
    pytest.param({"type": "session.start", "prompt": "p", "width": 640, "height": 480}, "canvas_not_allowed",
                 id="canvas-not-allowed"),
    pytest.param({"type": "session.start", "prompt": ""}, "empty_prompt", id="empty-prompt"),
    pytest.param({"type": "session.start", "prompt": "x" * 201}, "prompt_too_long", id="over-long-prompt"),
    pytest.param({"type": "session.start", "prompt": "p", "model": "other"}, "model_mismatch", id="model"),
    pytest.param({"type": "session.start", "prompt": "p", "fps": 30}, "fps_not_allowed", id="fps"),
    pytest.param({"type": "session.start", "prompt": "p", "format": "webm"}, "unsupported_format", id="format"),
    pytest.param({"type": "session.start", "prompt": "p", "pad": "x" * 70000}, "message_too_large",
                 id="oversize-start"),
])
async def test_rejected_start_closes_with_named_code(server, frame, code):
    error, t = await rejected_start(server, frame)
    assert error["code"] == code and error["message"] and error["fault"] == "client"
    assert t.close_code == (1009 if code == "message_too_large" else 1008)
    assert not t.of_type("video.start") and server.fake.records == []
    await assert_server_recovers(server)


async def test_every_rejected_start_is_counted_as_a_rejected_session(server):
    # Starts refused by the parser (a negative seed, a missing prompt) were missing from
    # vitascope_sessions_total{outcome="rejected"}, which counted only the deployment checks (canvas, model).
    for frame in ({"type": "session.start", "prompt": "p", "seed": -1}, {"type": "session.start"},
                  {"type": "session.start", "prompt": "p", "width": 10, "height": 10}):
        await rejected_start(server, frame)
    async with aiohttp.ClientSession() as http, http.get(server.make_url("/metrics")) as resp:
        text = await resp.text()
    assert 'vitascope_sessions_total{outcome="rejected"} 3.0' in text, text


async def test_no_session_start_in_time():
    pipeline = FakePipeline(FakeBehaviour(num_chunks=2))
    async with running_gateway(small_config(start_timeout_s=0.3), pipeline) as server:
        t = Transcript()
        async with aiohttp.ClientSession() as http, http.ws_connect(ws_url(server)) as ws:
            error = await read_until(ws, t, until="error")
            await read_until(ws, t)
        assert error["code"] == "start_timeout" and t.close_code == 1008
        await assert_server_recovers(server, pipeline)


async def test_frame_above_transport_limit_closes_with_1009(server):
    t = Transcript()
    async with aiohttp.ClientSession() as http, http.ws_connect(ws_url(server)) as ws:
        await ws.send_str("x" * (200 * 1024))
        await read_until(ws, t)
    assert t.close_code == 1009 and t.texts == []
    await assert_server_recovers(server)


async def test_queue_full():
    pipeline = FakePipeline(FakeBehaviour(num_chunks=None, chunk_delay_s=0.02))
    async with running_gateway(small_config(queue_limit=0), pipeline) as server:
        t1 = Transcript()
        async with aiohttp.ClientSession() as http, http.ws_connect(ws_url(server)) as first:
            await first.send_json(START)
            await read_until(first, t1, until="video.chunk_metadata")
            error, t2 = await rejected_start(server, START)
            assert error["code"] == "queue_full" and t2.close_code == 1013
            await first.send_json({"type": "session.stop"})
            assert (await read_until(first, t1, until="session.done"))["stopped"] is True
        await assert_server_recovers(server, pipeline)


async def test_other_sessions_continue_while_a_client_misbehaves(server):
    good = Transcript()
    async with aiohttp.ClientSession() as http, http.ws_connect(ws_url(server)) as ws:
        await ws.send_json(START)
        await read_until(ws, good, until="video.chunk_metadata")
        rejected, _ = await rejected_start(server, {"type": "session.start", "prompt": ""})
        async with http.ws_connect(ws_url(server)) as bad:
            await bad.send_str("garbage")
            await bad.send_bytes(b"\xff")
            await bad.send_json({"type": "nope"})
            noise = Transcript()
            for _ in range(3):
                await read_until(bad, noise, until="error")
        done = await read_until(ws, good, until="session.done")
    assert rejected["code"] == "empty_prompt"
    assert [e["code"] for e in noise.of_type("error")] == ["invalid_json", "binary_not_allowed", "unknown_type"]
    assert done["stopped"] is False and done["chunks"] == len(good.binaries) >= 6
    assert not good.of_type("error")
    await assert_server_recovers(server)


async def test_too_many_pending_updates():
    pipeline = FakePipeline(FakeBehaviour(num_chunks=6, chunk_delay_s=0.2))
    async with running_gateway(small_config(max_pending_updates=2), pipeline) as srv:
        srv.fake = pipeline
        t1, t2 = Transcript(), Transcript()
        async with aiohttp.ClientSession() as http, http.ws_connect(ws_url(srv)) as first, \
                http.ws_connect(ws_url(srv)) as second:
            await first.send_json(START)
            await read_until(first, t1, until="video.start")
            await second.send_json(START)
            await read_until(second, t2, until="session.queued")  # waiting: its updates pile up unforwarded
            for i in range(3):
                await second.send_json({"type": "session.interaction",
                                        "interaction": {"event_id": f"u{i}", "event": {"prompt": f"p{i}"}}})
            error = await read_until(second, t2, until="error")
            await second.send_json({"type": "session.stop"})
            await first.send_json({"type": "session.stop"})
            await read_until(second, t2, until="session.done")
        assert error["code"] == "too_many_updates" and error["event_id"] == "u2"
        await assert_server_recovers(srv)


@pytest.mark.parametrize("bad_frame", [
    f'{{"type": "session.start", "prompt": "p", "guidance_scale": {HUGE_INT}}}',
    f'{{"type": "session.ping", "n": {TOO_LONG_INT}}}',
])
async def test_unparsable_number_during_a_session_is_an_error_and_the_session_continues(bad_frame):
    pipeline = FakePipeline(FakeBehaviour(num_chunks=6, chunk_delay_s=0.05))
    async with running_gateway(small_config(max_interaction_bytes=64 * 1024), pipeline) as server:
        t = Transcript()
        async with aiohttp.ClientSession() as http, http.ws_connect(ws_url(server)) as ws:
            await ws.send_json({"type": "session.start", "prompt": "fine prompt"})
            await read_until(ws, t, until="video.chunk_metadata")
            await ws.send_str(bad_frame)
            error = await read_until(ws, t, until="error")
            done = await read_until(ws, t, until="session.done")
    assert error is not None and error["code"] in ("invalid_type", "invalid_value", "invalid_json",
                                                   "session_already_started")
    assert done is not None and done["stopped"] is False and done["chunks"] >= 6
