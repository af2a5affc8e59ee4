"""Which machine boot and which process a peer is: torch-free, so the gateway can say who it is too.

A peer's pid names a process here only when both run on one boot (`read_boot_id`) in one PID namespace
(`read_pid_namespace`; `pids_comparable`); such a peer can be asked whether it still runs (`process_alive`).
Knows nothing about tensors or GPUs.
"""
from __future__ import annotations

import os
from pathlib import Path

from vitascope.common.v1 import tensor_pb2 as pb

BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")
PID_NAMESPACE_PATH = Path("/proc/self/ns/pid")


def read_boot_id(path: Path = BOOT_ID_PATH) -> str:
    """This machine's boot id ("" when the kernel does not expose one)."""
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def read_pid_namespace(path: Path = PID_NAMESPACE_PATH) -> str:
    """This process's PID namespace, e.g. "pid:[4026531836]" ("" when the kernel does not expose it)."""
    try:
        return os.readlink(path)
    except OSError:
        return ""


def pids_comparable(local: pb.TransportHello, peer: pb.TransportHello) -> bool:
    """True when `peer.pid` names a process of this one's world: the same boot and the same PID namespace."""
    return bool(local.boot_id) and local.boot_id == peer.boot_id and local.pid_namespace == peer.pid_namespace


def process_alive(pid: int) -> bool:
    """True while a process with this pid exists in this PID namespace (ask only of `pids_comparable` peers)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    return True


def process_hello() -> pb.TransportHello:
    """This process's boot id, pid and PID namespace, without its GPUs (a process that never touches CUDA)."""
    return pb.TransportHello(boot_id=read_boot_id(), pid=os.getpid(), pid_namespace=read_pid_namespace())
