"""Keep a node's service processes running, as `restart: unless-stopped` would.

A `Supervisor` owns one child process per service. A child that exits is restarted after a backoff that doubles
with each exit inside the crash-loop window (1 s, 2 s, 4 s ... capped at 30 s); a child that stops answering its
liveness probe for `probe_failures` probes in a row (a wedged process: SIGSTOP, a deadlock) is killed and restarted
the same way. Every child runs in its own process group, and the whole group is killed before a restart, so what a
dead service spawned (a DiT group's ranks, a worker pool) never outlives it. Too many exits inside the window
(`crash_loop_exits` in `crash_loop_window_s`) is a crash loop: the supervisor gives up, and `run()` says which
service looped. Each restart is logged with the exit code or signal and counted in `vitascope_service_restarts_total`.

Knows nothing about what the services are: each is a command line and a liveness probe.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge

from services.common.errors import ServerError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RestartPolicy:
    """When and how fast a supervised service is restarted."""

    initial_backoff_s: float = 1.0
    """Wait before the first restart after an exit."""
    max_backoff_s: float = 30.0
    """The backoff doubles with each exit inside the window, up to this."""
    crash_loop_exits: int = 5
    """This many exits inside `crash_loop_window_s` is a crash loop: the supervisor gives up."""
    crash_loop_window_s: float = 120.0
    """The sliding window the exits are counted in."""
    probe_interval_s: float = 5.0
    """How often a running service's liveness probe is asked."""
    probe_failures: int = 3
    """A service that fails this many liveness probes in a row is wedged: killed and restarted."""
    start_grace_s: float = 600.0
    """A (re)started service is not probed for liveness until it first passes, or until this much time passed."""
    stop_grace_s: float = 15.0
    """On stop, SIGTERM first; SIGKILL what still runs after this."""

    def __post_init__(self) -> None:
        if not 0 < self.initial_backoff_s <= self.max_backoff_s:
            raise ValueError(f"initial_backoff_s={self.initial_backoff_s}, max_backoff_s={self.max_backoff_s}: "
                             "need 0 < initial_backoff_s <= max_backoff_s")
        if self.crash_loop_exits < 1 or self.crash_loop_window_s <= 0:
            raise ValueError(f"crash_loop_exits={self.crash_loop_exits}, crash_loop_window_s="
                             f"{self.crash_loop_window_s}: need at least one exit in a positive window")
        if self.probe_interval_s <= 0 or self.probe_failures < 1:
            raise ValueError(f"probe_interval_s={self.probe_interval_s}, probe_failures={self.probe_failures}: "
                             "need a positive interval and at least one failure")

    def backoff_s(self, recent_exits: int) -> float:
        """Seconds to wait before restarting a service that exited `recent_exits` times inside the window."""
        return min(self.max_backoff_s, self.initial_backoff_s * 2 ** max(recent_exits - 1, 0))


@dataclass(frozen=True)
class ServiceSpec:
    """One supervised service."""

    name: str
    command: Sequence[str]
    probe: Callable[[], bool]
    """True while the process answers (alive, whether or not it is ready); called from the supervisor's thread."""


class CrashLoop(ServerError):
    """A service exited `crash_loop_exits` times inside the window; the supervisor gave up."""


def describe_exit(returncode: int) -> str:
    """'exit code 3' or 'signal SIGKILL' for a child's return code."""
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"


@dataclass
class _Child:
    spec: ServiceSpec
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    live_once: bool = False
    probe_misses: int = 0
    next_probe_at: float = 0.0
    restart_at: float | None = None
    exits: deque[float] = field(default_factory=deque)


