"""Admission: a fixed number of generation slots (one per DiT group) and a FIFO wait queue.

Knows nothing about websockets, messages or the backend. A session takes a `Ticket`, awaits
`wait()` until it holds a slot, and calls `release()` exactly once when it ends (whether it ever
got the slot or not). Waiting tickets are told their 1-based position whenever it changes.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from collections.abc import Callable

from services.common.errors import NoCapacity

logger = logging.getLogger(__name__)


class QueueFull(NoCapacity):
    """The wait queue is at its limit."""

    def __init__(self, limit: int) -> None:
        super().__init__(
            f"all generation slots are busy and the wait queue is full ({limit} waiting); "
            "try again later"
        )
        self.limit = limit


class Ticket:
    """One session's place in the scheduler."""

    def __init__(self, number: int, on_position: Callable[[int], None] | None) -> None:
        self.number = number
        self._on_position = on_position
        self._granted = asyncio.get_running_loop().create_future()
        self._position = 0
        self.released = False

    @property
    def granted(self) -> bool:
        return self._granted.done() and not self._granted.cancelled()

    @property
    def position(self) -> int:
        """1-based wait position; 0 once granted (or never queued)."""
        return self._position

    def _set_position(self, position: int) -> None:
        if position == self._position:
            return
        self._position = position
        if self._on_position is not None and position > 0:
            self._on_position(position)

    def _grant(self) -> None:
        self._position = 0
        if not self._granted.done():
            self._granted.set_result(None)


class SessionScheduler:
    """FIFO admission to `num_slots` slots with at most `queue_limit` waiters."""

    def __init__(self, num_slots: int, queue_limit: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots={num_slots} must be >= 1")
        if queue_limit < 0:
            raise ValueError(f"queue_limit={queue_limit} must be >= 0")
        self.num_slots = num_slots
        self.queue_limit = queue_limit
        self._active: set[Ticket] = set()
        self._waiting: deque[Ticket] = deque()
        self._numbers = itertools.count()

    @property
    def num_active(self) -> int:
        return len(self._active)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def enqueue(self, on_position: Callable[[int], None] | None = None) -> Ticket:
        """Take a slot now or a place in the queue; raise QueueFull when neither is free."""
        ticket = Ticket(next(self._numbers), on_position)
        if len(self._active) < self.num_slots and not self._waiting:
            self._active.add(ticket)
            ticket._grant()
            return ticket
        if len(self._waiting) >= self.queue_limit:
            raise QueueFull(self.queue_limit)
        self._waiting.append(ticket)
        ticket._set_position(len(self._waiting))
        logger.info("session queued at position %d", len(self._waiting))
        return ticket

    async def wait(self, ticket: Ticket) -> None:
        """Return once the ticket holds a slot."""
        await asyncio.shield(ticket._granted)

    def release(self, ticket: Ticket) -> None:
        """Free the ticket's slot or queue place and admit the next waiters (idempotent)."""
        if ticket.released:
            return
        ticket.released = True
        if ticket in self._active:
            self._active.discard(ticket)
        elif ticket in self._waiting:
            self._waiting.remove(ticket)
        if not ticket._granted.done():
            ticket._granted.cancel()
        self._promote()

    def _promote(self) -> None:
        while self._waiting and len(self._active) < self.num_slots:
            nxt = self._waiting.popleft()
            self._active.add(nxt)
            nxt._grant()
        for index, waiting in enumerate(self._waiting):
            waiting._set_position(index + 1)
