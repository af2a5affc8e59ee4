"""The browser page in headless Chromium: connects, plays through MSE, time advances, updates are acked.

Needs Debian's `chromium` (scripts/install_system_deps.sh) and the `playwright` Python package; skipped
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
        pytest.skip(f"chromium not found at {CHROMIUM}; run scripts/install_system_deps.sh")
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


# Samples each presented frame of #player: its media time and the column of the bar (the brightest column of the
# middle row; the fake draws an 8-pixel bar at x = 4 * frame number, modulo the width).
SAMPLE_FRAMES_JS = """() => {
  const video = document.querySelector('#player');
  const canvas = document.createElement('canvas');
  const context = canvas.getContext('2d', { willReadFrequently: true });
  window.frameSamples = [];
  const sample = (_now, meta) => {
    canvas.width = video.videoWidth;
    canvas.height = video.videoHeight;
    context.drawImage(video, 0, 0);
    const row = context.getImageData(0, Math.floor(canvas.height / 2), canvas.width, 1).data;
    let best = 0, bestX = -1;
    for (let x = 0; x < canvas.width; x++) {
      const v = row[4 * x] + row[4 * x + 1] + row[4 * x + 2];
      if (v > best) { best = v; bestX = x; }
    }
    window.frameSamples.push([meta.mediaTime, bestX, row[4 * bestX], row[4 * bestX + 1], row[4 * bestX + 2]]);
    video.requestVideoFrameCallback(sample);
  };
  video.requestVideoFrameCallback(sample);
}"""
CHUNK_FRAMES = 12
FPS = 24
WIDTH = 128


def _bar_distance(x: int, y: int) -> int:
    """Pixels between two bar columns on the wrapping canvas (the bar at 124 and at 0 are 4 apart)."""
    d = abs(x - y) % WIDTH
    return min(d, WIDTH - d)


def _check_frames(samples: list, who: str) -> None:
    """Every sampled frame shows the bar where the fake drew it at that media time, in the prompt's colour."""
    assert len(samples) >= 10, f"{who}: only {len(samples)} frames presented"
    for media_time, x, *rgb in samples:
        frame = round(media_time * FPS)
        expected = (4 * frame) % WIDTH
        assert _bar_distance(x, expected) <= 8, (who, media_time, x, expected)
        assert all(abs(a - b) <= 40 for a, b in zip(rgb, (157, 226, 156))), (who, rgb)  # "a bar of light"


async def test_two_viewers_see_the_directors_frames_from_a_keyframe_with_sound(browser):
    pipeline = FakePipeline(FakeBehaviour(num_chunks=None, frames_per_chunk=CHUNK_FRAMES, chunk_delay_s=0.1))
    config = small_config(allowed_canvases=((WIDTH, 96),), default_canvas=(WIDTH, 96), stall_timeout_s=30.0)
    async with running_gateway(config, pipeline) as server:
        director = await browser.new_page()
        await director.goto(str(server.make_url("/")))
        await director.evaluate(SAMPLE_FRAMES_JS)
        await director.fill("#prompt", "a bar of light")
        await director.click("#start")  # paced to media time: a chunk every 0.5 s
        await director.wait_for_selector("#share:not([hidden])", timeout=10000)
        share = await director.get_attribute("#share-link", "href")
        assert share.endswith("/watch/" + pipeline.records[0].request.request_id)
        viewers = []
        for joins_after_s in (1.5, 3.0):
            await director.wait_for_function(f"document.querySelector('#player').currentTime > {joins_after_s}",
                                             timeout=20000)
            viewer = await browser.new_page()
            await viewer.goto(share)
            await viewer.evaluate(SAMPLE_FRAMES_JS)
            viewers.append(viewer)
        session_id = pipeline.records[0].request.request_id
        assert await viewers[0].get_attribute("#hls-page", "href") == f"/static/watch_hls.html?session={session_id}"
        assert (await viewers[0].get_attribute("#hls-playlist", "href")).endswith(
            f"/v1/realtime/video/hls/{session_id}/playlist.m3u8")
        for viewer in viewers:
            await viewer.wait_for_function("document.body.dataset.state === 'watching'", timeout=10000)
            start_s = float(await viewer.get_attribute("body", "data-first-chunk")) * CHUNK_FRAMES / FPS
            await viewer.wait_for_function(f"document.querySelector('#player').currentTime > {start_s + 1.5}",
                                           timeout=20000)
        await director.click("#stop")
        for page in (director, *viewers):
            await page.wait_for_function("document.body.dataset.state === 'done'", timeout=10000)
        first_chunks = [int(await v.get_attribute("body", "data-first-chunk")) for v in viewers]
        for viewer in viewers:
            audio_bytes = await viewer.evaluate("document.querySelector('#player').webkitAudioDecodedByteCount")
            assert audio_bytes > 0, "the viewer played no sound"
        samples = {"director": await director.evaluate("window.frameSamples")}
        for k, viewer in enumerate(viewers):
            samples[f"viewer {k}"] = await viewer.evaluate("window.frameSamples")
    assert 0 < first_chunks[0] < first_chunks[1], first_chunks
    for who, frames in samples.items():
        _check_frames(frames, who)
    director_frames = {round(t * FPS): x for t, x, *_ in samples["director"]}
    for k in range(2):
        shared = [(round(t * FPS), x) for t, x, *_ in samples[f"viewer {k}"] if round(t * FPS) in director_frames]
        assert len(shared) >= 10, f"viewer {k} and the director presented only {len(shared)} frames in common"
        # the same picture at the same media time; a sample may show a frame or two later than its callback's
        # (the page drew it late, under load), so a few may differ by up to _check_frames' 8 px
        distances = [_bar_distance(director_frames[f], x) for f, x in shared]
        differ = [(f, director_frames[f], x) for (f, x), d in zip(shared, distances) if d > 2]
        assert max(distances) <= 8 and len(differ) <= len(shared) // 10, \
            f"viewer {k}: (frame, director's x, viewer's x) {differ} of {len(shared)} frames in common"
    # each viewer's first presented frame is one of its first chunk's: that chunk opens with a keyframe (else MSE
    # would drop its frames up to the next chunk's); the very first frames may go unpresented while playback starts
    viewer_starts = [min(t for t, *_ in samples[f"viewer {k}"]) for k in range(2)]
    for start_s, chunk in zip(viewer_starts, first_chunks):
        assert chunk * CHUNK_FRAMES / FPS - 0.5 / FPS < start_s < (chunk + 1) * CHUNK_FRAMES / FPS - 0.5 / FPS, (
            viewer_starts, first_chunks)
