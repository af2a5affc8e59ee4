"""End-to-end sessions over a real websocket against the fake pipeline (real fMP4 bytes)."""
import asyncio
import io
import json
import logging

import aiohttp
import av
import pytest

from services.common.logging_setup import JsonFormatter
from services.gateway.pipeline import BackendFailed, BackendUnavailable, InvalidRequest
from services.gateway.protocol import PacingSettings
from services.gateway.service import MediaPacer
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


async def wait_for_health(server, **expected) -> dict:
    """Poll /healthz until the given fields match (or fail after 5 s)."""
    for _ in range(100):
        _, report = await healthz(server)
        if all(report[k] == v for k, v in expected.items()):
            return report
        await asyncio.sleep(0.05)
    raise AssertionError(f"health never reached {expected}: {report}")


async def test_session_streams_ordered_chunks_that_decode():
    pipeline = FakePipeline(FakeBehaviour(num_chunks=4, frames_per_chunk=6))
    async with running_gateway(small_config(), pipeline) as server:
        t = await run_good_session(server, "a red bar")
    start = t.texts[0]
    assert start["type"] == "video.start" and start["request_id"].startswith("video_stream-")
    assert start["format"] == "m4s" and start["config"]["width"] == 64 and start["config"]["prompt"] == "a red bar"
    metas = t.of_type("video.chunk_metadata")
    # every metadata message is immediately followed by exactly one binary frame
    body = [x for x in t.order if x != "text:video.start"]
    assert body == ["text:video.chunk_metadata", "binary"] * len(metas) + ["text:session.done"]
    assert [m["byte_length"] for m in metas] == [len(b) for b in t.binaries]
    assert [m["transport_chunk_index"] for m in metas] == list(range(len(metas)))
    assert [m["kind"] for m in metas] == ["media"] * 4 + ["trailer"][: len(metas) - 4]
    assert metas[0]["num_audio_samples"] == 8000 and metas[0]["audio_sample_rate"] == 32000
    assert t.binaries[0][4:8] == b"ftyp"
    done = t.of_type("session.done")[0]
    assert done == {"type": "session.done", "request_id": start["request_id"], "chunks": len(metas),
                    "stopped": False}
    assert t.close_code == 1000

    with av.open(io.BytesIO(b"".join(t.binaries))) as container:
        frames = list(container.decode(video=0))
    assert len(frames) == 24
    pts = [f.pts for f in frames]
    assert pts == sorted(pts) and len(set(pts)) == len(pts)


async def test_prompt_update_is_queued_then_applied_at_a_chunk_boundary():
    pipeline = FakePipeline(FakeBehaviour(num_chunks=8, chunk_delay_s=0.05))
    async with running_gateway(small_config(), pipeline) as server:
        t = Transcript()
        async with aiohttp.ClientSession() as http, http.ws_connect(ws_url(server)) as ws:
            await ws.send_json({"type": "session.start", "prompt": "calm lake"})
            await read_until(ws, t, until="video.chunk_metadata")
            await ws.send_json({"type": "session.interaction",
                                "interaction": {"event_id": "e1", "event": {"prompt": "storm"}}})
            queued = await read_until(ws, t, until="session.interaction.queued")
            await read_until(ws, t, until="session.done")
    assert queued["event_id"] == "e1" and queued["request_id"] == t.texts[0]["request_id"]
    applied = [m for m in t.of_type("video.chunk_metadata") if "e1" in m["completed_event_ids"]]
    assert len(applied) == 1 and applied[0]["transport_chunk_index"] >= 1
    assert t.texts.index(queued) < t.texts.index(applied[0])  # acked before it takes effect
    assert pipeline.records[0].updates == [("e1", "storm")]


