"""Which machine boot and which process a peer is: torch-free, so the gateway can say who it is too.

A process on the same boot (`read_boot_id`) can be asked whether it still runs (`process_alive`): the stages share
one PID namespace, as CUDA IPC needs. Knows nothing about tensors or GPUs.
"""
from __future__ import annotations

import os
from pathlib import Path

from vitascope.common.v1 import tensor_pb2 as pb

BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")


def read_boot_id(path: Path = BOOT_ID_PATH) -> str:
    """This machine's boot id ("" when the kernel does not expose one)."""
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def process_alive(pid: int) -> bool:
    """True while a process with this pid exists (the stages share one PID namespace, as CUDA IPC needs)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    return True


def process_hello() -> pb.TransportHello:
    """This process's boot id and pid, without its GPUs (a process that never touches CUDA)."""
    return pb.TransportHello(boot_id=read_boot_id(), pid=os.getpid())
