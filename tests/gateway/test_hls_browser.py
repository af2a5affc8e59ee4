"""LL-HLS in headless Chromium with hls.js (the vendored build): the viewer page plays a live session from its parts,
near the live edge, with a viewer token on the playlist only, and plays to the end once the list ends.

Skipped without Debian's `chromium` or the `playwright` package, as the other browser tests are.
"""
from __future__ import annotations

import hashlib
import pathlib

import aiohttp
import pytest

from services.common.config import GatewayAuthConfig
from services.gateway.access import Access
from tests.gateway.fakes import FakeBehaviour, FakePipeline, Transcript, read_until, running_gateway, small_config, \
    ws_url
from tests.gateway.test_browser_page import browser  # noqa: F401 - the fixture

pytestmark = [pytest.mark.cpu, pytest.mark.e2e]

VENDOR = pathlib.Path(__file__).resolve().parents[2] / "services" / "gateway" / "static" / "vendor"
DIRECTOR = "director-token-0123456789"
VIEWER = "viewer-token-0123456789ab"


def test_the_vendored_hls_js_is_the_published_file_its_readme_names():
    readme = (VENDOR / "README.md").read_text()
    digest = hashlib.sha256((VENDOR / "hls.min.js").read_bytes()).hexdigest()
    assert f"`{digest}`" in readme and "hls.js@1.7.4" in readme
    assert "Apache License" in (VENDOR / "LICENSE.hls.js").read_text()


async def test_hls_js_plays_a_live_session_from_its_parts_and_to_its_end(browser, tmp_path):  # noqa: F811
    (tmp_path / "t").write_text(DIRECTOR)
    auth = GatewayAuthConfig(enabled=True, tokens_file=str(tmp_path / "t"))
    # 0.25 s chunks at media speed, four to a 1 s request: parts matter (the hold-back is 1.5 s)
    pipeline = FakePipeline(FakeBehaviour(num_chunks=None, frames_per_chunk=6, chunk_delay_s=0.25))
    config = small_config(allowed_canvases=((128, 96),), default_canvas=(128, 96), stall_timeout_s=60.0,
                          hls_part_target_s=0.5, hls_target_duration_s=1, auth=auth)
    access = Access(auth, [DIRECTOR], viewer_tokens=[VIEWER])
    async with running_gateway(config, pipeline, access=access) as server, aiohttp.ClientSession() as http, \
            http.ws_connect(ws_url(server), headers={"Authorization": f"Bearer {DIRECTOR}"}) as ws:
        await ws.send_json({"type": "session.start", "prompt": "watched over HLS"})
        transcript = Transcript()
        start = await read_until(ws, transcript, until="video.start")
        page = await browser.new_page()
        errors: list[str] = []
        page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
        await page.goto(str(server.make_url(f"/static/watch_hls.html?session={start['request_id']}&token={VIEWER}")))
        await page.wait_for_function("document.querySelector('#player').currentTime > 2", timeout=30000)
        assert await page.get_attribute("body", "data-state") == "playing"
        stats = await page.evaluate("window.vitascopeHls.stats()")
        assert stats["lowLatency"] is True and stats["parts"] >= 4, stats
        assert 0 < stats["latency"] < 3.5, stats  # target: the 1.5 s part hold-back

        await ws.send_json({"type": "session.stop"})
        await read_until(ws, transcript, until="session.done")
        await page.wait_for_function("document.body.dataset.state === 'ended'", timeout=30000)
        played = await page.evaluate("document.querySelector('#player').currentTime")
        sent = sum(m["num_frames"] for m in transcript.of_type("video.chunk_metadata")) / 24
        await page.close()
    assert played == pytest.approx(sent, abs=0.3), (played, sent, errors)
