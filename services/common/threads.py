"""Blocking work of a stage on threads of its own, not on the event loop's default executor.

Work spread over the default executor's threads (a stage's `STAGE_WORKERS`, `services.common.grpc_server`) runs
on whichever is free, and every thread that runs torch on the CPU gets an OpenMP team of its own, started the first
time and kept as long as the thread, so the process's threads grow while it serves. A stage that runs its model
work on an executor of its own, started before its warm-up and warmed on it, keeps those teams to its few threads
from the first session to the last. Knows nothing about what the work computes.
"""
from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import Callable
from concurrent.futures import Executor
from typing import TypeVar

T = TypeVar("T")


async def run_on(executor: Executor, func: Callable[..., T], *args) -> T:
    """`asyncio.to_thread` onto `executor`: `func(*args)` there, in the caller's context (its log fields)."""
    call = functools.partial(contextvars.copy_context().run, func, *args)
    return await asyncio.get_running_loop().run_in_executor(executor, call)
