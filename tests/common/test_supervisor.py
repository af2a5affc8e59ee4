"""The supervisor restarts a service that exits or wedges, with backoff, kills what it spawned, and gives up loudly on
a crash loop. Real child processes, short policy times."""
import os
import signal
import subprocess
import sys
import time

import pytest
from prometheus_client import CollectorRegistry

from services.supervisor import CrashLoop, RestartPolicy, ServiceSpec, Supervisor, describe_exit

pytestmark = pytest.mark.cpu

FAST = RestartPolicy(initial_backoff_s=0.1, max_backoff_s=0.4, crash_loop_exits=4, crash_loop_window_s=30,
                     probe_interval_s=0.1, probe_failures=2, start_grace_s=0.2, stop_grace_s=2)
SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def _tick_until(supervisor: Supervisor, done, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "the supervisor did not get there in time"
        supervisor.tick()
        time.sleep(0.02)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _restarts(registry: CollectorRegistry, service: str, reason: str) -> float:
    return registry.get_sample_value("vitascope_service_restarts_total", {"service": service, "reason": reason}) or 0


def test_backoff_doubles_from_one_second_to_thirty():
    policy = RestartPolicy()
    assert [policy.backoff_s(n) for n in range(1, 8)] == [1, 2, 4, 8, 16, 30, 30]


@pytest.mark.parametrize("kwargs, match", [
    ({"initial_backoff_s": 0}, "initial_backoff_s=0"),
    ({"initial_backoff_s": 40}, "max_backoff_s=30"),
    ({"crash_loop_exits": 0}, "crash_loop_exits=0"),
    ({"probe_failures": 0}, "probe_failures=0"),
])
def test_a_bad_policy_is_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RestartPolicy(**kwargs)


def test_exit_codes_and_signals_are_described():
    assert describe_exit(3) == "exit code 3"
    assert describe_exit(-signal.SIGKILL) == "signal SIGKILL"


def test_a_killed_service_is_restarted_and_counted_while_the_others_run():
    registry = CollectorRegistry()
    sup = Supervisor([ServiceSpec("dit", SLEEPER, lambda: True), ServiceSpec("vae", SLEEPER, lambda: True)],
                     FAST, registry)
    try:
        first, other = sup.start("dit"), sup.start("vae")
        os.kill(first.pid, signal.SIGKILL)
        _tick_until(sup, lambda: sup.process("dit") is not None and sup.process("dit").pid != first.pid)
        assert sup.process("vae") is other and other.poll() is None
        assert _restarts(registry, "dit", "exit") == 1 and _restarts(registry, "vae", "exit") == 0
        assert registry.get_sample_value("vitascope_service_up", {"service": "dit"}) == 1
    finally:
        sup.stop_all()


def test_the_restart_waits_for_the_backoff(caplog):
    sup = Supervisor([ServiceSpec("encoder", [sys.executable, "-c", "raise SystemExit(7)"], lambda: True)],
                     RestartPolicy(initial_backoff_s=0.5, max_backoff_s=1, crash_loop_exits=3,
                                   crash_loop_window_s=30, start_grace_s=0.1))
    try:
        sup.start("encoder").wait()
        caplog.set_level("WARNING")
        sup.tick()
        exited_at = time.monotonic()
        assert sup.process("encoder") is None
        assert "exited (exit code 7): restarting in 0.5 s" in caplog.text
        _tick_until(sup, lambda: sup.process("encoder") is not None)
        assert time.monotonic() - exited_at >= 0.45
    finally:
        sup.stop_all()


def test_a_crash_loop_stops_the_supervisor_naming_the_service():
    sup = Supervisor([ServiceSpec("vae", [sys.executable, "-c", "raise SystemExit(1)"], lambda: True)], FAST)
    try:
        sup.start("vae")
        with pytest.raises(CrashLoop, match=r"vae exited 4 times in 30 s \(last: exit code 1\)"):
            _tick_until(sup, lambda: False, timeout=20)
    finally:
        sup.stop_all()


def test_a_wedged_service_is_killed_and_restarted():
    registry = CollectorRegistry()
    answering = {"ok": True}
    sup = Supervisor([ServiceSpec("dit", SLEEPER, lambda: answering["ok"])], FAST, registry)
    try:
        first = sup.start("dit")
        _tick_until(sup, lambda: sup._children["dit"].live_once)
        os.kill(first.pid, signal.SIGSTOP)
        answering["ok"] = False  # a stopped process answers no probe
        _tick_until(sup, lambda: _restarts(registry, "dit", "wedged") == 1)
        assert not _alive(first.pid)
        answering["ok"] = True
        _tick_until(sup, lambda: sup.process("dit") is not None)
        assert sup.process("dit").pid != first.pid
    finally:
        sup.stop_all()


def test_a_service_that_never_answered_is_not_killed_while_it_starts():
    sup = Supervisor([ServiceSpec("dit", SLEEPER, lambda: False)],
                     RestartPolicy(probe_interval_s=0.05, probe_failures=1, start_grace_s=60))
    try:
        proc = sup.start("dit")
        for _ in range(20):
            sup.tick()
            time.sleep(0.02)
        assert sup.process("dit") is proc and proc.poll() is None
    finally:
        sup.stop_all()


def test_what_a_dead_service_spawned_dies_with_it():
    spawner = [sys.executable, "-c",
               "import subprocess, sys, time\n"
               "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
               "print(child.pid, flush=True)\n"
               "time.sleep(60)"]
    sup = Supervisor([ServiceSpec("dit", spawner, lambda: True)], FAST,
                     spawn=lambda cmd: subprocess.Popen(list(cmd), start_new_session=True, stdout=subprocess.PIPE,
                                                        text=True))
    try:
        leader = sup.start("dit")
        rank = int(leader.stdout.readline())
        assert _alive(rank)
        os.kill(leader.pid, signal.SIGKILL)
        _tick_until(sup, lambda: sup.process("dit") is not leader)
        deadline = time.monotonic() + 5
        while _alive(rank) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(rank), "the dead service's child outlived it"
    finally:
        sup.stop_all()


def test_stop_all_stops_a_stopped_process_too():
    sup = Supervisor([ServiceSpec("vae", SLEEPER, lambda: True)], FAST)
    proc = sup.start("vae")
    os.kill(proc.pid, signal.SIGSTOP)
    sup.stop_all()
    assert proc.poll() is not None and sup.process("vae") is None
