"""GPU kernels of a stretch of work in this process, by category, and how busy each GPU was; and a call's host time
against its device time (`host_and_device_ms`).

The bench's `--trace-request K` wraps one request of a session in a `KernelTrace`: where the DiT is 2.5x its floor,
this says whether rank 0's GPU sat idle (waiting for its peer, the host or the other processes on the GPU) or was
busy, and with which kernels. Only this process's kernels are seen: the DiT rank 0 and its teacher worker, not the
other ranks or the VAE process (whose kernels on a shared GPU show up as this process's idle time).
Knows nothing about models or sessions.
"""
from __future__ import annotations

import re
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

CATEGORIES = (
    ("nccl", re.compile(r"nccl", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|cudnn|sdpa", re.I)),
    ("gemm", re.compile(r"gemm|cutlass|sm90|matmul|scaled_mm|cublas|xmma|nvjet", re.I)),
)


def host_and_device_ms(fn: Callable[[], object], device: torch.device, runs: int = 5) -> tuple[float, float]:
    """Median (host ms for `fn()` to return, device ms between events around it) over `runs` calls after two
    warm-ups: where they meet, the call is bound by the host's dispatch, not the GPU. Off a GPU both are the wall
    clock."""
    host, dev = [], []
    for i in range(runs + 2):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        fn()
        returned = (time.perf_counter() - t0) * 1e3
        if device.type == "cuda":
            end.record()
            end.synchronize()
        if i >= 2:
            host.append(returned)
            dev.append(start.elapsed_time(end) if device.type == "cuda" else returned)
    return statistics.median(host), statistics.median(dev)


def category(name: str) -> str:
    """"nccl", "attention", "gemm" or "other" for a kernel name."""
    for label, pattern in CATEGORIES:
        if pattern.search(name):
            return label
    return "other"


@dataclass(frozen=True)
class Kernel:
    name: str
    device: int
    start_us: float
    end_us: float


def busy_us(kernels: Sequence[Kernel]) -> float:
    """Microseconds in which at least one of `kernels` ran (the union of their intervals)."""
    total, end = 0.0, float("-inf")
    for k in sorted(kernels, key=lambda k: k.start_us):
        if k.start_us >= end:
            total += k.end_us - k.start_us
        elif k.end_us > end:
            total += k.end_us - end
        end = max(end, k.end_us)
    return total


def summary(kernels: Sequence[Kernel], wall_s: float, top: int = 15) -> list[str]:
    """Per device: its busy share of `wall_s` and kernel seconds by category (they overlap across streams), then
    the `top` kernels by GPU seconds."""
    if not kernels:
        return ["no GPU kernels recorded (a CPU run, or nothing ran)"]
    lines = []
    for dev in sorted({k.device for k in kernels}):
        mine = [k for k in kernels if k.device == dev]
        ranked = top_kernels(mine, len(mine))
        by: dict[str, float] = {}
        for _, kind, sec, _ in ranked:
            by[kind] = by.get(kind, 0.0) + sec
        busy = busy_us(mine) / 1e6
        parts = ", ".join(f"{name} {sec:.3f}" for name, sec in sorted(by.items(), key=lambda kv: -kv[1]))
        lines.append(f"cuda:{dev}: busy {busy:.3f} of {wall_s:.3f} s ({100 * busy / wall_s:.0f}%); kernel seconds "
                     f"by kind: {parts} ({len(mine)} kernels)")
        lines += [f"  {sec:7.3f} s {n:6d}x {kind:9s} {name[:110]}" for name, kind, sec, n in ranked[:top]]
    return lines


def top_kernels(kernels: Sequence[Kernel], n: int) -> list[tuple[str, str, float, int]]:
    """The `n` kernel names with the most GPU seconds: (name, kind, seconds, launches), most first."""
    by: dict[str, tuple[float, int]] = {}
    for k in kernels:
        sec, count = by.get(k.name, (0.0, 0))
        by[k.name] = (sec + (k.end_us - k.start_us) / 1e6, count + 1)
    ranked = sorted(by.items(), key=lambda kv: -kv[1][0])[:n]
    return [(name, category(name), sec, count) for name, (sec, count) in ranked]


class KernelTrace:
    """Context manager: records this process's GPU kernels (CUDA) and the wall time of its block."""

    def __init__(self) -> None:
        self.kernels: list[Kernel] = []
        self.wall_s = 0.0
        self.running = False
        cuda = torch.cuda.is_available()
        self._profile = profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU])

    def start(self) -> None:
        self._profile.start()
        self._t0 = time.perf_counter()
        self.running = True

    def stop(self) -> None:
        """End the recording (after this process's GPU work so far has finished) and collect its kernels."""
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.wall_s = time.perf_counter() - self._t0
        self._profile.stop()
        self.running = False
        self.kernels = [Kernel(e.name, e.device_index, e.time_range.start, e.time_range.end)
                        for e in self._profile.events() if e.device_type == DeviceType.CUDA]

    def __enter__(self) -> "KernelTrace":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def summary(self) -> list[str]:
        return summary(self.kernels, self.wall_s)
