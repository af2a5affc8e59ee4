"""Load benchmark: `python -m tools.load --clients 64 [--url ws://...]`.

Runs `--clients` concurrent websocket clients of mixed behaviour against a gateway (one it brings up on a copy of
the tiny CPU profile, or `--url`): normal sessions, clients that disconnect while queued or mid-stream, a reader
that stops reading, an early stop, and a flood of prompt updates. Each client ends with `session.done`, an `error`
with a code, or (the clients that leave) its own close; every other end is a failure. Afterwards the node must
return to idle by itself (0 active, 0 queued, no leased IPC slot) within `--idle-timeout`. Prints one line per
behaviour (how each client ended, the time it took) and the node's state; exit 1 on any failure.

Knows only the websocket protocol, `services.up` and the gateway's /healthz.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import logging
import pathlib
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable

import aiohttp
import yaml

from tools.bench_tiny import ROOT, bring_up_logged
from tools.soak import metric_total, soak_profile

log = logging.getLogger("load")

PROMPT = "a market stall of bright fruit under an awning"


async def _start(ws: aiohttp.ClientWebSocketResponse, num_frames: int | None = None) -> None:
    body = {"type": "session.start", "prompt": PROMPT, "format": "m4s"}
    if num_frames is not None:
        body["num_frames"] = num_frames  # a frame budget: the whole 5 s requests that hold it
    await ws.send_str(json.dumps(body))


async def _read_to_end(ws: aiohttp.ClientWebSocketResponse, timeout_s: float,
                       on_message: Callable[[dict], Awaitable[None]] | None = None) -> str:
    """Read until session.done, an error with a code, or a close; how it ended."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return "timeout"
        try:
            msg = await ws.receive(timeout=left)
        except asyncio.TimeoutError:
            return "timeout"
        if msg.type == aiohttp.WSMsgType.TEXT:
            body = json.loads(msg.data)
            if on_message is not None:
                await on_message(body)
            if body.get("type") == "session.done":
                return "done"
            if body.get("type") == "error" and body.get("code") and not body.get("event_id"):
                return f"error:{body['code']}"
        elif msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.CLOSING):
            return f"closed:{ws.close_code}"
        elif msg.type == aiohttp.WSMsgType.ERROR:
            return "transport_error"


async def normal(ws, timeout_s: float) -> str:
    """One 5 s request (the frame budget), to session.done."""
    await _start(ws, num_frames=124)
    return await _read_to_end(ws, timeout_s)


async def early_stop(ws, timeout_s: float) -> str:
    """session.stop right after session.start."""
    await _start(ws)
    await ws.send_str(json.dumps({"type": "session.stop"}))
    return await _read_to_end(ws, timeout_s)


async def update_flood(ws, timeout_s: float) -> str:
    """200 prompt updates as fast as possible once the session runs, then stop."""
    await _start(ws)

    async def on_message(body: dict) -> None:
        if body.get("type") == "video.start":
            for i in range(200):
                await ws.send_str(json.dumps({"type": "session.interaction", "interaction": {
                    "event_id": f"flood-{i}", "event": {"prompt": f"{PROMPT}, take {i}"}}}))
            await ws.send_str(json.dumps({"type": "session.stop"}))

    return await _read_to_end(ws, timeout_s, on_message)


async def leave_while_queued(ws, timeout_s: float) -> str:
    """Disconnect as soon as the gateway answers (queued or started)."""
    await _start(ws)
    outcome = await _first_text(ws, timeout_s)
    await ws.close()
    return f"left:{outcome}"


async def leave_mid_stream(ws, timeout_s: float) -> str:
    """Disconnect after the first media frame."""
    await _start(ws)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        msg = await ws.receive(timeout=deadline - time.monotonic())
        if msg.type == aiohttp.WSMsgType.BINARY:
            await ws.close()
            return "left:after_media"
        if msg.type == aiohttp.WSMsgType.TEXT and json.loads(msg.data).get("type") in ("error", "session.done"):
            return f"ended_first:{json.loads(msg.data).get('code', 'done')}"
        if msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED):
            return f"closed:{ws.close_code}"
    return "timeout"


async def stops_reading(ws, timeout_s: float) -> str:
    """Start a two-request session, read nothing for a while (the gateway must drop it or buffer, never wait on
    it), then read what is left."""
    await _start(ws, num_frames=243)
    await asyncio.sleep(min(20.0, timeout_s / 3))
    return await _read_to_end(ws, timeout_s)


async def _first_text(ws, timeout_s: float) -> str:
    msg = await ws.receive(timeout=timeout_s)
    if msg.type == aiohttp.WSMsgType.TEXT:
        return json.loads(msg.data).get("type", "?")
    return msg.type.name


