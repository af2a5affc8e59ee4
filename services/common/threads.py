"""Blocking work of a stage on threads of its own, not on the event loop's default executor.

The default executor starts its threads lazily, one more whenever a call finds none idle, so the set of threads
that ever ran a stage's work keeps changing over a long run; and every new thread that runs torch on the CPU gets
an OpenMP team (and heap) of its own, which lives as long as the thread. A stage that runs its model work on a
fixed executor of its own, started before its warm-up and warmed on it, keeps its threads from the first session to
the last. Knows nothing about what the work computes.
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
