"""Work handed to a worker thread: what it made is undone when the call that awaited it was cancelled."""
import asyncio
import threading

import pytest

from services.common.threads import run_or_undo

pytestmark = pytest.mark.cpu


async def test_the_result_comes_back_and_nothing_is_undone():
    undone = []
    assert await run_or_undo(undone.append, lambda x: x * 2, 21) == 42
    await asyncio.sleep(0.05)
    assert undone == []


async def test_a_cancelled_caller_leaves_the_result_to_undo_once_the_work_ends():
    go_on, undone = threading.Event(), []
    done = threading.Event()

    def opens():
        go_on.wait(10)
        return "session"

    def undo(made):
        undone.append((made, threading.current_thread() is not threading.main_thread()))
        done.set()

    call = asyncio.create_task(run_or_undo(undo, opens))
    await asyncio.sleep(0.05)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert undone == []  # the work still runs
    go_on.set()
    assert await asyncio.to_thread(done.wait, 10)
    assert undone == [("session", True)]  # undone off the event loop


async def test_work_that_raised_leaves_nothing_to_undo():
    go_on, undone = threading.Event(), []

    def fails():
        go_on.wait(10)
        raise RuntimeError("could not open")

    call = asyncio.create_task(run_or_undo(undone.append, fails))
    await asyncio.sleep(0.05)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    go_on.set()
    await asyncio.sleep(0.2)
    assert undone == []
