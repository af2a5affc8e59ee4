"""Soak benchmark: `python -m tools.soak --sessions 1000 [--every 50] [--seconds 1.5]`.

Brings the four services up on a copy of a profile (tiny CPU by default: free ports, a temporary checkpoint), runs
N sessions one after another through the client library, and every `--every` sessions prints each process's
resident memory, open file descriptors and threads (from /proc), the gateway's active/queued sessions and the
leased CUDA IPC slots the stages report. At the end: each figure's change from the first sample (taken after the
warm-up sessions) to the last, against the targets (descriptors and threads constant, RSS growth under
`--rss-budget-mib` per process). The node rests `--rest-s` before those two samples: gRPC's event engine adds a
worker thread while all of its threads are busy and ends it after 20 s idle. Exit 1 when a session failed or a
target was missed.

Knows only the profile format, `services.up`, the client library and the stages' metrics and /healthz.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import pathlib
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass

import yaml

from services.client import ClientOptions, stream
from services.supervisor import Supervisor
from services.up import STAGES
from tools.bench_tiny import ROOT, bring_up_logged, write_profile

log = logging.getLogger("soak")

SERVICES = ("encoder", "dit", "vae", "gateway")
REST_S = 25.0
"""Idle seconds before a sample that is compared: gRPC's event engine ends a thread it added after 20 s idle."""
PROMPTS = ("a lighthouse on a cliff at dusk", "a red kite over green hills", "waves breaking on black rocks")


@dataclass(frozen=True)
class ProcessSample:
    """One process's footprint at one moment."""

    rss_mib: float
    fds: int
    threads: int


def process_sample(pid: int) -> ProcessSample:
    """RSS, open descriptors and threads of `pid`, from /proc."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return ProcessSample(rss_mib=int(fields["VmRSS"].split()[0]) / 1024, fds=len(os.listdir(f"/proc/{pid}/fd")),
                         threads=int(fields["Threads"]))


def settled_sample(pid: int, timeout_s: float = 5.0, interval_s: float = 0.2) -> ProcessSample:
    """`process_sample` once the descriptors and threads read the same twice in a row, `interval_s` apart (at most
    `timeout_s`): the gateway closes a session's websocket, and a stage's metrics server ends a scrape's handler
    thread, a moment after the client has returned. A descriptor or thread that stays is still counted."""
    deadline = time.monotonic() + timeout_s
    last = process_sample(pid)
    while time.monotonic() < deadline:
        time.sleep(interval_s)
        sample = process_sample(pid)
        if (sample.fds, sample.threads) == (last.fds, last.threads):
            return sample
        last = sample
    return last


def metric_total(url: str, name: str) -> float:
    """The sum of every sample of metric `name` at a Prometheus endpoint (0 when absent)."""
    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#") and line[len(name)] in " {")


@dataclass(frozen=True)
class NodeSample:
    """The node after `sessions` sessions."""

    sessions: int
    processes: dict[str, ProcessSample]
    active: int
    queued: int
    leased_slots: float


def node_sample(sessions: int, supervisor: Supervisor, http_url: str, metrics_urls: list[str]) -> NodeSample:
    """Sample every process once settled, then the gateway's occupancy and the leased IPC slots: the processes
    first, as a stage's metrics server answers each scrape on a thread (and socket) of its own."""
    processes = {name: settled_sample(supervisor.process(name).pid) for name in SERVICES}
    with urllib.request.urlopen(http_url + "/healthz", timeout=5) as reply:
        health = json.loads(reply.read())
    leased = sum(metric_total(url, "vitascope_ipc_leased_slots") for url in metrics_urls)
    return NodeSample(sessions, processes, int(health["sessions_active"]), int(health["sessions_queued"]), leased)


def soak_profile(base: pathlib.Path, workdir: pathlib.Path) -> tuple[pathlib.Path, int, list[str]]:
    """The bench profile with each stage's metrics on a free loopback port; (path, gateway port, metrics URLs)."""
    path, port = write_profile(base, workdir, metrics=True)
    raw = yaml.safe_load(path.read_text())
    urls = [f"http://127.0.0.1:{raw[stage]['metrics_port']}/metrics" for stage in STAGES]
    # every client comes from 127.0.0.1 here: the per-address limits would be what is measured
    raw["gateway"]["auth"] = {"max_connections_per_address": 1024, "starts_per_minute_per_address": 100_000}
    path.write_text(yaml.safe_dump(raw))
    return path, port, urls


