"""Start the N rank processes of a Ulysses DiT group on one node.

The calling process (the DiT service) becomes rank 0; ranks 1..N-1 are spawned with torch.multiprocessing.
Rank r runs on `profile.dit.devices[r]`: a CUDA rank sees only its own GPU (`CUDA_VISIBLE_DEVICES`, mapped through
the parent's own list when it has one) and uses NCCL; CPU ranks use gloo. Every rank builds its runtime with the
same `builder(profile, device)` (a module-level function, so it pickles), installs Ulysses, checks that the
weights match on every rank, captures the audio teacher's graphs if the profile has them (`join_ulysses`), and the
workers enter `worker_loop()`. NVLink multicast stays off in every rank.
Knows nothing about sessions, gRPC or the model's internals.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from services.common.config import Profile
from services.tensors.cuda_graphs import PromptBuckets
from services.dit.group.orchestration import DiTGroup, GroupFailed, RankGroup, worker_loop
from services.dit.stream.runtime import DiTRuntime
from services.dit.group.ulysses import install_ulysses
from services.dit.stream.teacher import TeacherStages

log = logging.getLogger(__name__)

Builder = Callable[[Profile, torch.device], DiTRuntime]
"""Builds one rank's runtime (model, LoRA, AdaLN cache) on `device`, with `ulysses_degree = len(dit.devices)`."""

GROUP_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
"""Set in every rank: no NVLink SHARP / multicast (see the device notes)."""


@dataclass(frozen=True)
class GroupOptions:
    """How the group is started and supervised."""

    master_addr: str = "127.0.0.1"
    """Address of rank 0's rendezvous store."""
    master_port: int = 0
    """Port of the rendezvous store; 0 picks a free one."""
    timeout_s: float = 120.0
    """Timeout of init_process_group and of every collective, once every rank has arrived."""
    join_timeout_s: float = 1800.0
    """How long rank 0 waits for every rank to arrive: each loads its weights and compiles first, at its own pace
    (a rank that exits meanwhile fails the start at once)."""
    step_timeout_s: float = 300.0
    """A step (one phase) running longer than this fails the group (a stuck rank)."""
    heartbeat_s: float = 5.0
    """Rank 0 pings idle workers this often (must be well below timeout_s)."""

    def __post_init__(self) -> None:
        for name in ("timeout_s", "join_timeout_s", "step_timeout_s", "heartbeat_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be > 0")
        if self.heartbeat_s * 2 >= self.timeout_s:
            raise ValueError(f"heartbeat_s={self.heartbeat_s} must be below half of timeout_s={self.timeout_s}, "
                             "or idle workers time out")
        if not 0 <= self.master_port < 65536:
            raise ValueError(f"master_port={self.master_port} is not a TCP port")


@dataclass(frozen=True)
class RankSpec:
    """What one spawned rank needs (pickled to the child)."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    device: str
    """The device as the child sees it (`cuda:0` under its CUDA_VISIBLE_DEVICES, or `cpu`)."""
    env: dict
    timeout_s: float
    join_timeout_s: float


def free_port(addr: str) -> int:
    """An unused TCP port on `addr` (for the rendezvous store)."""
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def rank_device_env(device: str, parent_visible: str | None) -> tuple[str, dict]:
    """(device inside the child, extra env) for one profile device; CUDA ranks see exactly one GPU."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return device, {}
    index = dev.index or 0
    if parent_visible is not None and parent_visible.strip():
        visible = [v.strip() for v in parent_visible.split(",")]
        if index >= len(visible):
            raise ValueError(f"dit.devices entry {device!r}: the parent's CUDA_VISIBLE_DEVICES={parent_visible!r} "
                             f"has only {len(visible)} devices")
        physical = visible[index]
    else:
        physical = str(index)
    return "cuda:0", {"CUDA_VISIBLE_DEVICES": physical}