async def test_stop_ends_with_done_stopped_and_cancels_backend():
    pipeline = FakePipeline(FakeBehaviour(num_chunks=None, chunk_delay_s=0.02))
    async with running_gateway(small_config(), pipeline) as server:
        t = Transcript()
        async with aiohttp.ClientSession() as http, http.ws_connect(ws_url(server)) as ws:
            await ws.send_json({"type": "session.start", "prompt": "forever"})
            await read_until(ws, t, until="video.chunk_metadata")
            await ws.send_json({"type": "session.ping"})
            await read_until(ws, t, until="session.pong")
            await ws.send_json({"type": "session.stop"})
            done = await read_until(ws, t, until="session.done")
            await read_until(ws, t)
        assert done["stopped"] is True and done["chunks"] == len(t.binaries)
        assert pipeline.records[0].cancelled
        assert t.close_code == 1000
        await wait_for_health(server, sessions_active=0)


async def test_disconnect_cancels_session_and_frees_the_slot():
    pipeline = FakePipeline(FakeBehaviour(num_chunks=None, chunk_delay_s=0.02))
    async with running_gateway(small_config(), pipeline) as server:
        async with aiohttp.ClientSession() as http:
            ws = await http.ws_connect(ws_url(server))
            await ws.send_json({"type": "session.start", "prompt": "leave early"})
            await read_until(ws, Transcript(), until="video.chunk_metadata")
            assert (await healthz(server))[1]["sessions_active"] == 1
            await ws.close()
        await wait_for_health(server, sessions_active=0)
        assert pipeline.records[0].cancelled and pipeline.records[0].closed
        pipeline.behaviour.num_chunks = 2
        await run_good_session(server)


async def test_second_client_waits_with_positions_and_starts_when_first_ends():
    pipeline = FakePipeline(FakeBehaviour(num_chunks=None, chunk_delay_s=0.02))
    async with running_gateway(small_config(queue_limit=2), pipeline) as server:
        async with aiohttp.ClientSession() as http:
            a = await http.ws_connect(ws_url(server))
            b = await http.ws_connect(ws_url(server))
            c = await http.ws_connect(ws_url(server))
            ta, tb, tc = Transcript(), Transcript(), Transcript()
            await a.send_json({"type": "session.start", "prompt": "first"})
            await read_until(a, ta, until="video.chunk_metadata")
            await b.send_json({"type": "session.start", "prompt": "second"})
            assert (await read_until(b, tb, until="session.queued"))["position"] == 1
            await c.send_json({"type": "session.start", "prompt": "third"})
            assert (await read_until(c, tc, until="session.queued"))["position"] == 2
            assert (await healthz(server))[1] == {"ok": True, "stages_down": [], "sessions_active": 1, "sessions_queued": 2,
                                                 "slots": 1, "queue_limit": 2}
            await a.send_json({"type": "session.stop"})
            await read_until(a, ta, until="session.done")
            await read_until(b, tb, until="video.chunk_metadata")  # b now generates
            assert (await read_until(c, tc, until="session.queued"))["position"] == 1
            await b.send_json({"type": "session.stop"})
            await read_until(b, tb, until="session.done")
            await read_until(c, tc, until="video.chunk_metadata")
            await c.close()
            for ws in (a, b):
                await ws.close()
    assert tb.order[:2] == ["text:video.start", "text:session.queued"]
    assert [r.request.prompt for r in pipeline.records] == ["first", "second", "third"]


async def test_queued_session_starts_while_the_backend_still_releases_the_previous_one():
    # A DiT group frees a cancelled session only at its next check between forwards, after the gateway's cancel
    # returned and the slot went to the next in line: that start must wait for the group, not fail backend_busy.
    pipeline = FakePipeline(FakeBehaviour(num_chunks=None, chunk_delay_s=0.02, release_delay_s=0.5))
    async with running_gateway(small_config(queue_limit=1), pipeline) as server:
        async with aiohttp.ClientSession() as http:
            a = await http.ws_connect(ws_url(server))
            b = await http.ws_connect(ws_url(server))
            ta, tb = Transcript(), Transcript()
            await a.send_json({"type": "session.start", "prompt": "first"})
            await read_until(a, ta, until="video.chunk_metadata")
            await b.send_json({"type": "session.start", "prompt": "second"})
            await read_until(b, tb, until="session.queued")
            await a.close()
            chunk = await read_until(b, tb, until="video.chunk_metadata")
            await b.close()
    assert chunk is not None and not tb.of_type("error"), tb.texts
    assert pipeline.busy_starts >= 1
    assert [r.request.prompt for r in pipeline.records] == ["first", "second"]


