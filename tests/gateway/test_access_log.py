"""The gateway's access log: a token passed as `?token=` never reaches it, refusals are logged, and the probes'
successful polls of /healthz and /metrics are not."""
import logging

import aiohttp
import pytest
from aiohttp import web

from services.common.config import GatewayAuthConfig
from services.gateway.__main__ import AccessLog
from services.gateway.access import Access
from services.gateway.ws import create_app
from tests.gateway.fakes import FakePipeline, small_config

pytestmark = pytest.mark.cpu

SECRET = "s3cret-token-never-logged"


async def test_the_access_log_keeps_tokens_out_and_probes_quiet(caplog):
    config = small_config(auth=GatewayAuthConfig(enabled=True, tokens_env="VITASCOPE_TEST_TOKENS"))
    app = create_app(config, FakePipeline(), access=Access(config.auth, frozenset({"right-token"})))
    runner = web.AppRunner(app, access_log_class=AccessLog)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        with caplog.at_level(logging.INFO, logger="aiohttp.access"):
            async with aiohttp.ClientSession() as http:
                async with http.get(f"http://127.0.0.1:{port}/v1/realtime/video?token={SECRET}") as refused:
                    assert refused.status == 401
                for path in ("/healthz", "/metrics"):
                    async with http.get(f"http://127.0.0.1:{port}{path}") as polled:
                        assert polled.status == 200
    finally:
        await runner.cleanup()
    lines = [r.getMessage() for r in caplog.records if r.name == "aiohttp.access"]
    assert any(line.startswith("GET /v1/realtime/video 401 ") for line in lines), lines
    assert not any(SECRET in line for line in lines)
    assert not any("/healthz" in line or "/metrics" in line for line in lines), lines
