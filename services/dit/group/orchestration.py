"""Rank orchestration of a Ulysses DiT group: rank 0 serves, ranks 1..N-1 follow in lock-step.

Rank 0 owns the public API (`DiTGroup.open_session` -> `GroupSession.next_phase / submit_prompt / cancel /
close`). Before every step it broadcasts one counter-checked control record (a small pickled dataclass over a gloo
group); the step's tensors (prompt embeddings) follow over the device group. Every rank then runs the same
`StreamingSession` code on its own head shard, so the KV cache decisions are identical by construction. Timing
dependent decisions are taken on rank 0 only and sent as records: prompt updates are applied at step boundaries,
the hold waits on rank 0 (the ranks' own sessions never hold), and cancellation is agreed at every check point of
the runtime by a one-byte broadcast. A dead or stuck rank fails the group: a watchdog polls the worker processes
and the age of the running step, collectives carry timeouts, and rank 0 then raises `GroupFailed` and calls the
failure callbacks (the service reports NOT_SERVING). Every collective is a `@distributed_op` method of
`RankGroup`. Knows nothing about gRPC, the model's internals or how the processes were started.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import pickle
import threading
import time
from datetime import timedelta
from typing import Callable, TypeVar

import torch
import torch.distributed as dist

from services.common.errors import NoCapacity, StageFailed
from services.dit.api import (HoldConfig, PhaseOutput, PromptUpdate, RuntimeConfig, SessionCancelled, SessionClosed,
                              SessionConfig)
from services.dit.group.control import (CancelSession, CloseSession, ControlRecord, Heartbeat, NextPhase, OpenSession,
                                  RunOnRanks, PromptSpec, QueryStatus, RankStatus, Shutdown, SubmitPrompt,
                                  rank_status)
from services.dit.stream.runtime import DiTRuntime, StreamingSession
from services.dit.stream.session import CancelToken

log = logging.getLogger(__name__)
T = TypeVar("T")


class GroupFailed(StageFailed):
    """A rank of the DiT group died, timed out or diverged; the group is down and must be restarted."""


# ---- the communicator ---------------------------------------------------------------------------------------
def distributed_op(fn):
    """Mark a `RankGroup` method as a collective: refuse on a failed group, turn backend errors into GroupFailed."""

    @functools.wraps(fn)
    def wrapper(self: "RankGroup", *args, **kwargs):
        if self.failure is not None:
            raise GroupFailed(f"the DiT group is down: {self.failure}")
        try:
            return fn(self, *args, **kwargs)
        except GroupFailed:
            raise
        except (RuntimeError, OSError) as exc:  # gloo / NCCL errors, timeouts, closed connections
            self.fail(f"{self.diagnose()}{fn.__name__} on rank {self.rank}: {exc}")
            raise GroupFailed(f"the DiT group is down: {self.failure}") from exc

    wrapper.distributed_op = True
    return wrapper


class RankGroup:
    """One rank's process groups: the device group (NCCL or gloo, tensors) and a gloo control group (records)."""

    def __init__(self, rank: int, world_size: int, device: torch.device, timeout_s: float):
        self.rank, self.world_size, self.device = rank, world_size, device
        self.timeout = timedelta(seconds=timeout_s)
        self.control = dist.new_group(backend="gloo", timeout=self.timeout)
        self.counter = 0
        self.failure: str | None = None
        self.lock = threading.RLock()
        """Rank 0: held for every record and the step it announces, so collectives never interleave."""
        self._callbacks: list[Callable[[str], None]] = []
        self._fail_lock = threading.Lock()
        self.diagnose: Callable[[], str] = lambda: ""
        """Rank 0: names the worker ranks that died, as a prefix of a failed collective's reason."""

    @classmethod
    def init(cls, rank: int, world_size: int, device: torch.device, store: "dist.Store", timeout_s: float
             ) -> "RankGroup":
        """Join the group through `store`, which every rank has reached (`launch.rendezvous`): NCCL on CUDA
        devices, gloo otherwise; both with `timeout_s` on init and collectives."""
        backend = "nccl" if device.type == "cuda" else "gloo"
        try:
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=timeout_s),
                                    device_id=device if device.type == "cuda" else None)
            return cls(rank, world_size, device, timeout_s)
        except (RuntimeError, OSError, ValueError) as exc:
            raise GroupFailed(f"rank {rank} could not join the DiT group: {exc}") from exc

    def host_group(self) -> "dist.ProcessGroup":
        """Another group of every rank, on gloo (host tensors) with the group's timeout, for work that runs beside
        the device group's collectives from another thread. Not a second NCCL communicator: NCCL requires that
        operations on two communicators never overlap (two that did hung the DiT group on 2xH200). Every rank must
        call this at the same point."""
        return dist.new_group(ranks=list(range(self.world_size)), timeout=self.timeout, backend="gloo")

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Call `callback(reason)` once when the group fails (from whichever thread notices)."""
        self._callbacks.append(callback)

    def fail(self, reason: str) -> None:
        """Mark the group failed (first reason wins), run the callbacks, abort the device group to unblock ops."""
        with self._fail_lock:  # the watchdog and a failed collective may notice at once: one runs the rest
            if self.failure is not None:
                return
            self.failure = reason
        log.error("DiT group failed: %s", reason)
        for callback in self._callbacks:
            try:
                callback(reason)
            except Exception:  # a broken callback must not hide the group failure
                log.exception("group failure callback %r raised", callback)
        if self.device.type == "cuda":
            try:
                dist.distributed_c10d._abort_process_group()
            except Exception:  # abort is best effort; the collective timeout is the backstop
                log.exception("aborting the NCCL group failed")

    # -- collectives --
    @distributed_op
    def send_control(self, record: ControlRecord) -> None:
        """Rank 0: broadcast the next counter-stamped control record."""
        self.counter += 1
        payload = torch.frombuffer(bytearray(pickle.dumps((self.counter, record))), dtype=torch.uint8)
        dist.broadcast(torch.tensor([payload.numel()], dtype=torch.int64), src=0, group=self.control)
        dist.broadcast(payload, src=0, group=self.control)

    @distributed_op
    def recv_control(self) -> ControlRecord:
        """Ranks 1..N-1: receive the next control record; a skipped or repeated counter fails the group."""
        size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, src=0, group=self.control)
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(payload, src=0, group=self.control)
        counter, record = pickle.loads(payload.numpy().tobytes())
        if counter != self.counter + 1:
            self.fail(f"rank {self.rank} got control record #{counter} after #{self.counter}")
            raise GroupFailed(f"the DiT group is down: {self.failure}")
        self.counter = counter
        return record

    @distributed_op
    def broadcast_prompt(self, spec: PromptSpec, embedding: torch.Tensor | None) -> torch.Tensor:
        """Broadcast one float32 prompt embedding `[rows, width]` from rank 0 over the device group."""
        if self.rank == 0:
            t = embedding.to(self.device, torch.float32).contiguous()
        else:
            t = torch.empty(spec.rows, spec.width, dtype=torch.float32, device=self.device)
        dist.broadcast(t, src=0)
        return t

    @distributed_op
    def agree(self, flag: bool) -> bool:
        """Every rank returns rank 0's flag (one byte over the control group)."""
        t = torch.tensor([int(flag)], dtype=torch.uint8)
        dist.broadcast(t, src=0, group=self.control)
        return bool(t.item())

    @distributed_op
    def gather_status(self, status: RankStatus) -> list[RankStatus]:
        """Every rank's status, in rank order."""
        out: list[RankStatus | None] = [None] * self.world_size
        dist.all_gather_object(out, status, group=self.control)
        return out

    @distributed_op
    def verify_replicas(self, model: torch.nn.Module) -> None:
        """Check that every rank holds the same weights (a float64 fingerprint per parameter)."""
        names, prints = [], []
        for name, p in model.named_parameters():
            names.append(name)
            prints.append(p.detach().flatten()[:4096].double().sum())
        mine = torch.stack(prints).cpu() if prints else torch.zeros(0, dtype=torch.float64)
        every = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(every, mine, group=self.control)
        for r, theirs in enumerate(every):
            diff = (theirs != mine).nonzero()
            if diff.numel():
                self.fail(f"rank {r} holds different weights from rank {self.rank} (first: {names[diff[0, 0]]})")
                raise GroupFailed(f"the DiT group is down: {self.failure}")

    def destroy(self) -> None:
        """Leave the process groups (safe to call after a failure)."""
        if dist.is_initialized():
            dist.destroy_process_group()


