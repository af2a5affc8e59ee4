"""The gateway ends a finished session with a clean websocket closing handshake (close code 1000)."""
import asyncio

import aiohttp
import pytest

from tests.gateway.fakes import FakeBehaviour, FakePipeline, running_gateway, small_config, ws_url

pytestmark = pytest.mark.cpu


async def _session_close_code(server, *, stop: bool) -> tuple[list[str], int | None]:
    types = []
    async with aiohttp.ClientSession() as http, http.ws_connect(ws_url(server)) as ws:
        await ws.send_json({"type": "session.start", "prompt": "a clean close"})
        async for msg in ws:
            if msg.type == aiohttp.WSMsgType.TEXT:
                types.append(msg.json()["type"])
                if types[-1] == "session.done":
                    # A client busy elsewhere reads the close frame late: the server must still be
                    # waiting for its reply, not have dropped the connection already.
                    await asyncio.sleep(0.3)
                if stop and types[-1] == "video.chunk_metadata":
                    await ws.send_json({"type": "session.stop"})
                    stop = False
        return types, ws.close_code


@pytest.mark.parametrize("stop", [False, True], ids=["completed", "stopped"])
async def test_client_sees_close_code_1000_after_session_done(stop):
    pipeline = FakePipeline(FakeBehaviour(num_chunks=None if stop else 2, frames_per_chunk=2,
                                          chunk_delay_s=0.01))
    async with running_gateway(small_config(), pipeline) as server:
        for _ in range(2):  # the connection is reused by nothing: each session gets its own close
            types, code = await asyncio.wait_for(_session_close_code(server, stop=stop), 10)
            assert types[-1] == "session.done"
            assert code == aiohttp.WSCloseCode.OK