@contextlib.contextmanager
def _child_env(env: dict):
    """Set `env` in os.environ while a child process is started (it inherits it), then restore the parent's."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def join_ulysses(runtime: DiTRuntime, comm: RankGroup, profile: Profile, rank: int, world_size: int) -> None:
    """Shard the runtime's DiT over the joined group and check the replicas; then place the audio teacher and
    capture its graphs (`dit.cuda_graphs`; every rank captures the same keys in the same order).

    The teacher's short documents (~700 rows) run on every rank without the all-to-alls: whole, or with
    `dit.teacher_staged` one stage of its blocks per rank, the hidden rows handed over through host memory the
    ranks share, signalled on a gloo group of its own.
    With `dit.teacher_sharded` its graphed steps run sharded like every other forward, the all-to-alls captured
    inside the graphs (not abortable if a rank dies: see the option).
    """
    handle = install_ulysses(runtime.model, None, rank, world_size)
    comm.verify_replicas(runtime.model)
    if not profile.dit.teacher_sharded:
        runtime.teacher.placement = handle.local
    if profile.dit.teacher_staged:  # every rank creates the group, at the same point
        runtime.teacher.stages = TeacherStages(comm.host_group(), rank, world_size, len(runtime.model.blocks))
    if profile.dit.cuda_graphs:
        runtime.teacher.capture_graphs(PromptBuckets(profile.dit.prompt_buckets))


def _worker_main(spec: RankSpec, profile: Profile, builder: Builder) -> None:
    """Entry of a spawned rank: environment, runtime, group, Ulysses, then `worker_loop()` until Shutdown."""
    os.environ.update(spec.env)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{spec.rank} %(name)s %(message)s")
    device = torch.device(spec.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    runtime = builder(profile, device)
    store = rendezvous(spec.master_addr, spec.master_port, spec.rank, spec.world_size, spec.timeout_s,
                       spec.join_timeout_s)
    comm = RankGroup.init(spec.rank, spec.world_size, device, store, spec.timeout_s)
    try:
        join_ulysses(runtime, comm, profile, spec.rank, spec.world_size)
        worker_loop(comm, runtime)
    finally:
        runtime.teacher.release_graphs()
        comm.destroy()
        log.info("rank %d left the group", spec.rank)


def rendezvous(addr: str, port: int, rank: int, world_size: int, timeout_s: float, join_timeout_s: float,
               check: Callable[[], None] = lambda: None) -> "dist.TCPStore":
    """The group's store once every rank has reached it. Rank 0 hosts it at `addr:port` and waits up to
    `join_timeout_s` for the others to arrive, calling `check` (which raises if a rank exited) as it waits; a worker
    connects (retrying until rank 0 is up, as long) and says it arrived. Then every wait on the store times out
    after `timeout_s`, as collectives do: ranks finish loading at their own pace, but once all are here they move
    in step."""
    try:
        store = dist.TCPStore(addr, port, world_size, is_master=rank == 0, timeout=timedelta(seconds=join_timeout_s),
                              wait_for_workers=False)
    except (RuntimeError, OSError, ValueError) as exc:
        raise GroupFailed(f"rank {rank} could not reach the DiT group's store at {addr}:{port}: {exc}") from exc
    if rank:
        store.set(f"arrived/{rank}", "1")
    else:
        arrived = [f"arrived/{r}" for r in range(1, world_size)]
        deadline = time.monotonic() + join_timeout_s
        while not store.check(arrived):
            check()
            if time.monotonic() > deadline:
                raise GroupFailed(f"DiT ranks did not all reach the group within {join_timeout_s:g} s")
            time.sleep(0.1)
    store.set_timeout(timedelta(seconds=timeout_s))
    return store


def _check_alive(processes: list) -> None:
    dead = [f"{p.name} (exit code {p.exitcode})" for p in processes if not p.is_alive()]
    if dead:
        raise GroupFailed(f"DiT rank processes {dead} exited during start-up; see their log lines")


def launch_group(profile: Profile, builder: Builder, options: GroupOptions | None = None) -> DiTGroup:
    """Spawn ranks 1..N-1, build rank 0 here on `dit.devices[0]`, join the group; returns rank 0's `DiTGroup`."""
    options = options or GroupOptions()
    devices, n = profile.dit.devices, profile.dit.usp_degree
    if n < 2:
        raise ValueError(f"dit.devices={list(devices)}: a Ulysses group needs 2 or 4 ranks; use DiTRuntime for 1")
    kinds = {torch.device(d).type for d in devices}
    if len(kinds) != 1:
        raise ValueError(f"dit.devices={list(devices)} mixes device types {sorted(kinds)}")
    port = options.master_port or free_port(options.master_addr)
    os.environ.update(GROUP_ENV)
    # rank 0 must survive a NCCL error to report NOT_SERVING: abort the communicators, raise, do not tear down
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    parent_visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ctx = mp.get_context("spawn")
    processes = []
    for rank in range(1, n):
        device, env = rank_device_env(devices[rank], parent_visible)
        spec = RankSpec(rank, n, options.master_addr, port, device, {**GROUP_ENV, **env}, options.timeout_s,
                        options.join_timeout_s)
        proc = ctx.Process(target=_worker_main, args=(spec, profile, builder), name=f"dit-rank{rank}", daemon=True)
        # The child must see its GPU list from its first instruction: importing the parent's main module in the
        # spawned interpreter can initialise CUDA (e.g. diffusers probes devices) before _worker_main runs.
        with _child_env(env):
            proc.start()
        processes.append(proc)
    log.info("spawned DiT ranks 1..%d (pids %s), group store at %s:%d", n - 1, [p.pid for p in processes],
             options.master_addr, port)
    runtime = None
    try:
        device = torch.device(devices[0])
        runtime = builder(profile, device)
        store = rendezvous(options.master_addr, port, 0, n, options.timeout_s, options.join_timeout_s,
                           lambda: _check_alive(processes))  # a worker that failed to build fails the start now
        comm = RankGroup.init(0, n, device, store, options.timeout_s)
        join_ulysses(runtime, comm, profile, 0, n)
        _check_alive(processes)
        return DiTGroup(runtime, comm, processes, options.step_timeout_s, options.heartbeat_s)
    except BaseException:
        for proc in processes:
            proc.kill()
            proc.join(1.0)
        if runtime is not None:
            runtime.teacher.release_graphs()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        raise
