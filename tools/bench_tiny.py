"""Tiny-preset benchmark on this machine: `.venv/bin/python -m tools.bench_tiny [--requests 6] [--tree DIR]`.

Brings the four services up on a copy of the tiny CPU profile (free ports, a temporary checkpoint directory,
service logs to a file), streams one session of N 5-second requests through the client library with a new
prompt during every request, then a few short warm sessions, and prints: the real-time factor, time to first
chunk (cold = first session after start-up, warm = later sessions), chunk intervals, when each prompt update
took effect, and the per-stage seconds the chunks reported (from the gateway's stage histogram, which is fed
from every chunk's metadata timings). Knows only the profile format, `services.up` and the client library.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import pathlib
import re
import sys
import tempfile
import time
import urllib.request

import numpy as np
import yaml

from services.client import ClientOptions, ClientResult, PromptUpdate, stream
from services.supervisor import Supervisor
from services.up import bring_up
from tools.ports import free_ports

ROOT = pathlib.Path(__file__).resolve().parent.parent

log = logging.getLogger("bench_tiny")

FPS = 24
FIRST_REQUEST_FRAMES = 124  # 39 + 34 + 34 + 17
LATER_REQUEST_FRAMES = 119  # 34 + 34 + 34 + 17
FIRST_CHUNK_FRAMES = 39
STAGES = ("text", "dit", "vae", "mux")
PROMPTS = (
    "a quiet lake at dawn, mist over the water",
    "a storm rolls in over the lake, dark clouds",
    "rain hammers the surface of the lake",
    "the clouds break and sunlight hits the hills",
    "a flock of birds crosses the evening sky",
    "night falls, the moon reflects on the water",
    "a lantern drifts slowly across the dark lake",
    "snow begins to fall over the frozen shore",
)


def write_profile(base: pathlib.Path, workdir: pathlib.Path, model_dir: pathlib.Path | None = None,
                  metrics: bool = False) -> tuple[pathlib.Path, int]:
    """A copy of `base` on free ports; returns (path, gateway port). Its model is `model_dir` as it stands, or by
    default a checkpoint of its own under `workdir`, written on first start. With `metrics`, each stage serves its
    metrics on a free port too (otherwise on none)."""
    raw = yaml.safe_load(base.read_text())
    raw["profile"] = f"{raw.get('profile', base.stem)}_bench"
    raw["model"]["dir"] = str(model_dir.resolve() if model_dir else workdir / "checkpoint")
    raw["model"]["write_if_missing"] = model_dir is None
    stages = ("encoder", "dit", "vae")
    # chosen at once, so that no two of them are the same port
    port, *ports = free_ports(1 + 2 * len(stages))
    raw["endpoints"] = {name: f"127.0.0.1:{ports.pop()}" for name in stages}
    for stage in stages:
        raw.setdefault(stage, {})["metrics_port"] = ports.pop() if metrics else 0
    raw.setdefault("gateway", {})["port"] = port
    path = workdir / "profile.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path, port


def bring_up_logged(profile: pathlib.Path, service_log: str) -> Supervisor:
    """`bring_up` with the services' output appended to `service_log` (the children inherit these descriptors while
    they start), so this tool's own output stays readable."""
    with open(service_log, "ab") as log_file:
        saved = os.dup(1), os.dup(2)
        os.dup2(log_file.fileno(), 1)
        os.dup2(log_file.fileno(), 2)
        try:
            return bring_up(profile)
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)


def media_seconds_of(requests: int) -> float:
    return (FIRST_REQUEST_FRAMES + LATER_REQUEST_FRAMES * (requests - 1)) / FPS


def request_start_s(k: int) -> float:
    """Media time at which request k begins."""
    return 0.0 if k == 0 else (FIRST_REQUEST_FRAMES + LATER_REQUEST_FRAMES * (k - 1)) / FPS