class GroupCancelToken(CancelToken):
    """Cancellation agreed by all ranks: `check()` broadcasts rank 0's flag, so every rank raises at the same point."""

    def __init__(self, group: RankGroup):
        super().__init__()
        self.group = group

    def check(self) -> None:
        if self.group.agree(self.cancelled):
            self.cancel()
            raise SessionCancelled("the session was cancelled")


# ---- workers ------------------------------------------------------------------------------------------------
def _open_local(runtime: DiTRuntime, group: RankGroup, config: SessionConfig, prompt: PromptUpdate,
                fallback: PromptUpdate | None) -> StreamingSession:
    session = runtime.open_session(dataclasses.replace(config, hold=HoldConfig()), prompt, fallback)
    session.cancel_token = GroupCancelToken(group)
    return session


def worker_loop(group: RankGroup, runtime: DiTRuntime) -> None:
    """Ranks 1..N-1: execute rank 0's records until `Shutdown`; any error propagates (the process exits)."""
    session: StreamingSession | None = None
    fallback: PromptUpdate | None = None
    while True:
        record = group.recv_control()
        if isinstance(record, Heartbeat):
            continue
        if isinstance(record, Shutdown):
            if session is not None:
                session.close()
            log.info("rank %d: shutdown", group.rank)
            return
        if isinstance(record, QueryStatus):
            group.gather_status(rank_status(group.rank, session))
        elif isinstance(record, RunOnRanks):
            record.fn(runtime)
        elif isinstance(record, OpenSession):
            prompt = PromptUpdate(group.broadcast_prompt(record.prompt, None), record.prompt.event_id)
            fallback = None
            if record.fallback is not None:
                fallback = PromptUpdate(group.broadcast_prompt(record.fallback, None), record.fallback.event_id)
            session = _open_local(runtime, group, record.config, prompt, fallback)
        elif session is None:
            raise GroupFailed(f"rank {group.rank}: {type(record).__name__} arrived without an open session")
        elif isinstance(record, SubmitPrompt):
            session.submit_prompt(PromptUpdate(group.broadcast_prompt(record.prompt, None), record.prompt.event_id))
        elif isinstance(record, NextPhase):
            if record.use_fallback:
                session.submit_prompt(fallback)
            try:
                session.next_phase()
            except SessionCancelled:
                session = None  # released by the runtime, exactly as on rank 0
        elif isinstance(record, CancelSession):
            session.cancel()
            session = None
        elif isinstance(record, CloseSession):
            session.close()
            session = None
        else:
            raise GroupFailed(f"rank {group.rank}: unknown control record {record!r}")


