"""CI-sized soak and load on the real tiny node: the figures of `python -m tools.soak` and `python -m tools.load`
are benchmarks (docs/performance.md); these pin what must not drift at all.

- 50 sequential sessions: every process ends with the descriptors and threads it had after the warm-up, the node
  idle (no session, queue place or leased slot).
- 18 concurrent clients of every behaviour of the load tool: each ends named, and the node returns to idle by
  itself.
- Nothing of the node listens on a wildcard address.
"""
from __future__ import annotations

import asyncio
import pathlib
import time

import pytest

from services.common.config import load_profile
from services.up import SERVICES, bring_up
from tests.common.test_stage_binding import _listeners
from tools.load import acceptable, run_load, wait_idle
from tools.soak import REST_S, node_sample, run_sessions, soak_profile

pytestmark = [pytest.mark.cpu, pytest.mark.e2e]

REPO = pathlib.Path(__file__).resolve().parents[2]
WARMUP, SESSIONS = 8, 50
LATE_S = 60.0


def counts(sample) -> dict[str, tuple[int, int]]:
    return {name: (p.fds, p.threads) for name, p in sample.processes.items()}


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    profile, port, metrics_urls = soak_profile(REPO / "configs" / "tiny_cpu.yaml", tmp_path_factory.mktemp("soak"))
    supervisor = bring_up(profile)
    try:
        yield supervisor, f"ws://127.0.0.1:{port}/v1/realtime/video", f"http://127.0.0.1:{port}", metrics_urls, profile
    finally:
        supervisor.stop_all()


def test_sequential_sessions_leak_no_descriptor_or_thread(node):
    supervisor, url, http_url, metrics_urls, _ = node
    assert asyncio.run(run_sessions(url, WARMUP, 1.5, 0)) == 0
    time.sleep(REST_S)  # gRPC's event engine ends a thread it added after 20 s idle
    before = node_sample(0, supervisor, http_url, metrics_urls)
    started = time.monotonic()
    assert asyncio.run(run_sessions(url, SESSIONS, 1.5, WARMUP)) == 0
    time.sleep(REST_S)
    after = node_sample(SESSIONS, supervisor, http_url, metrics_urls)
    deadline = time.monotonic() + LATE_S  # a loaded machine can retire an idle worker late; a leak never returns
    while counts(after) != counts(before) and time.monotonic() < deadline:
        time.sleep(1.0)
        after = node_sample(SESSIONS, supervisor, http_url, metrics_urls)
    print(f"{SESSIONS} sessions in {time.monotonic() - started:.0f} s")
    for name in SERVICES:
        a, b = before.processes[name], after.processes[name]
        print(f"{name}: RSS {a.rss_mib:.1f} -> {b.rss_mib:.1f} MiB, fds {a.fds} -> {b.fds}, "
              f"threads {a.threads} -> {b.threads}")
        assert (b.fds, b.threads) == (a.fds, a.threads), name
    assert (after.active, after.queued, after.leased_slots) == (0, 0, 0)


def test_concurrent_clients_of_every_behaviour_end_named_and_the_node_returns_to_idle(node):
    supervisor, url, http_url, metrics_urls, _ = node
    results = asyncio.run(run_load(url, 18, timeout_s=150))
    unnamed = [(behaviour, outcome) for behaviour, outcome, _ in results if not acceptable(outcome)]
    assert unnamed == []
    idle, state = wait_idle(http_url, metrics_urls, timeout_s=30)
    assert idle, state
    assert all(supervisor.process(name).poll() is None for name in SERVICES)  # no restart was needed


def test_nothing_listens_on_a_wildcard_address(node):
    _, url, _, metrics_urls, profile = node
    endpoints = load_profile(profile).endpoints
    ports = {int(url.split(":")[2].split("/")[0])} | {endpoints.port_of(s) for s in ("encoder", "dit", "vae")}
    ports |= {int(u.rsplit(":", 1)[1].split("/")[0]) for u in metrics_urls}
    assert {port: _listeners(port) for port in ports} == {port: {"0100007F"} for port in ports}  # 127.0.0.1 only