class SupervisorMetrics:
    """The supervisor's Prometheus series."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.restarts = Counter("vitascope_service_restarts", "Restarts of a supervised service, by reason",
                                ["service", "reason"], registry=registry)
        self.up = Gauge("vitascope_service_up", "1 while the supervised service's process runs", ["service"],
                        registry=registry)


class Supervisor:
    """Start, watch and restart a node's services (see the module docstring)."""

    def __init__(self, specs: Sequence[ServiceSpec], policy: RestartPolicy = RestartPolicy(),
                 registry: CollectorRegistry | None = None, clock: Callable[[], float] = time.monotonic,
                 spawn: Callable[[Sequence[str]], subprocess.Popen] | None = None) -> None:
        self.policy = policy
        self.metrics = SupervisorMetrics(registry if registry is not None else CollectorRegistry())
        self._clock = clock
        self._spawn = spawn or _spawn_in_own_group
        self._children = {s.name: _Child(s) for s in specs}
        self._stop = threading.Event()

    # -- the public surface --
    def start(self, name: str) -> subprocess.Popen:
        """Start one service now (the first start; restarts are the supervisor's own)."""
        return self._launch(self._children[name])

    def process(self, name: str) -> subprocess.Popen | None:
        """The service's current process (None while it waits for a restart)."""
        return self._children[name].proc

    def tick(self) -> None:
        """Reap exits, probe liveness, restart what is due; raises `CrashLoop` when a service loops."""
        now = self._clock()
        for child in self._children.values():
            if child.proc is not None and child.proc.poll() is not None:
                self._on_exit(child, now, describe_exit(child.proc.returncode), "exit")
            elif child.proc is not None and now >= child.next_probe_at:
                self._probe(child, now)
            if child.proc is None and child.restart_at is not None and now >= child.restart_at:
                child.restart_at = None
                self._launch(child)

    def run(self, tick_s: float = 0.5) -> None:
        """Tick until `stop()` is called or a service crash-loops (`CrashLoop` propagates)."""
        while not self._stop.wait(tick_s):
            self.tick()

    def stop(self) -> None:
        """Make `run()` return at its next tick (callable from a signal handler or another thread)."""
        self._stop.set()

    def stop_all(self) -> None:
        """SIGTERM every service's process group, then SIGKILL what still runs after the grace period."""
        procs = [c.proc for c in self._children.values() if c.proc is not None]
        for proc in procs:
            _signal_group(proc, signal.SIGTERM)
            _signal_group(proc, signal.SIGCONT)  # a stopped (wedged) process acts on SIGTERM only once continued
        deadline = time.monotonic() + self.policy.stop_grace_s
        for proc in procs:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                pass
            _signal_group(proc, signal.SIGKILL)  # the leader and anything its group still holds
            proc.wait()
        for child in self._children.values():
            child.proc = None
            self.metrics.up.labels(child.spec.name).set(0)
        for pid in _own_children():  # a service spawned as a Ctrl-C landed, before it was recorded (the
            with contextlib.suppress(ProcessLookupError, ChildProcessError):  # launcher has no other children)
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)

    # -- internals --
    def _launch(self, child: _Child) -> subprocess.Popen:
        child.proc = self._spawn(child.spec.command)
        child.started_at = self._clock()
        child.live_once = False
        child.probe_misses = 0
        child.next_probe_at = child.started_at + self.policy.probe_interval_s
        self.metrics.up.labels(child.spec.name).set(1)
        log.info("%s started (pid %d)", child.spec.name, child.proc.pid)
        return child.proc

    def _probe(self, child: _Child, now: float) -> None:
        child.next_probe_at = now + self.policy.probe_interval_s
        if child.spec.probe():
            child.live_once, child.probe_misses = True, 0
            return
        if not child.live_once and now - child.started_at < self.policy.start_grace_s:
            return  # still starting: loading weights is not being wedged
        child.probe_misses += 1
        if child.probe_misses >= self.policy.probe_failures:
            log.error("%s (pid %d) failed %d liveness probes in a row: killing it", child.spec.name,
                      child.proc.pid, child.probe_misses)
            _signal_group(child.proc, signal.SIGKILL)
            child.proc.wait()
            self._on_exit(child, now, f"wedged, killed after {child.probe_misses} failed liveness probes",
                          "wedged")

    def _on_exit(self, child: _Child, now: float, how: str, reason: str) -> None:
        proc, child.proc = child.proc, None
        _signal_group(proc, signal.SIGKILL)  # what the dead leader spawned goes with it
        self.metrics.up.labels(child.spec.name).set(0)
        window = self.policy.crash_loop_window_s
        child.exits.append(now)
        while child.exits and now - child.exits[0] > window:
            child.exits.popleft()
        if len(child.exits) >= self.policy.crash_loop_exits:
            log.error("%s (pid %d) exited (%s): %d exits in %.0f s is a crash loop; giving up", child.spec.name,
                      proc.pid, how, len(child.exits), window)
            raise CrashLoop(f"{child.spec.name} exited {len(child.exits)} times in {window:.0f} s (last: {how})")
        delay = self.policy.backoff_s(len(child.exits))
        child.restart_at = now + delay
        self.metrics.restarts.labels(child.spec.name, reason).inc()
        log.warning("%s (pid %d) exited (%s): restarting in %.1f s (exit %d of %d allowed in %.0f s)",
                    child.spec.name, proc.pid, how, delay, len(child.exits), self.policy.crash_loop_exits - 1,
                    window)


def _own_children() -> list[int]:
    """The pids of this process's live children, from /proc (empty where /proc has no children lists)."""
    pids: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/children") as f:
                pids += [int(pid) for pid in f.read().split()]
    return pids


def _spawn_in_own_group(command: Sequence[str]) -> subprocess.Popen:
    return subprocess.Popen(list(command), start_new_session=True)


def _signal_group(proc: subprocess.Popen, sig: signal.Signals) -> None:
    """Signal the child's whole process group (it leads one: `start_new_session`), else the child alone."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:  # no such group: the child leads none (or the group is gone)
        if proc.poll() is None:
            proc.send_signal(sig)