# ---- rank 0 -------------------------------------------------------------------------------------------------
def _spec(prompt: PromptUpdate) -> PromptSpec:
    rows, width = prompt.embedding.shape
    return PromptSpec(prompt.event_id, rows, width)


class _RankZero:
    """A read-only attribute of a `GroupSession` that is its rank 0 session's (`local`) attribute of the same name."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, session: "GroupSession | None", owner: type | None = None):
        return self if session is None else getattr(session.local, self.name)


class GroupSession:
    """Rank 0's handle of the group's session (a `DiTSession`, as `StreamingSession` is); each call drives every
    rank."""

    def __init__(self, group: "DiTGroup", local: StreamingSession, config: SessionConfig,
                 fallback: PromptUpdate | None):
        self._group, self._comm, self.local = group, group.comm, local
        self.config, self._fallback = config, fallback
        self._pending: list[PromptUpdate] = []
        self._pending_lock = threading.Lock()
        self._prompts_closed = False  # no prompt will come any more: a hold ends at once
        self._wake = threading.Event()
        self._step_lock = threading.Lock()
        self._ended = False
        """True once the workers' sessions are gone (told to end, or cancelled at an agreed check)."""

    # -- read-only views of the local (rank 0) session --
    canvas = _RankZero()
    kv = _RankZero()
    cancel_token = _RankZero()
    closed = _RankZero()
    request_index = _RankZero()
    phase_index = _RankZero()

    # -- control (any thread) --
    def submit_prompt(self, update: PromptUpdate) -> None:
        """Queue a prompt update; every rank receives it before the next request boundary, where it applies."""
        self._group.runtime.check_prompt(update)
        with self._pending_lock:
            self._pending.append(update)
        self._wake.set()

    def close_prompts(self) -> None:
        """No prompt will come any more: a hold at a request boundary ends at once, as if it expired."""
        with self._pending_lock:
            self._prompts_closed = True
        self._wake.set()

    def cancel(self) -> None:
        """Cancel: an idle session is released on every rank now, a running one at its next agreed check."""
        self.local.cancel_token.cancel()
        self._wake.set()
        if self._step_lock.acquire(blocking=False):
            try:
                self._cancel_now()
            finally:
                self._step_lock.release()

    def close(self) -> None:
        """End the session normally on every rank."""
        with self._step_lock:
            self._end(CloseSession(), self.local.close)

    def _cancel_now(self) -> None:
        self._end(CancelSession(), self.local.cancel)

    def _end(self, record: ControlRecord, end_local: Callable[[], None]) -> None:
        """Announce the end to the workers (unless the group is down), then always release rank 0's KV."""
        with self._comm.lock:
            if self._ended:  # rank 0's own session may have ended alone (a late cancel): the workers' state decides
                return
            self._ended = True
            try:
                if self._comm.failure is None:
                    self._comm.send_control(record)
            finally:
                end_local()

    # -- generation --
    def next_phase(self) -> PhaseOutput:
        """Generate the next phase on every rank; raises SessionCancelled, SessionClosed or GroupFailed."""
        try:
            out, held = self._step()
        finally:
            # A cancel() that found the step lock held after the check in _step released nothing: do it now.
            if self.local.cancel_token.cancelled and not self._ended:
                self.cancel()
        if held:
            timings = dataclasses.replace(out.meta.timings, hold_s=held, total_s=out.meta.timings.total_s + held)
            out = dataclasses.replace(out, meta=dataclasses.replace(out.meta, timings=timings))
        return out

    def _step(self) -> tuple[PhaseOutput, float]:
        with self._step_lock:
            if self.local.closed or self._ended:
                raise SessionClosed("the session is closed")
            held, use_fallback = self._hold()
            with self._comm.lock:
                if self.local.phase_index == 0 and self._flush_prompts():  # prompts apply at a request boundary
                    use_fallback = False  # one came as the hold expired: it is newer than the fallback
                self._comm.send_control(NextPhase(use_fallback))
                if use_fallback:
                    self.local.submit_prompt(self._fallback)
                try:
                    out = self._group.run_step(self.local.next_phase)
                except SessionCancelled:  # agreed at a check: every rank has released its session
                    self._ended = True
                    raise
                if self.local.cancel_token.cancelled:  # cancelled after the phase's last check
                    self._cancel_now()
        return out, held

    def _flush_prompts(self) -> int:
        """Deliver the pending prompts to every rank; returns how many."""
        with self._pending_lock:
            pending, self._pending = self._pending, []
        for update in pending:
            spec = _spec(update)
            self._comm.send_control(SubmitPrompt(spec))
            self._comm.broadcast_prompt(spec, update.embedding)
            self.local.submit_prompt(update)
        return len(pending)

    def _hold(self) -> tuple[float, bool]:
        """At a request boundary with hold on: wait for a prompt; returns (seconds held, use the fallback). Raises
        GroupFailed when the group goes down meanwhile."""
        hold = self.config.hold
        if not hold.enabled or self.local.request_index == 0 or self.local.phase_index != 0:
            return 0.0, False
        start = time.monotonic()
        while True:
            waited = time.monotonic() - start
            if self._comm.failure is not None:
                raise GroupFailed(f"the DiT group is down: {self._comm.failure}")
            with self._pending_lock:
                arrived, closed = bool(self._pending), self._prompts_closed
            if arrived or self.local.cancel_token.cancelled:
                return waited, False
            if closed or (hold.max_seconds is not None and waited >= hold.max_seconds):
                log.info("hold %s after %.3f s at request %d", "ended: no prompt can come" if closed else "expired",
                         waited, self.local.request_index)
                fallback = self._fallback
                return waited, fallback is not None and self.local.prompts.active is not fallback
            step = hold.poll_seconds if hold.max_seconds is None else min(hold.poll_seconds,
                                                                          hold.max_seconds - waited)
            self._wake.wait(max(step, 0.0))
            self._wake.clear()


