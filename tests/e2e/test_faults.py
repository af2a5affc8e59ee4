"""Faults on the real tiny node: each of the four processes killed (-9) during a session, and a wedged stage.

One module-scoped node (`services.up.bring_up` on a temporary copy of `configs/tiny_cpu.yaml`, supervised in a
background thread, liveness probed every second). Each test starts a session, breaks one process while media
flows, and checks what the client saw (a named error within 2 s, the media before it still decodable), that the
node heals by itself (`/healthz` 200 again, the process restarted, nothing it spawned left behind), that the next
session streams a valid fMP4, and that no slot, lease or queue place is left held.
"""
from __future__ import annotations

import asyncio
import io
import json
import os
import pathlib
import signal
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import aiohttp
import av
import pytest
import yaml

from services.client import ClientOptions, stream
from services.supervisor import RestartPolicy, Supervisor
from services.up import bring_up
from tools.ports import free_ports

pytestmark = [pytest.mark.cpu, pytest.mark.e2e]

REPO = pathlib.Path(__file__).resolve().parents[2]
HEAL_TIMEOUT_S = 120.0
POLICY = RestartPolicy(initial_backoff_s=0.5, max_backoff_s=2.0, crash_loop_exits=20, crash_loop_window_s=300,
                       probe_interval_s=1.0, probe_failures=3, start_grace_s=300.0)


@dataclass
class Node:
    supervisor: Supervisor
    ws_url: str
    http_url: str
    metrics_urls: dict[str, str]


@pytest.fixture(scope="module")
def node(tmp_path_factory) -> Node:
    tmp = tmp_path_factory.mktemp("faults")
    raw = yaml.safe_load((REPO / "configs" / "tiny_cpu.yaml").read_text())
    raw["profile"] = "tiny_cpu_faults"
    raw["model"]["dir"] = str(tmp / "checkpoint")
    raw["model"]["write_if_missing"] = True
    ports = iter(free_ports(7))
    raw["endpoints"] = {name: f"127.0.0.1:{next(ports)}" for name in ("encoder", "dit", "vae")}
    metrics = {}
    for stage in ("encoder", "dit", "vae"):
        raw[stage]["metrics_port"] = port = next(ports)
        metrics[stage] = f"http://127.0.0.1:{port}/metrics"
    raw["gateway"]["port"] = gateway_port = next(ports)
    raw["gateway"]["stall_timeout_s"] = 30.0
    raw["gateway"]["backend_wait_s"] = 60.0
    profile = tmp / "profile.yaml"
    profile.write_text(yaml.safe_dump(raw))
    supervisor = bring_up(profile, POLICY)
    runner = threading.Thread(target=supervisor.run, kwargs={"tick_s": 0.2}, daemon=True)
    runner.start()
    try:
        yield Node(supervisor, f"ws://127.0.0.1:{gateway_port}/v1/realtime/video",
                   f"http://127.0.0.1:{gateway_port}", metrics)
    finally:
        supervisor.stop()
        runner.join(timeout=10)
        supervisor.stop_all()


def _healthz(node: Node) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(node.http_url + "/healthz", timeout=3) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")
    except OSError:
        return 0, {}


def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url, timeout=3) as reply:
        text = reply.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and line[len(name)] in " {")


def _wait_healed(node: Node, name: str, old_pid: int) -> float:
    """Seconds until the node answers /healthz 200 with a new process for `name`."""
    started = time.monotonic()
    while True:
        proc = node.supervisor.process(name)
        status, _ = _healthz(node)
        if status == 200 and proc is not None and proc.pid != old_pid:
            return time.monotonic() - started
        assert time.monotonic() - started < HEAL_TIMEOUT_S, f"{name} not healed: /healthz {_healthz(node)}"
        time.sleep(0.2)


def _group_members(pgid: int) -> list[int]:
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                members.append(int(entry))
    return members


def _frames(data: bytes) -> int:
    with av.open(io.BytesIO(data)) as container:
        return sum(1 for _ in container.decode(video=0))


@dataclass
class Broken:
    media: bytes
    chunks: int
    error: dict | None
    """The first error without an event id (the session's own end)."""
    update_error: dict | None
    """The first error about a prompt update."""
    error_delay_s: float | None
    """Seconds from the fault, or from the last media made before it arrived, to the error."""
    done: bool


async def _session_broken_by(node: Node, fault, update_after: bool = False) -> Broken:
    """Start an unbounded session and apply `fault()` after two media chunks; with `update_after`, send a prompt
    update and then session.stop once the next chunk is in. Read until the session ends."""
    media, chunks, error, update_error, broke_at, error_at, done = bytearray(), 0, None, None, None, None, False
    last_media_at = None
    async with aiohttp.ClientSession() as http, http.ws_connect(node.ws_url, max_msg_size=0) as ws:
        await ws.send_json({"type": "session.start", "prompt": "a lantern over a dark lake", "seed": 3})
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            msg = await ws.receive(timeout=60)
            if msg.type == aiohttp.WSMsgType.BINARY:
                media.extend(msg.data)
                chunks += 1
                last_media_at = time.monotonic()
                if chunks == 2 and broke_at is None:
                    fault()
                    broke_at = time.monotonic()
                elif chunks == 3 and update_after:
                    await ws.send_json({"type": "session.interaction", "interaction": {
                        "event_id": "after-fault", "event": {"prompt": "the lantern drifts away"}}})
                    await ws.send_json({"type": "session.stop"})
            elif msg.type == aiohttp.WSMsgType.TEXT:
                body = json.loads(msg.data)
                if body["type"] == "error" and body.get("event_id"):
                    update_error = update_error or body
                elif body["type"] == "error" and error is None:
                    error, error_at = body, time.monotonic()
                if body["type"] == "session.done":
                    done = True
                    break
            else:
                break
    delay = None if error_at is None or broke_at is None else error_at - max(broke_at, last_media_at)
    return Broken(bytes(media), chunks, error, update_error, delay, done)