async def test_stop_while_the_backend_still_releases_the_previous_session_ends_the_session():
    pipeline = FakePipeline(FakeBehaviour(num_chunks=None, chunk_delay_s=0.02, release_delay_s=30.0))
    async with running_gateway(small_config(queue_limit=1), pipeline) as server:
        async with aiohttp.ClientSession() as http:
            a = await http.ws_connect(ws_url(server))
            b = await http.ws_connect(ws_url(server))
            tb = Transcript()
            await a.send_json({"type": "session.start", "prompt": "first"})
            await read_until(a, Transcript(), until="video.chunk_metadata")
            await b.send_json({"type": "session.start", "prompt": "second"})
            await read_until(b, tb, until="session.queued")
            await a.close()
            while pipeline.busy_starts == 0:
                await asyncio.sleep(0.01)
            await b.send_json({"type": "session.stop"})
            done = await read_until(b, tb, until="session.done", timeout=3.0)
            await b.close()
        await wait_for_health(server, sessions_active=0)
    assert done is not None and done["stopped"] is True and done["chunks"] == 0
    assert not tb.of_type("error") and len(pipeline.records) == 1


async def test_stalled_backend_is_aborted_with_stall_timeout():
    pipeline = FakePipeline(FakeBehaviour(num_chunks=None, stall_after=1))
    async with running_gateway(small_config(stall_timeout_s=0.3), pipeline) as server:
        t = Transcript()
        async with aiohttp.ClientSession() as http, http.ws_connect(ws_url(server)) as ws:
            await ws.send_json({"type": "session.start", "prompt": "will stall"})
            error = await read_until(ws, t, until="error")
            await read_until(ws, t)
        assert error["code"] == "stall_timeout" and error["request_id"] == t.texts[0]["request_id"]
        assert t.close_code == 1011 and pipeline.records[0].cancelled
        await wait_for_health(server, sessions_active=0)


async def test_pings_keep_a_session_without_progress_alive():
    pipeline = FakePipeline(FakeBehaviour(num_chunks=None, stall_after=1))
    async with running_gateway(small_config(stall_timeout_s=0.6), pipeline) as server:
        t = Transcript()
        async with aiohttp.ClientSession() as http, http.ws_connect(ws_url(server)) as ws:
            await ws.send_json({"type": "session.start", "prompt": "held"})
            await read_until(ws, t, until="video.chunk_metadata")
            for _ in range(10):  # > 1.5 s without progress: more than two stall periods
                await ws.send_json({"type": "session.ping"})
                await read_until(ws, t, until="session.pong")
                await asyncio.sleep(0.15)
            await ws.send_json({"type": "session.stop"})
            done = await read_until(ws, t, until="session.done")
    assert not t.of_type("error") and done["stopped"] is True


@pytest.mark.parametrize("start_error,code,fault", [
    pytest.param(BackendUnavailable("dit is not serving"), "backend_unavailable", "server", id="unavailable"),
    pytest.param(BackendFailed("dit failed (INTERNAL): dit is not serving"), "backend_failed", "server",
                 id="stage-internal"),
    pytest.param(InvalidRequest("vae: dit is not serving this canvas"), "invalid_request", "client",
                 id="stage-invalid-argument"),
])
async def test_backend_start_failure_is_reported_and_server_stays_up(start_error, code, fault):
    pipeline = FakePipeline(FakeBehaviour(start_error=start_error))
    async with running_gateway(small_config(), pipeline) as server:
        t = Transcript()
        async with aiohttp.ClientSession() as http, http.ws_connect(ws_url(server)) as ws:
            await ws.send_json({"type": "session.start", "prompt": "p"})
            error = await read_until(ws, t, until="error")
            await read_until(ws, t)
        assert error["code"] == code and "dit is not serving" in error["message"]
        assert error["fault"] == fault  # a failed backend is the server's fault, a rejected request the client's
        assert t.close_code == 1011
        pipeline.behaviour.start_error = None
        await run_good_session(server)


