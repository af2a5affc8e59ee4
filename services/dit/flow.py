"""One DiT session's flow, protocol-neutral: prompt assembly from the request events, phase credit, generation.

A session opens on its first prompt (and a fallback prompt's, for hold); then the request events bring prompt
updates and phase acks beside the generation. A phase is generated only while fewer than `max_ahead` phases are
unacknowledged (`PhaseAck`, sent by the consumer in phase order once it has decoded the phase), so the DiT never runs
more than that far ahead of the VAE and a prompt update lands at the next request boundary after what the viewer
has received. The first max_ahead phases need no ack.

Knows nothing about gRPC, tensor transports or metrics: the transport maps its messages to `RequestEvent`s and
writes what `generate` hands it.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol, TypeVar

from services.common.errors import InvalidInput, SequenceMismatch
from services.common.media import PHASES_PER_REQUEST
from services.common.memory import release_free_heap
from services.dit.api import DiTSession, PhaseAck, PhaseOutput, PromptArrival, PromptUpdate, RequestEvent, SessionConfig

T = TypeVar("T")


class PhaseCredit:
    """Counts the phases sent but not yet acknowledged; `acquire()` waits while `max_ahead` are outstanding."""

    def __init__(self, max_ahead: int):
        if max_ahead < 1:
            raise ValueError(f"max_phases_ahead={max_ahead}: must be >= 1")
        self.max_ahead = max_ahead
        self._unacked: collections.deque[tuple[int, int]] = collections.deque()
        self._changed = asyncio.Event()
        self._closed = False
        self._error: BaseException | None = None

    @property
    def unacked(self) -> int:
        return len(self._unacked)

    def sent(self, request_index: int, phase_index: int) -> None:
        """Record that phase (request_index, phase_index) went out."""
        self._unacked.append((request_index, phase_index))

    def ack(self, request_index: int, phase_index: int) -> None:
        """The consumer decoded this phase; acks must come in phase order."""
        if not self._unacked:
            raise SequenceMismatch(f"ack for phase {request_index}.{phase_index}, but no phase is unacknowledged")
        if self._unacked[0] != (request_index, phase_index):
            oldest = "{}.{}".format(*self._unacked[0])
            raise SequenceMismatch(f"ack for phase {request_index}.{phase_index}, but the oldest "
                                   f"unacknowledged phase is {oldest} (acks must come in phase order)")
        self._unacked.popleft()
        self._changed.set()

    @property
    def error(self) -> BaseException | None:
        """Why reading the request stream failed (None while it has not)."""
        return self._error

    def close(self, error: BaseException | None = None) -> None:
        """The request stream ended (with `error` if reading it failed): no more acks will come."""
        self._closed, self._error = True, error
        self._changed.set()

    async def acquire(self) -> bool:
        """Wait until another phase may be generated; False once the request stream has ended.

        Raises the request reader's error if reading the stream failed."""
        while not self._closed and len(self._unacked) >= self.max_ahead:
            self._changed.clear()
            await self._changed.wait()
        if self._error is not None:
            raise self._error
        return not self._closed


class Opener(Protocol):
    """What the flow needs of the DiT service: open the backend's one session."""

    def open(self, config: SessionConfig, prompt: PromptUpdate, fallback: PromptUpdate | None) -> DiTSession:
        """Open the session (blocking: it may wait for a cancelled predecessor)."""


