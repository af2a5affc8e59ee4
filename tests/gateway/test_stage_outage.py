"""While a stage is down the gateway stays up: /healthz answers 503 naming it, a new session waits for it up to
`backend_wait_s` and then gets `backend_unavailable` naming it, and once it is back the next session streams."""
import asyncio

import aiohttp
import pytest

from tests.gateway.fakes import FakePipeline, Transcript, healthz, read_until, running_gateway, run_good_session, \
    small_config, ws_url

pytestmark = pytest.mark.cpu


async def test_healthz_names_the_stage_that_is_down():
    pipeline = FakePipeline()
    async with running_gateway(small_config(), pipeline) as server:
        pipeline.down = ["dit"]
        status, body = await healthz(server)
        assert status == 503 and body["ok"] is False and body["stages_down"] == ["dit"]
        pipeline.down = []
        status, body = await healthz(server)
        assert status == 200 and body["stages_down"] == []


async def test_a_start_while_a_stage_stays_down_gets_backend_unavailable_naming_it():
    pipeline = FakePipeline()
    pipeline.down = ["vae"]
    async with running_gateway(small_config(backend_wait_s=0.3), pipeline) as server:
        transcript = Transcript()
        async with aiohttp.ClientSession() as http, http.ws_connect(ws_url(server)) as ws:
            await ws.send_json({"type": "session.start", "prompt": "while the vae restarts"})
            error = await read_until(ws, transcript, until="error", timeout=10)
        assert error["code"] == "backend_unavailable" and "vae" in error["message"] and error["fault"] == "server"
        assert pipeline.records == []  # nothing was started on the missing stage
        status, body = await healthz(server)
        assert status == 503 and body["sessions_active"] == 0  # the slot was given back


async def test_a_start_waits_for_a_restarting_stage_and_then_streams():
    pipeline = FakePipeline()
    pipeline.down = ["dit"]
    async with running_gateway(small_config(backend_wait_s=10), pipeline) as server:
        asyncio.get_running_loop().call_later(0.3, pipeline.down.clear)  # the stage comes back
        transcript = await run_good_session(server)
        assert transcript.of_type("session.done")