BEHAVIOURS: dict[str, Callable] = {
    "normal": normal, "leave_while_queued": leave_while_queued, "leave_mid_stream": leave_mid_stream,
    "stops_reading": stops_reading, "early_stop": early_stop, "update_flood": update_flood,
}


def acceptable(outcome: str) -> bool:
    """session.done, an error with a code, the client's own leaving, or a close the gateway chose."""
    return outcome == "done" or outcome.startswith(("error:", "left:", "ended_first:", "closed:", "refused:"))


async def client(url: str, behaviour: str, timeout_s: float) -> tuple[str, str, float]:
    started = time.monotonic()
    try:
        async with aiohttp.ClientSession() as http:
            async with http.ws_connect(url, max_msg_size=0) as ws:
                outcome = await BEHAVIOURS[behaviour](ws, timeout_s)
    except aiohttp.WSServerHandshakeError as exc:  # the gateway refused the upgrade (401, 403, 429 with a code)
        outcome = f"refused:{exc.status}"
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        outcome = f"client_error:{type(exc).__name__}"
    return behaviour, outcome, time.monotonic() - started


async def run_load(url: str, clients: int, timeout_s: float) -> list[tuple[str, str, float]]:
    names = list(BEHAVIOURS)
    return await asyncio.gather(*(client(url, names[i % len(names)], timeout_s) for i in range(clients)))


def wait_idle(http_url: str, metrics_urls: list[str], timeout_s: float) -> tuple[bool, str]:
    deadline = time.monotonic() + timeout_s
    while True:
        with urllib.request.urlopen(http_url + "/healthz", timeout=5) as reply:
            health = json.loads(reply.read())
        leased = sum(metric_total(u, "vitascope_ipc_leased_slots") for u in metrics_urls)
        state = f"active {health['sessions_active']}, queued {health['sessions_queued']}, leased slots {leased:.0f}"
        if health["sessions_active"] == 0 and health["sessions_queued"] == 0 and leased == 0:
            return True, state
        if time.monotonic() > deadline:
            return False, state
        time.sleep(0.5)


def report(results: list[tuple[str, str, float]]) -> tuple[list[str], int]:
    by_behaviour: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    slowest: dict[str, float] = collections.defaultdict(float)
    for behaviour, outcome, seconds in results:
        by_behaviour[behaviour][outcome] += 1
        slowest[behaviour] = max(slowest[behaviour], seconds)
    lines = [f"{b:20s} {dict(c)}  (slowest {slowest[b]:.1f} s)" for b, c in by_behaviour.items()]
    return lines, sum(1 for _, outcome, _ in results if not acceptable(outcome))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--url", help="an already running gateway's websocket URL (default: bring one up)")
    parser.add_argument("--metrics", nargs="*", default=[], help="with --url: the stages' /metrics URLs")
    parser.add_argument("--profile", type=pathlib.Path, default=ROOT / "configs" / "tiny_cpu.yaml")
    parser.add_argument("--queue-limit", type=int, help="the gateway's queue (default: --clients, so none is "
                                                         "turned away with queue_full)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds each client may take")
    parser.add_argument("--idle-timeout", type=float, default=30.0)
    parser.add_argument("--service-log", default="/tmp/vitascope_load_services.log")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    with tempfile.TemporaryDirectory(prefix="load_") as tmp:
        supervisor = None
        if args.url:
            url, metrics_urls = args.url, args.metrics
        else:
            profile, port, metrics_urls = soak_profile(args.profile, pathlib.Path(tmp))
            raw = yaml.safe_load(profile.read_text())  # room in the queue for every client: all of them are served
            raw["gateway"]["queue_limit"] = args.clients if args.queue_limit is None else args.queue_limit
            profile.write_text(yaml.safe_dump(raw))
            url = f"ws://127.0.0.1:{port}/v1/realtime/video"
            supervisor = bring_up_logged(profile, args.service_log)
        http_url = url.replace("ws://", "http://").replace("wss://", "https://").rsplit("/v1/", 1)[0]
        try:
            started = time.monotonic()
            results = asyncio.run(run_load(url, args.clients, args.timeout))
            elapsed = time.monotonic() - started
            idle, state = wait_idle(http_url, metrics_urls, args.idle_timeout)
        finally:
            if supervisor is not None:
                supervisor.stop_all()
    lines, bad = report(results)
    print("\n".join([f"load: {args.clients} clients in {elapsed:.1f} s", *lines,
                     f"clients without a named end: {bad}", f"node afterwards: {state}: {'ok' if idle else 'MISSED'}"]),
          flush=True)
    return 0 if bad == 0 and idle else 1


if __name__ == "__main__":
    sys.exit(main())