def _assert_idle(node: Node) -> None:
    deadline = time.monotonic() + 20
    while True:
        _, health = _healthz(node)
        leased = sum(_metric(url, "vitascope_ipc_leased_slots") for url in node.metrics_urls.values())
        active = _metric(node.metrics_urls["dit"], "vitascope_active_sessions")
        if health.get("sessions_active") == 0 and health.get("sessions_queued") == 0 and leased == 0 and not active:
            return
        assert time.monotonic() < deadline, f"not idle: {health}, leased {leased}, dit active {active}"
        time.sleep(0.2)


def _assert_next_session_streams(node: Node) -> None:
    result = asyncio.run(stream(ClientOptions(url=node.ws_url, prompt="a red kite over green hills", seconds=1.5,
                                              seed=5)))
    assert not result.errors and result.done is not None
    assert _frames(bytes(result.data)) == sum(c.num_frames for c in result.chunks)


@pytest.mark.parametrize("stage", ["dit", "vae"])
def test_a_killed_stage_fails_the_session_by_name_and_the_node_heals(node, stage):
    victim = node.supervisor.process(stage)
    broken = asyncio.run(_session_broken_by(node, lambda: os.kill(victim.pid, signal.SIGKILL)))
    assert broken.error is not None and broken.error["code"] == "backend_failed", broken.error
    assert stage in broken.error["message"] and broken.error.get("fault") == "server"
    assert broken.error_delay_s < 2.0
    assert _frames(broken.media) > 0  # what came before the fault still decodes
    healed_s = _wait_healed(node, stage, victim.pid)
    print(f"kill -9 {stage}: error {broken.error['code']} {broken.error_delay_s:.2f} s after the last media, "
          f"{_frames(broken.media)} frames before it decoded, healed in {healed_s:.1f} s")
    assert _group_members(victim.pid) == []  # nothing the dead stage spawned outlived it
    _assert_next_session_streams(node)
    _assert_idle(node)


def test_a_killed_encoder_fails_only_the_prompt_update_and_the_node_heals(node):
    victim = node.supervisor.process("encoder")  # not on a running session's path until a prompt changes
    broken = asyncio.run(_session_broken_by(node, lambda: os.kill(victim.pid, signal.SIGKILL), update_after=True))
    assert broken.error is None and broken.done, broken.error
    assert broken.update_error is not None and "encoder" in broken.update_error["message"], broken.update_error
    assert _frames(broken.media) > 0
    print(f"kill -9 encoder: the update failed ({broken.update_error['code']}), the session ended with "
          f"session.done, healed in {_wait_healed(node, 'encoder', victim.pid):.1f} s")
    assert _group_members(victim.pid) == []
    _assert_next_session_streams(node)
    _assert_idle(node)


def test_a_killed_gateway_frees_every_slot_and_comes_back(node):
    victim = node.supervisor.process("gateway")
    broken = asyncio.run(_session_broken_by(node, lambda: os.kill(victim.pid, signal.SIGKILL)))
    assert broken.error is None and broken.chunks >= 2  # the connection just ends
    assert _frames(broken.media) > 0
    started = time.monotonic()  # the stages see the gateway's calls end and free the session
    while _metric(node.metrics_urls["dit"], "vitascope_active_sessions"):
        assert time.monotonic() - started < 5.0, "the DiT still holds the dead gateway's session"
        time.sleep(0.1)
    freed_s = time.monotonic() - started
    print(f"kill -9 gateway: the DiT freed the session in {freed_s:.2f} s, healed in "
          f"{_wait_healed(node, 'gateway', victim.pid):.1f} s")
    _assert_next_session_streams(node)
    _assert_idle(node)


def test_a_wedged_stage_fails_the_session_by_name_and_is_restarted(node):
    victim = node.supervisor.process("dit")
    broken = asyncio.run(_session_broken_by(node, lambda: os.kill(victim.pid, signal.SIGSTOP)))
    assert broken.error is not None and broken.error["code"] in ("stall_timeout", "backend_failed"), broken.error
    assert _frames(broken.media) > 0
    print(f"SIGSTOP dit: error {broken.error['code']} {broken.error_delay_s:.1f} s after the last media, healed in "
          f"{_wait_healed(node, 'dit', victim.pid):.1f} s")
    assert _group_members(victim.pid) == []
    _assert_next_session_streams(node)
    _assert_idle(node)
