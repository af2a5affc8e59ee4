"""Blocking work a servicer hands to a worker thread from its event loop, and what becomes of its result when the
call is cancelled meanwhile: the thread cannot be stopped, so what it makes (a session opened, a slot leased)
belongs to nobody unless it is undone."""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


async def run_or_undo(undo: Callable[[T], object], fn: Callable[..., T], *args) -> T:
    """`fn(*args)` in a worker thread. If the awaiting call is cancelled first, `undo(result)` runs in a worker thread
    (it may block: a group's cancel talks to the other ranks) once `fn` returns; an `fn` that raises left nothing."""
    work = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        loop = asyncio.get_running_loop()

        def abandoned(done: asyncio.Future) -> None:
            if not done.cancelled() and done.exception() is None:
                loop.run_in_executor(None, undo, done.result())

        work.add_done_callback(abandoned)
        raise