class DiTGroup:
    """Rank 0 of a Ulysses DiT group: a `DiTBackend`, as `DiTRuntime` is."""

    def __init__(self, runtime: DiTRuntime, comm: RankGroup, processes: list, step_timeout_s: float,
                 heartbeat_s: float):
        if runtime.config.ulysses_degree != comm.world_size:
            raise ValueError(f"runtime ulysses_degree={runtime.config.ulysses_degree} but the group has "
                             f"{comm.world_size} ranks")
        self.runtime, self.comm, self.processes = runtime, comm, processes
        comm.diagnose = self._dead_ranks
        self.step_timeout_s, self.heartbeat_s = step_timeout_s, heartbeat_s
        self._session: GroupSession | None = None
        self._step_started: float | None = None
        self._stopping = threading.Event()
        self._threads = [threading.Thread(target=self._watchdog, name="dit-group-watchdog", daemon=True),
                         threading.Thread(target=self._heartbeat, name="dit-group-heartbeat", daemon=True)]
        for thread in self._threads:
            thread.start()

    # -- DiTRuntime API --
    @property
    def model(self):
        return self.runtime.model

    @property
    def config(self) -> RuntimeConfig:
        return self.runtime.config

    @property
    def failed(self) -> bool:
        return self.comm.failure is not None

    @property
    def active_session(self) -> GroupSession | None:
        s = self._session
        return s if s is not None and not s.closed else None

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Call `callback(reason)` once if the group fails (e.g. flip health to NOT_SERVING); any thread."""
        self.comm.on_failure(callback)

    def check_prompt(self, prompt: PromptUpdate) -> None:
        """Reject an embedding of the wrong width or longer than max_text_tokens."""
        self.runtime.check_prompt(prompt)

    def open_session(self, config: SessionConfig, prompt: PromptUpdate,
                     fallback: PromptUpdate | None = None) -> GroupSession:
        """Validate on rank 0, then open the same session on every rank; raises like `DiTRuntime.open_session`."""
        with self.comm.lock:
            if self.comm.failure is not None:
                raise GroupFailed(f"the DiT group is down: {self.comm.failure}")
            local = _open_local(self.runtime, self.comm, config, prompt, fallback)  # validation, no collective
            try:
                specs = (_spec(prompt), None if fallback is None else _spec(fallback))
                self.comm.send_control(OpenSession(dataclasses.replace(config, hold=HoldConfig()), *specs))
                self.comm.broadcast_prompt(specs[0], prompt.embedding)
                if fallback is not None:
                    self.comm.broadcast_prompt(specs[1], fallback.embedding)
            except GroupFailed:
                local.close()
                raise
            self._session = GroupSession(self, local, config, fallback)
            return self._session

    def rank_status(self) -> list[RankStatus]:
        """Every rank's session and KV-cache view, in rank order."""
        with self.comm.lock:
            self.comm.send_control(QueryStatus())
            s = self._session
            return self.comm.gather_status(rank_status(0, None if s is None or s.closed else s.local))

    def run_on_every_rank(self, fn: Callable[[DiTRuntime], T]) -> T:
        """Run `fn(runtime)` on every rank between sessions and return rank 0's result (see `RunOnRanks`)."""
        with self.comm.lock:
            if self.comm.failure is not None:
                raise GroupFailed(f"the DiT group is down: {self.comm.failure}")
            if self._session is not None and not self._session.closed:
                raise NoCapacity("a session is open: run on the group's ranks between sessions")
            self.comm.send_control(RunOnRanks(fn))
            return self.run_step(lambda: fn(self.runtime))

    def run_step(self, step: Callable[[], PhaseOutput]) -> PhaseOutput:
        """Run one announced step on rank 0, timed by the watchdog; any error but a cancel fails the group."""
        self._step_started = time.monotonic()
        try:
            return step()
        except (SessionCancelled, GroupFailed):
            raise
        except Exception as exc:
            self._check_processes(grace_s=1.0)  # a dead peer is the likelier cause: name it
            if self.comm.failure is None:  # the ranks may now be out of step: never continue
                self.comm.fail(f"rank 0 step raised {type(exc).__name__}: {exc}")
            raise GroupFailed(f"the DiT group is down: {self.comm.failure}") from exc
        finally:
            self._step_started = None

    # -- supervision --
    def _dead_ranks(self, grace_s: float = 1.0) -> str:
        """'rank 1 (pid N) exited with code C; ' for every worker process that is gone. A collective that failed
        because a rank died can notice before that rank's exit shows: wait up to `grace_s` for one to."""
        deadline = time.monotonic() + grace_s
        while True:
            dead = "".join(f"rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}; "
                           for rank, proc in enumerate(self.processes, start=1) if not proc.is_alive())
            if dead or time.monotonic() >= deadline:
                return dead
            time.sleep(0.05)

    def _check_processes(self, grace_s: float = 0.0) -> None:
        """Fail the group if a worker process has exited (waiting up to `grace_s` for one to be reaped)."""
        deadline = time.monotonic() + grace_s
        while not self._stopping.is_set():  # workers exit on purpose once shutdown began
            for rank, proc in enumerate(self.processes, start=1):
                if not proc.is_alive():
                    self.comm.fail(f"rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}")
                    return
            if time.monotonic() >= deadline:
                return
            time.sleep(0.05)

    def _watchdog(self) -> None:
        while not self._stopping.wait(0.2):
            self._check_processes()
            started = self._step_started
            if started is not None and time.monotonic() - started > self.step_timeout_s:
                self.comm.fail(f"a step has run for more than {self.step_timeout_s:.0f} s")
            if self.comm.failure is not None:
                return

    def _heartbeat(self) -> None:
        while not self._stopping.wait(self.heartbeat_s):
            if self.comm.failure is not None:
                return
            if self.comm.lock.acquire(blocking=False):
                try:
                    self.comm.send_control(Heartbeat())
                except GroupFailed:
                    return
                finally:
                    self.comm.lock.release()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Close any session, stop the workers (killing those that do not exit) and leave the process group."""
        self._stopping.set()
        try:
            session = self.active_session
            if session is not None:  # cancel first: a held or running phase ends at its next check
                session.cancel()
                session.close()
            with self.comm.lock:
                if self.comm.failure is None:
                    self.comm.send_control(Shutdown())
        except GroupFailed:
            log.warning("DiT group failed during shutdown: %s", self.comm.failure)
        for thread in self._threads:
            thread.join(1.0)
        # leave the group beside the workers, not after them: NCCL may wait for every rank while tearing down
        self.runtime.teacher.release_graphs()
        self.comm.destroy()
        deadline = time.monotonic() + timeout_s
        for proc in self.processes:
            proc.join(max(deadline - time.monotonic(), 0.0))
            if proc.is_alive():
                log.warning("rank process %d did not exit; killing it", proc.pid)
                proc.kill()
                proc.join(1.0)