def scrape_stages(http_url: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of the gateway's per-stage histogram, by stage."""
    with urllib.request.urlopen(http_url + "/metrics", timeout=10) as reply:
        text = reply.read().decode()
    out = {}
    for stage in STAGES:
        values = []
        for suffix in ("sum", "count"):
            m = re.search(rf'^vitascope_stage_latency_seconds_{suffix}\{{stage="{stage}"\}} (\S+)$', text, re.M)
            values.append(float(m.group(1)) if m else 0.0)
        out[stage] = (values[0], values[1])
    return out


def run_session(url: str, requests: int, seed: int) -> ClientResult:
    """Stream `requests` requests; the prompt changes during every request (sent after its first chunk)."""
    updates = tuple(
        PromptUpdate(at_s=request_start_s(k) + 0.01, prompt=PROMPTS[(k + 1) % len(PROMPTS)])
        for k in range(requests - 1))
    options = ClientOptions(url=url, prompt=PROMPTS[0], seconds=media_seconds_of(requests) - 0.01,
                            updates=updates, seed=seed, width=320, height=192)
    return asyncio.run(stream(options))


def run_warm(url: str, seed: int) -> ClientResult:
    """A one-chunk session: its time to first chunk on a warm system."""
    return asyncio.run(stream(ClientOptions(url=url, prompt=PROMPTS[-1], seconds=0.5, seed=seed,
                                            width=320, height=192)))


def update_landing(result: ClientResult) -> list[tuple[str, int, int | None]]:
    """(event id, chunk after which it was sent, chunk whose completed_event_ids held it) per update."""
    media, cumulative = [c for c in result.chunks if c.kind == "media"], []
    total = 0.0
    for chunk in media:
        total += chunk.num_frames / FPS
        cumulative.append(total)
    rows = []
    for event_id, update in result.sent_updates.items():
        sent_after = next(i for i, t in enumerate(cumulative) if t >= update.at_s)
        rows.append((event_id, media[sent_after].index, result.applied_at.get(event_id)))
    return rows


def report(args, cold: ClientResult, warm: list[ClientResult], stages: dict[str, tuple[float, float]],
           up_seconds: float, loads: tuple[tuple[float, ...], tuple[float, ...]]) -> str:
    media = [c for c in cold.chunks if c.kind == "media"]
    arrivals = [c.arrived_s for c in media]
    media_s = cold.media_seconds
    first_to_last = arrivals[-1] - arrivals[0]
    steady_media = media_s - media[0].num_frames / FPS
    intervals = np.array([c.interval_s for c in media[1:]])
    lines = [
        f"command: {' '.join([os.path.relpath(sys.executable, ROOT), *sys.argv])}",
        f"machine: {os.cpu_count()} CPUs; load average before {'/'.join(f'{x:.2f}' for x in loads[0])}, "
        f"after {'/'.join(f'{x:.2f}' for x in loads[1])} (1/5/15 min)",
        f"bring-up (checkpoint write + 4 services healthy): {up_seconds:.1f} s",
        f"session: {args.requests} requests, {len(media)} chunks, {media_s:.2f} s of media, "
        f"{len(cold.data) / 1e6:.1f} MB, wall {cold.wall_seconds:.2f} s (start → session.done)",
        "",
        f"real-time factor, first chunk → last chunk / all media:       {first_to_last / media_s:.3f}",
        f"real-time factor, first chunk → last chunk / media after it:  {first_to_last / steady_media:.3f}",
        f"real-time factor, session.start → last chunk / all media:     {arrivals[-1] / media_s:.3f}",
        f"time to first chunk, cold (first session after start-up):     {cold.time_to_first_chunk_s:.3f} s",
        "time to first chunk, warm (later sessions):                   "
        + ", ".join(f"{w.time_to_first_chunk_s:.3f} s" for w in warm),
        f"chunk interval (media chunks 2..n): mean {intervals.mean():.3f} s, p50 {np.percentile(intervals, 50):.3f} s, "
        f"p95 {np.percentile(intervals, 95):.3f} s, max {intervals.max():.3f} s "
        f"(a 34-frame chunk is {34 / FPS:.3f} s of media)",
        "",
        "prompt updates (sent after the first chunk of each request; each takes effect where the next request starts):",
    ]
    for event_id, sent_after, applied in update_landing(cold):
        lines.append(f"  {event_id}: sent after chunk {sent_after}, took effect at chunk "
                     f"{applied if applied is not None else 'never (session ended)'}")
    lines += ["", "per-stage seconds reported by the chunks (cold session; text only where a prompt was encoded):",
              f"  {'stage':<6} {'chunks':>6} {'mean s':>8} {'total s':>8} {'share of wall':>14}"]
    for stage in STAGES:
        total, count = stages[stage]
        mean = total / count if count else 0.0
        lines.append(f"  {stage:<6} {int(count):>6} {mean:>8.3f} {total:>8.2f} "
                     f"{100 * total / cold.wall_seconds:>13.1f}%")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=6, help="5-second requests in the timed session")
    parser.add_argument("--warm", type=int, default=2, help="short sessions after it (warm time to first chunk)")
    parser.add_argument("--profile", type=pathlib.Path, default=ROOT / "configs" / "tiny_cpu.yaml")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--tree", type=pathlib.Path,
                        help="time this checkpoint tree as it stands (e.g. trained weights) instead of a fresh one")
    parser.add_argument("--service-log", type=pathlib.Path, default=pathlib.Path(tempfile.gettempdir())
                        / "bench_tiny_services.log", help="where the services' output goes")
    args = parser.parse_args()
    if args.requests < 2:
        parser.error(f"--requests={args.requests}: need at least 2 (one prompt update)")
    if args.warm < 1:
        parser.error(f"--warm={args.warm}: need at least 1")
    if args.tree is not None and not (args.tree / "COMPLETE").is_file():
        parser.error(f"--tree={args.tree}: not a complete checkpoint tree (no COMPLETE file)")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench_tiny_") as tmp:
        profile, port = write_profile(args.profile, pathlib.Path(tmp), model_dir=args.tree)
        url, http_url = f"ws://127.0.0.1:{port}/v1/realtime/video", f"http://127.0.0.1:{port}"
        started = time.monotonic()
        supervisor = bring_up_logged(profile, args.service_log)
        up_seconds = time.monotonic() - started
        try:
            before = scrape_stages(http_url)
            cold = run_session(url, args.requests, args.seed)
            after = scrape_stages(http_url)
            warm = [run_warm(url, args.seed + 1 + i) for i in range(args.warm)]
        finally:
            supervisor.stop_all()
    stages = {s: (after[s][0] - before[s][0], after[s][1] - before[s][1]) for s in STAGES}
    print(report(args, cold, warm, stages, up_seconds, (load_before, os.getloadavg())))
    print(f"(service logs: {args.service_log})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