def row(sample: NodeSample) -> str:
    cells = [f"{sample.sessions:6d}"]
    for name in SERVICES:
        p = sample.processes[name]
        cells.append(f"{p.rss_mib:7.1f} {p.fds:4d} {p.threads:3d}")
    cells.append(f"{sample.active}/{sample.queued}/{sample.leased_slots:.0f}")
    return " | ".join(cells)


HEADER = " | ".join(["sessions", *(f"{n:>7} MiB  fd thr" for n in SERVICES), "active/queued/leased"])


def verdict(first: NodeSample, last: NodeSample, rss_budget_mib: float) -> list[str]:
    """One line per process (growth from `first` to `last`), each ending in ok or MISSED."""
    lines = []
    for name in SERVICES:
        a, b = first.processes[name], last.processes[name]
        ok = b.fds == a.fds and b.threads == a.threads and b.rss_mib - a.rss_mib < rss_budget_mib
        lines.append(f"{name:8s} RSS {a.rss_mib:.1f} -> {b.rss_mib:.1f} MiB ({b.rss_mib - a.rss_mib:+.1f}, budget "
                     f"{rss_budget_mib:g}), fds {a.fds} -> {b.fds}, threads {a.threads} -> {b.threads}: "
                     f"{'ok' if ok else 'MISSED'}")
    idle = last.active == 0 and last.queued == 0 and last.leased_slots == 0
    lines.append(f"node     active {last.active}, queued {last.queued}, leased slots {last.leased_slots:.0f}: "
                 f"{'ok' if idle else 'MISSED'}")
    return lines


async def run_sessions(url: str, count: int, seconds: float, first_index: int) -> int:
    """Run `count` sessions one after another; the number that failed."""
    failed = 0
    for i in range(count):
        k = first_index + i
        try:
            result = await stream(ClientOptions(url=url, prompt=PROMPTS[k % len(PROMPTS)], seconds=seconds,
                                                seed=k, ping_interval_s=5.0))
            if not result.chunks or result.errors:
                raise RuntimeError(f"{len(result.chunks)} chunks, errors {result.errors}")
        except Exception as exc:  # noqa: BLE001 - a soak counts failures and goes on
            failed += 1
            log.error("session %d failed: %s", k, exc)
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", type=pathlib.Path, default=ROOT / "configs" / "tiny_cpu.yaml")
    parser.add_argument("--sessions", type=int, default=1000)
    parser.add_argument("--every", type=int, default=50, help="sample the node every N sessions")
    parser.add_argument("--warmup", type=int, default=20, help="sessions before the first sample")
    parser.add_argument("--seconds", type=float, default=1.5, help="media seconds per session before session.stop")
    parser.add_argument("--rss-budget-mib", type=float, default=20.0)
    parser.add_argument("--rest-s", type=float, default=REST_S, help="idle seconds before the first and last sample")
    parser.add_argument("--service-log", default="/tmp/vitascope_soak_services.log")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    with tempfile.TemporaryDirectory(prefix="soak_") as tmp:
        profile, port, metrics_urls = soak_profile(args.profile, pathlib.Path(tmp))
        url, http_url = f"ws://127.0.0.1:{port}/v1/realtime/video", f"http://127.0.0.1:{port}"
        supervisor = bring_up_logged(profile, args.service_log)
        try:
            started = time.monotonic()
            failed = asyncio.run(run_sessions(url, args.warmup, args.seconds, 0))
            done = args.warmup
            time.sleep(args.rest_s)
            samples = [node_sample(0, supervisor, http_url, metrics_urls)]
            print(f"soak: {args.sessions} sessions of {args.seconds:g} s media after {args.warmup} warm-up ones "
                  f"(profile {args.profile.name}, {os.cpu_count()} CPUs)\n{HEADER}\n{row(samples[0])}", flush=True)
            while done - args.warmup < args.sessions:
                batch = min(args.every, args.sessions - (done - args.warmup))
                failed += asyncio.run(run_sessions(url, batch, args.seconds, done))
                done += batch
                if done - args.warmup == args.sessions:
                    time.sleep(args.rest_s)
                samples.append(node_sample(done - args.warmup, supervisor, http_url, metrics_urls))
                print(row(samples[-1]), flush=True)
            elapsed = time.monotonic() - started
        finally:
            supervisor.stop_all()
    lines = verdict(samples[0], samples[-1], args.rss_budget_mib)
    print("\n".join([*lines, f"{done} sessions in {elapsed:.0f} s, {failed} failed"]), flush=True)
    return 0 if failed == 0 and all(line.endswith("ok") for line in lines) else 1


if __name__ == "__main__":
    sys.exit(main())
