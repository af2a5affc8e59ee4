"""The browser page in headless Chromium: connects, plays through MSE, time advances, updates are acked.

Needs Debian's `chromium` (scripts/install_browser.sh) and the `playwright` Python package; skipped
cleanly without them. Playwright only drives the system browser (no downloaded browser builds).
"""
import os
import shutil

import aiohttp
import pytest

from tests.gateway.fakes import (
    FakeBehaviour,
    FakePipeline,
    Transcript,
    read_until,
    running_gateway,
    small_config,
    ws_url,
)

pytestmark = [pytest.mark.cpu, pytest.mark.e2e]

CHROMIUM = os.environ.get("VITASCOPE_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
    "--disable-sync", "--no-first-run", "--autoplay-policy=no-user-gesture-required",
]


@pytest.fixture
async def browser():
    if not (os.path.exists(CHROMIUM) or shutil.which(CHROMIUM)):
        pytest.skip(f"chromium not found at {CHROMIUM}; run scripts/install_browser.sh")
    playwright_api = pytest.importorskip("playwright.async_api", reason="the playwright package is not installed")
    async with playwright_api.async_playwright() as p:
        instance = await p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            yield instance
        finally:
            await instance.close()


async def test_page_plays_the_stream_and_acknowledges_a_prompt_update(browser, tmp_path):
    pipeline = FakePipeline(FakeBehaviour(num_chunks=None, frames_per_chunk=12, chunk_delay_s=0.15))
    config = small_config(allowed_canvases=((128, 96),), default_canvas=(128, 96), stall_timeout_s=30.0)
    async with running_gateway(config, pipeline) as server:
        page = await browser.new_page()
        console: list[str] = []
        page.on("console", lambda msg: console.append(msg.text))
        await page.goto(str(server.make_url("/")))
        await page.fill("#prompt", "a blue bar sweeping right")
        await page.click("#start")
        await page.wait_for_function("document.querySelector('#player').currentTime > 0.6", timeout=20000)
        assert await page.get_attribute("body", "data-state") == "streaming"
        rows = await page.locator("#chunks tbody tr").count()
        assert rows >= 2
        latency = await page.locator("#chunks tbody tr:first-child td:nth-child(5)").inner_text()
        assert float(latency) >= 0

        await page.fill("#update-prompt", "a green bar")
        await page.click("#update")
        await page.wait_for_selector("#updates li.applied", timeout=10000)
        state = await page.locator("#updates li .state").inner_text()
        assert state.startswith("applied at chunk")
        played = await page.evaluate("document.querySelector('#player').currentTime")

        await page.click("#stop")
        await page.wait_for_function("document.body.dataset.state === 'done'", timeout=10000)
        await page.screenshot(path=str(tmp_path / "page.png"))
        status = await page.locator("#status").inner_text()
    assert "(stopped)" in status, (status, console)
    assert played > 0.6
    assert [prompt for _, prompt in pipeline.records[0].updates] == ["a green bar"]


async def test_queue_display_and_status_follow_a_queued_session_to_its_end(browser):
    # The queue banner stayed up after a queued session was stopped, and a connection lost while queued left
    # "waiting in queue" on screen: the page looked like it was still waiting.
    pipeline = FakePipeline(FakeBehaviour(num_chunks=None, chunk_delay_s=0.05))
    config = small_config(allowed_canvases=((128, 96),), default_canvas=(128, 96), stall_timeout_s=30.0)
    routes = []

    def relay(route) -> None:  # the page's websocket goes through the test, which can cut it like a lost network
        route.connect_to_server()
        routes.append(route)

    async with running_gateway(config, pipeline) as server:
        async with aiohttp.ClientSession() as http, http.ws_connect(ws_url(server)) as holder:
            await holder.send_json({"type": "session.start", "prompt": "holds the only slot"})
            await read_until(holder, Transcript(), until="video.chunk_metadata")
            page = await browser.new_page()
            await page.route_web_socket("**/v1/realtime/video", relay)
            await page.goto(str(server.make_url("/")))
            await page.click("#start")
            await page.wait_for_function("document.body.dataset.state === 'queued'", timeout=10000)
            assert await page.is_visible("#queue")
            await page.click("#stop")
            await page.wait_for_function("document.body.dataset.state === 'done'", timeout=10000)
            assert await page.is_hidden("#queue"), "the queue banner outlived the queued session"
            await page.wait_for_function("!document.querySelector('#start').disabled", timeout=10000)

            await page.click("#start")
            await page.wait_for_function("document.body.dataset.state === 'queued'", timeout=10000)
            await routes[-1].close(code=1001, reason="gone")
            await page.wait_for_function("!document.querySelector('#start').disabled", timeout=10000)
            status = await page.locator("#status").inner_text()
            assert "queue" not in status and await page.get_attribute("body", "data-state") == "closed", status
            assert await page.is_hidden("#queue")
            await page.close()  # ends the relay's own connection to the gateway