class RequestReader:
    """Reads the request events after the start: hands phase acks to the session's `PhaseCredit` and returns or
    submits the whole prompts."""

    def __init__(self, events: AsyncIterator[RequestEvent], credit: PhaseCredit):
        self._events = events
        self._credit = credit

    async def next_prompt(self) -> PromptArrival | None:
        """The next complete prompt (acks on the way are applied), or None at the stream's end."""
        async for event in self._events:
            if isinstance(event, PhaseAck):
                self._credit.ack(event.request_index, event.phase_index)
            else:
                return event
        return None

    async def first_prompts(self, has_fallback: bool) -> tuple[PromptUpdate, PromptUpdate | None]:
        """The first prompt and, with `has_fallback`, the hold's fallback prompt that must follow it."""
        prompt = await self.next_prompt()
        if prompt is None:
            raise SequenceMismatch("the stream closed before the first prompt arrived")
        if prompt.fallback:
            raise SequenceMismatch("the first prompt must have the ACTIVE role; a FALLBACK prompt follows it")
        if not has_fallback:
            return prompt.update, None
        fallback = await self.next_prompt()
        if fallback is None or not fallback.fallback:
            raise SequenceMismatch("hold.has_fallback_prompt is set but no FALLBACK prompt followed")
        return prompt.update, fallback.update

    async def run(self, session: DiTSession) -> None:
        """Submit prompt updates and apply acks until the stream ends; then (or on failure) close the credit.

        At the stream's end no prompt can come any more, so a hold for one ends. A failure ends the call with its
        error, so the session is cancelled at once: a phase or a hold under way would only delay the status."""
        try:
            while (item := await self.next_prompt()) is not None:
                if item.fallback:
                    raise SequenceMismatch(f"prompt {item.update.event_id!r} has the FALLBACK role: a fallback is "
                                           "only accepted right after the first prompt, with hold.has_fallback_prompt")
                session.submit_prompt(item.update)
        except Exception as exc:  # handed to the generation loop, which turns it into the call's status
            self._credit.close(exc)
            await asyncio.to_thread(session.cancel)  # a group's cancel talks to the other ranks: off the loop
            return
        self._credit.close()
        session.close_prompts()


def _cancel_opened(opening: asyncio.Future) -> None:
    """Done-callback of an open whose caller left: cancel the session it opened (frees the slot), off the event
    loop (a group's cancel talks to the other ranks)."""
    if not opening.cancelled() and opening.exception() is None:
        asyncio.get_running_loop().run_in_executor(None, opening.result().cancel)


class SessionFlow:
    """One client's session: `open`, then `begin` (the request reader runs beside the generation), `generate`
    until the client closes its requests, and always `end`."""

    def __init__(self, service: Opener, events: AsyncIterator[RequestEvent], max_ahead: int):
        self.service = service
        self.credit = PhaseCredit(max_ahead)
        self.reader = RequestReader(events, self.credit)
        self._requests: asyncio.Task | None = None

    async def open(self, config: Callable[[], SessionConfig], has_fallback: bool) -> DiTSession:
        """Read the first prompt(s), then open the session with `config()`. A caller that leaves while the open
        runs on (in a worker thread) has the session it opens cancelled."""
        prompt, fallback = await self.reader.first_prompts(has_fallback)
        opening = asyncio.ensure_future(asyncio.to_thread(self.service.open, config(), prompt, fallback))
        try:
            return await asyncio.shield(opening)
        except asyncio.CancelledError:  # the caller left while the open ran on: give back what it opens
            opening.add_done_callback(_cancel_opened)
            raise

    def begin(self, session: DiTSession) -> None:
        """Start reading prompt updates and acks beside the generation."""
        self._requests = asyncio.create_task(self.reader.run(session))

    async def generate(self, session: DiTSession, render: Callable[[PhaseOutput], Awaitable[T]],
                       write: Callable[[T], Awaitable[None]], between: Callable[[], Awaitable[None]],
                       max_requests: int = 0) -> None:
        """Generate phases while the credit allows, until the request stream ends or, with `max_requests`, the last
        phase of request `max_requests - 1` was written (the budget: nothing past it is generated). Each phase is
        `render`ed, counted as sent, then `write`n; `between()` runs before each wait for credit and after it (the
        transport's own messages). Raises the request reader's error if reading failed, else generation's."""
        if max_requests < 0:
            raise InvalidInput(f"max_requests={max_requests}: must be ≥ 0 (0: no budget)")
        try:
            while True:
                await between()
                if not await self.credit.acquire():
                    return
                await between()
                out = await asyncio.to_thread(session.next_phase)
                rendered = await render(out)
                self.credit.sent(out.meta.request_index, out.meta.phase_index)
                await write(rendered)
                last_of_request = out.meta.phase_index == PHASES_PER_REQUEST - 1
                if max_requests and last_of_request and out.meta.request_index >= max_requests - 1:
                    await between()
                    return
        except Exception as exc:
            error = self.credit.error  # the request reader's error cancels the session: it is the cause
            if error is None or error is exc:
                raise
            raise error from exc

    async def end(self, session: DiTSession) -> None:
        """Stop the request reader and cancel the session (a no-op once it has ended); then what its phases freed
        goes back to the system (`release_free_heap`), so an idle stage holds none of a session's buffers."""
        if self._requests is not None:
            self._requests.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._requests
        await asyncio.shield(asyncio.to_thread(session.cancel))  # a group's cancel talks to the ranks
        await asyncio.to_thread(release_free_heap)