async def test_rejected_prompt_update_gets_interaction_failed_and_stream_continues():
    pipeline = FakePipeline(FakeBehaviour(num_chunks=4, chunk_delay_s=0.05, reject_prompts=frozenset({"bad"})))
    async with running_gateway(small_config(), pipeline) as server:
        t = Transcript()
        async with aiohttp.ClientSession() as http, http.ws_connect(ws_url(server)) as ws:
            await ws.send_json({"type": "session.start", "prompt": "p"})
            await ws.send_json({"type": "session.interaction",
                                "interaction": {"event_id": "x", "event": {"prompt": "bad"}}})
            error = await read_until(ws, t, until="error")
            done = await read_until(ws, t, until="session.done")
    assert error["code"] == "interaction_failed" and error["event_id"] == "x" and error["fault"] == "client"
    assert done["stopped"] is False and done["chunks"] >= 4


class _BrokenUpdatePipeline(FakePipeline):
    """update_prompt raises a non-PipelineError for the prompt 'explode'."""

    async def start(self, request):
        session = await super().start(request)
        original = session.update_prompt

        async def update_prompt(event_id: str, prompt: str) -> None:
            if prompt == "explode":
                raise asyncio.InvalidStateError("RPC already finished")
            await original(event_id, prompt)

        session.update_prompt = update_prompt
        return session


async def test_unexpected_update_failure_is_reported_and_later_updates_still_flow():
    pipeline = _BrokenUpdatePipeline(FakeBehaviour(num_chunks=12, chunk_delay_s=0.05))
    async with running_gateway(small_config(), pipeline) as server:
        t = Transcript()
        async with aiohttp.ClientSession() as http, http.ws_connect(ws_url(server)) as ws:
            await ws.send_json({"type": "session.start", "prompt": "fine prompt"})
            await read_until(ws, t, until="video.chunk_metadata")
            await ws.send_json({"type": "session.interaction",
                                "interaction": {"event_id": "bad", "event": {"prompt": "explode"}}})
            error = await read_until(ws, t, until="error")
            await ws.send_json({"type": "session.interaction",
                                "interaction": {"event_id": "good", "event": {"prompt": "a later update"}}})
            queued = await read_until(ws, t, until="session.interaction.queued")
            await read_until(ws, t, until="session.done")
    assert error is not None and error["code"] == "interaction_failed" and error["event_id"] == "bad"
    assert error["fault"] == "server"  # the gateway failed the update, not the client
    assert queued is not None and queued["event_id"] == "good"


async def test_health_metrics_and_page_endpoints():
    pipeline = FakePipeline(FakeBehaviour(num_chunks=3))
    async with running_gateway(small_config(), pipeline) as server:
        await run_good_session(server)
        async with aiohttp.ClientSession() as http:
            async with http.get(server.make_url("/metrics")) as resp:
                text = await resp.text()
            async with http.get(server.make_url("/")) as resp:
                page = await resp.text()
            async with http.get(server.make_url("/static/app.js")) as resp:
                script_status = resp.status
        pipeline.behaviour.healthy = False
        status, report = await healthz(server)
    assert "vitascope_time_to_first_chunk_seconds_count 1.0" in text
    assert "vitascope_chunk_interval_seconds_count 2.0" in text
    assert 'vitascope_stage_latency_seconds_count{stage="dit"} 3.0' in text
    assert 'vitascope_sessions_total{outcome="completed"} 1.0' in text
    assert "vitascope_active_sessions 0.0" in text
    assert "vitascope_queued_sessions 0.0" in text
    assert "vitascope_gateway_" not in text
    assert "<video" in page and script_status == 200
    assert status == 503 and report["ok"] is False


