"""A trainer's inputs made ahead of its steps, on a thread of their own.

A student run on a fresh machine compiles its DiT regions for about 100 s before its first step, while the GPU stands
idle, and then encodes its bank of sessions (2,048, each through the video VAE's encoder) 16 a step for its first
128 steps, in line with them (docs/training.md, "Run F"). Made on a thread, the encoding goes on during the compile
and while each step runs, so a step waits only for what is not encoded yet. The items are those the step would
have made itself, in the same order: `produce` must draw from no random generator the steps draw from.
"""
from __future__ import annotations

import queue
import threading
from typing import Callable, Generic, TypeVar

T = TypeVar("T")

_POLL_S = 0.2


class Ahead(Generic[T]):
    """`produce()`, called over and over on a daemon thread, at most `depth` results ahead of `next()`."""

    def __init__(self, produce: Callable[[], T], depth: int, name: str = "ahead") -> None:
        if depth < 1:
            raise ValueError(f"depth={depth}: at least one result must be made ahead")
        self._produce = produce
        self._results: queue.Queue[tuple[bool, T | BaseException]] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                item: tuple[bool, T | BaseException] = (True, self._produce())
            except BaseException as exc:  # handed to the caller, which raises it as its own
                item = (False, exc)
            while not self._stop.is_set():
                try:
                    self._results.put(item, timeout=_POLL_S)
                    break
                except queue.Full:
                    continue
            if not item[0]:
                return

    def next(self) -> T:
        """The next result, in the order made; re-raises what `produce` raised instead of it."""
        while True:
            try:
                ok, value = self._results.get(timeout=_POLL_S)
            except queue.Empty:
                if not self._thread.is_alive():
                    raise RuntimeError("the thread making results ahead has stopped") from None
                continue
            if ok:
                return value  # type: ignore[return-value]
            raise RuntimeError(f"making a result ahead failed: {value!r}") from value

    def close(self) -> None:
        """Stop making results; returns once a call of `produce` in progress has returned (a thread left running
        torch's work at the interpreter's exit aborts the process)."""
        self._stop.set()
        self._thread.join()

    def __enter__(self) -> "Ahead[T]":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
