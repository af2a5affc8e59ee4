"""Screenshots of the browser page streaming a checkpoint tree, before and after a prompt update (the README's
pictures).

    .venv/bin/python -m tools.page_shots --tree models/tiny --out docs/images

Brings the four services up on a copy of the tiny CPU profile whose model is `--tree` (free ports), opens the page
in headless Chromium (Debian's `chromium`, driven by `playwright`), starts a session with `--prompt`, screenshots
the page once a few seconds have played (`page_first.png`), sends `--update`, and screenshots it again once the
update was acknowledged and the player has passed the chunk it was applied at (`page_updated.png`).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import sys
import tempfile

from tools.bench_tiny import FPS, bring_up_logged, write_profile

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHROMIUM = os.environ.get("VITASCOPE_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--autoplay-policy=no-user-gesture-required"]


async def shoot(url: str, prompt: str, update: str, out: pathlib.Path, played_s: float) -> None:
    from playwright.async_api import async_playwright
    async with async_playwright() as p:
        browser = await p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = await browser.new_page(viewport={"width": 1280, "height": 760})
            await page.goto(url)
            await page.fill("#prompt", prompt)
            await page.click("#start")
            await page.wait_for_function(f"document.querySelector('#player').currentTime > {played_s}",
                                         timeout=60000)
            await page.screenshot(path=str(out / "page_first.png"))
            await page.fill("#update-prompt", update)
            await page.click("#update")
            await page.wait_for_selector("#updates li.applied", timeout=60000)
            # the update shows from the chunk it was applied at: let the player get 3 s past that chunk's start
            state = await page.locator("#updates li.applied .state").inner_text()  # "applied at chunk N"
            chunk = int(state.rsplit(" ", 1)[-1])
            await page.wait_for_function(f"""() => {{
                let frames = 0;
                for (const row of document.querySelectorAll('#chunks tbody tr')) {{
                    const cells = row.querySelectorAll('td');
                    if (Number(cells[0].innerText) < {chunk}) frames += Number(cells[2].innerText);
                }}
                return document.querySelector('#player').currentTime > frames / {FPS} + 3;
            }}""", timeout=60000)
            await page.screenshot(path=str(out / "page_updated.png"))
            await page.click("#stop")
        finally:
            await browser.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", type=pathlib.Path, default=ROOT / "models" / "tiny")
    p.add_argument("--out", type=pathlib.Path, default=ROOT / "docs" / "images")
    p.add_argument("--prompt", default="a red circle standing still on a dark blue background, a low hum")
    p.add_argument("--update", default="a yellow triangle standing still on a grey background, a high hum")
    p.add_argument("--played", type=float, default=3.0, help="seconds of media played before the first picture")
    p.add_argument("--service-log", default="/tmp/vitascope-page-shots.log")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="vitascope-shots-") as tmp:
        profile, port = write_profile(ROOT / "configs" / "tiny_cpu.yaml", pathlib.Path(tmp), model_dir=args.tree)
        supervisor = bring_up_logged(profile, args.service_log)
        try:
            asyncio.run(shoot(f"http://127.0.0.1:{port}/", args.prompt, args.update, args.out, args.played))
        finally:
            supervisor.stop_all()
    print(f"wrote {args.out / 'page_first.png'} and {args.out / 'page_updated.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
