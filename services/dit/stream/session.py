"""Session control of the streaming runtime: prompt versions and their acknowledgements, hold at request
boundaries, and cancellation.

Prompt updates may arrive from any thread at any time; they take effect at the next request boundary (the newest
pending one wins, older pending ones are reported as superseded). Every phase reports which event ids started,
which one is active and which completed (installed at this boundary: the ones that started, and the
pending ones a newer update superseded). The hold waits at a boundary for a newer
prompt without running any forward, answering cancellation within one poll. Pure Python plus threading: knows
nothing about tensors' contents, the model or the KV cache.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

from services.dit.api import HoldConfig, PromptUpdate, SessionCancelled

log = logging.getLogger(__name__)


class CancelToken:
    """A thread-safe cancellation flag that a held session can wait on."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def cancel(self) -> None:
        self._event.set()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def check(self) -> None:
        """Raise SessionCancelled if cancel() was called."""
        if self._event.is_set():
            raise SessionCancelled("the session was cancelled")

    def wait(self, seconds: float) -> bool:
        """Sleep up to `seconds`, waking at once on cancel; True if cancelled."""
        return self._event.wait(seconds)


@dataclass(frozen=True)
class RequestPrompt:
    """The prompt chosen for one request and the acknowledgements it produces."""

    prompt: PromptUpdate
    started: tuple[str, ...]
    """Event ids first used by this request (reported as started and completed on its first phase)."""
    superseded: tuple[str, ...]
    """Pending event ids replaced by a newer one before reaching a boundary."""
    hold_seconds: float
    """Time spent holding for a newer prompt at this boundary."""


class PromptBook:
    """Prompt versions of one session; `submit` from any thread, `for_request` at each request boundary."""

    def __init__(self, first: PromptUpdate, hold: HoldConfig, fallback: PromptUpdate | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self._lock = threading.Lock()
        self._pending: list[PromptUpdate] = [first]
        self._active: PromptUpdate | None = None
        self._closed = False
        self.hold, self.fallback, self._clock = hold, fallback, clock

    @property
    def active(self) -> PromptUpdate | None:
        return self._active

    def submit(self, update: PromptUpdate) -> None:
        """Queue a prompt update; it takes effect at the next request boundary."""
        with self._lock:
            self._pending.append(update)

    def close(self) -> None:
        """No prompt will come any more (the client's request stream ended): a hold ends at once, as if expired."""
        with self._lock:
            self._closed = True

    def _take_pending(self) -> tuple[PromptUpdate | None, tuple[str, ...]]:
        with self._lock:
            pending, self._pending = self._pending, []
        if not pending:
            return None, ()
        return pending[-1], tuple(p.event_id for p in pending[:-1])

    def _wait_for_update(self, cancel: CancelToken) -> tuple[bool, float]:
        """Hold until a prompt is pending (True), the finite hold expires or no prompt can come (False), or cancel
        (raises)."""
        start = self._clock()
        limit, poll = self.hold.max_seconds, self.hold.poll_seconds
        while True:
            cancel.check()
            with self._lock:
                if self._pending:
                    return True, self._clock() - start
                closed = self._closed
            waited = self._clock() - start
            if closed or (limit is not None and waited >= limit):
                return False, waited
            step = poll if limit is None else min(poll, max(limit - waited, 0.0))
            if cancel.wait(step):
                cancel.check()

    def for_request(self, request_index: int, cancel: CancelToken) -> RequestPrompt:
        """Choose the prompt of request `request_index`, holding first when configured (never on request 0).

        Request 0 is always the session's first prompt: an update is for a later boundary, even one that reached
        the DiT before request 0 began (as an update sent on `video.start` does on a loaded machine).
        """
        if request_index == 0 and self._active is None:
            with self._lock:
                first = self._pending.pop(0)  # the session's own prompt; later ones stay pending
            self._active = first
            return RequestPrompt(first, (first.event_id,), (), 0.0)
        held = 0.0
        if request_index > 0 and self.hold.enabled:
            arrived, held = self._wait_for_update(cancel)
            if not arrived:
                log.info("hold expired after %.3f s at request %d; using the %s prompt", held, request_index,
                         "fallback" if self.fallback is not None else "previous")
                if self.fallback is not None and self.fallback is not self._active:
                    self._active = self.fallback
                    return RequestPrompt(self.fallback, (self.fallback.event_id,), (), held)
                return RequestPrompt(self._active, (), (), held)
        newest, superseded = self._take_pending()
        if newest is None:
            return RequestPrompt(self._active, (), (), held)
        self._active = newest
        return RequestPrompt(newest, (newest.event_id,), superseded, held)