async def test_queued_sessions_can_stop_or_leave_and_settings_reach_the_backend():
    pipeline = FakePipeline(FakeBehaviour(num_chunks=None, chunk_delay_s=0.02))
    async with running_gateway(small_config(queue_limit=3), pipeline) as server:
        async with aiohttp.ClientSession() as http:
            a, b, c, d = [await http.ws_connect(ws_url(server)) for _ in range(4)]
            ta, tb, tc, td = Transcript(), Transcript(), Transcript(), Transcript()
            await a.send_json({"type": "session.start", "prompt": "first", "seed": 11, "width": 48, "height": 64,
                               "extra_params": {"hold_for_prompt": True, "hold_max_seconds": 3, "pace": "x"}})
            await read_until(a, ta, until="video.chunk_metadata")
            for ws, t, n in ((b, tb, 1), (c, tc, 2), (d, td, 3)):
                await ws.send_json({"type": "session.start", "prompt": "waiting"})
                assert (await read_until(ws, t, until="session.queued"))["position"] == n
            await b.send_json({"type": "session.stop"})
            assert await read_until(b, tb, until="session.done") == {
                "type": "session.done", "request_id": tb.texts[0]["request_id"], "chunks": 0, "stopped": True}
            assert (await read_until(c, tc, until="session.queued"))["position"] == 1
            assert (await read_until(d, td, until="session.queued"))["position"] == 2
            await c.close()  # leaving the queue moves d up
            assert (await read_until(d, td, until="session.queued"))["position"] == 1
            await wait_for_health(server, sessions_active=1, sessions_queued=1)
            for ws in (a, b, d):
                await ws.close()
        await wait_for_health(server, sessions_active=0, sessions_queued=0)
    request = pipeline.records[0].request
    assert (request.seed, request.width, request.height) == (11, 48, 64)
    assert request.hold.enabled and request.hold.max_seconds == 3.0 and dict(request.extra) == {"pace": "x"}
    assert ta.texts[0]["config"]["extra_params"]["hold_for_prompt"] is True
    assert len(pipeline.records) == 1  # no queued session ever reached the backend


def test_media_pacer_releases_chunks_at_media_time_and_rebases_when_far_behind():
    pacer = MediaPacer(PacingSettings(lead_s=0.5, max_lag_s=2.0))
    assert pacer.delay_for(100.0, 1.0) == 0.0           # first chunk: due at once
    assert pacer.delay_for(100.0, 1.0) == pytest.approx(0.5)   # media t=1 s, minus the lead
    assert pacer.delay_for(100.2, 1.0) == pytest.approx(1.3)   # media t=2 s
    assert pacer.delay_for(110.0, 1.0) == 0.0           # 8.5 s late: restart the clock, no burst
    assert pacer.delay_for(110.0, 1.0) == pytest.approx(1.0)


async def test_paced_session_streams_no_faster_than_media_time():
    pipeline = FakePipeline(FakeBehaviour(num_chunks=4, frames_per_chunk=6))  # 0.25 s of media each
    async with running_gateway(small_config(), pipeline) as server:
        t = Transcript()
        async with aiohttp.ClientSession() as http, http.ws_connect(ws_url(server)) as ws:
            await ws.send_json({"type": "session.start", "prompt": "paced",
                                "extra_params": {"pace_to_media_time": True, "pacing_lead_seconds": 0}})
            began = asyncio.get_running_loop().time()
            await read_until(ws, t, until="session.done")
            elapsed = asyncio.get_running_loop().time() - began
    assert elapsed >= 0.7  # the 4th chunk is due 0.75 s after the first
    assert t.texts[0]["config"]["extra_params"]["pace_to_media_time"] is True
    assert "pace_to_media_time" not in pipeline.records[0].request.extra


async def test_session_log_lines_carry_the_session_id():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter("gateway"))
    gateway_log = logging.getLogger("services.gateway")
    gateway_log.addHandler(handler)
    gateway_log.setLevel(logging.INFO)
    try:
        async with running_gateway(small_config(), FakePipeline(FakeBehaviour(num_chunks=2))) as server:
            t = await run_good_session(server)
    finally:
        gateway_log.removeHandler(handler)
        gateway_log.setLevel(logging.NOTSET)
    request_id = t.texts[0]["request_id"]
    entries = [json.loads(line) for line in stream.getvalue().splitlines()]
    session_lines = [e for e in entries if e["msg"].startswith(f"session {request_id}")]
    assert [e["msg"].split()[2] for e in session_lines] == ["accepted", "ended:"]
    assert all(e["session_id"] == request_id for e in session_lines)
