"""One viewer's watch websocket: streams a session's broadcast to it and answers its pings.

What a viewer is sent and may send is documented in `protocol`'s module docstring. The stream comes from the
viewer's own `broadcast.Viewer` queue, so a viewer that reads slowly only ever holds up itself: it skips ahead, or
is dropped: with `viewer_too_slow` when it falls behind too often (its socket aborted at once, without the `error`,
if a send to it is stuck at that moment), and with its socket aborted when one send takes `send_timeout_s`.

Knows nothing about HTTP checks, tokens or routes (`ws` does them before the upgrade) nor about generation.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any, Protocol

from aiohttp import WSCloseCode, WSMsgType, web

from services.gateway.broadcast import BadFragment, Viewer, ViewerTooSlow
from services.gateway.errors import ErrorCode, ErrorMessage, ProtocolError
from services.gateway.metrics import GatewayMetrics
from services.gateway.protocol import (
    InitSegment,
    MessageLimits,
    Pong,
    ServerMessage,
    SessionDone,
    SessionPing,
    parse_client_text,
)
from services.gateway.service import ClientGone

logger = logging.getLogger(__name__)

_NOT_A_MESSAGE = frozenset({ErrorCode.INVALID_JSON, ErrorCode.UNKNOWN_TYPE, ErrorCode.MESSAGE_TOO_LARGE})
"""Errors about a frame that is no message at all: reported as such (any other message gets `not_director`)."""


def _not_director(what: str) -> ProtocolError:
    return ProtocolError(ErrorCode.NOT_DIRECTOR, f"{what}: a viewer may only send session.ping; the session is "
                                                 "driven by the client that started it")


class WireSink(Protocol):
    """Where a viewer's messages go; bounded in time like the director's `MessageSink` (raises ClientGone)."""

    @property
    def dropped(self) -> bool:
        """True once the connection was aborted (a send timed out, or `abort`)."""

    @property
    def sending(self) -> bool:
        """True while a message is on its way to the socket."""

    def abort(self) -> None:
        """Drop the connection now."""

    async def send(self, message: ServerMessage) -> None:
        """Deliver one control message."""

    async def send_wire(self, wire: Mapping[str, Any], data: bytes | None = None) -> None:
        """Deliver a JSON-ready dict, immediately followed by its binary frame when `data` is given."""


class WatchConnection:
    """Serves one viewer until the broadcast ends, the viewer falls behind, or it leaves."""

    def __init__(self, ws: web.WebSocketResponse, sink: WireSink, viewer: Viewer, limits: MessageLimits,
                 metrics: GatewayMetrics) -> None:
        self._ws = ws
        self._sink = sink
        self._viewer = viewer
        self._limits = limits
        self._metrics = metrics
        self._over = False
        """Set when the stream ended: the frame reader stops at its next frame even if its cancel was lost."""
        self._too_slow = False
        viewer.on_drop = self._on_drop

    async def serve(self) -> None:
        """Stream until the end; close the socket with the close code the protocol names."""
        self._metrics.viewers.inc()
        stream = asyncio.create_task(self._stream())
        reader = asyncio.create_task(self._read_frames())
        try:
            await asyncio.wait({stream, reader}, return_when=asyncio.FIRST_COMPLETED)
            if stream.done() and stream.result() is not None:
                self._over = True  # stop the reader first, as the director's connection does (a clean close)
                reader.cancel()
                await asyncio.gather(reader, return_exceptions=True)
                await self._ws.close(code=stream.result())
        finally:
            for task in (stream, reader):
                task.cancel()
            await asyncio.gather(stream, reader, return_exceptions=True)
            self._viewer.close()
            self._metrics.viewers.dec()
            if self._sink.dropped and not self._too_slow:
                self._metrics.viewers_dropped_total.labels(reason="send_timeout").inc()

    async def _stream(self) -> WSCloseCode | None:
        """Send video.start, the init segment, the chunks, session.done; the close code, None when the viewer left."""
        broadcast = self._viewer.broadcast
        sent = 0
        try:
            await self._sink.send_wire({**broadcast.start, "role": "viewer"})
            while (chunk := await self._viewer.next()) is not None:
                if sent == 0:
                    init = broadcast.init_segment
                    if init is None:
                        raise BadFragment(f"session {broadcast.session_id}: chunk {chunk.index} came before any "
                                          "init segment")
                    await self._sink.send_wire(InitSegment(broadcast.session_id, len(init)).to_wire(), init)
                    self._count(init)
                await self._sink.send_wire({**chunk.metadata, "byte_length": len(chunk.data)}, chunk.data)
                self._count(chunk.data)
                sent += 1
            done = broadcast.done
            await self._sink.send(SessionDone(broadcast.session_id, sent, stopped=done is None or done.stopped))
            return WSCloseCode.OK
        except ViewerTooSlow as exc:
            self._metrics.errors_total.labels(code=ErrorCode.VIEWER_TOO_SLOW.value).inc()
            try:
                await self._sink.send(ErrorMessage(ErrorCode.VIEWER_TOO_SLOW,
                                                   f"{exc}; reconnect to watch from the newest chunk",
                                                   request_id=broadcast.session_id))
            except ClientGone:
                return None
            return WSCloseCode.TRY_AGAIN_LATER
        except ClientGone:
            return None
        except Exception as exc:  # noqa: BLE001 - one viewer's boundary: report, never crash the server
            logger.exception("session %s: a viewer's stream failed", broadcast.session_id)
            self._metrics.errors_total.labels(code=ErrorCode.INTERNAL_ERROR.value).inc()
            try:
                await self._sink.send(ErrorMessage(ErrorCode.INTERNAL_ERROR, f"internal error: {type(exc).__name__}",
                                                   request_id=broadcast.session_id))
            except ClientGone:
                return None
            return WSCloseCode.INTERNAL_ERROR

    async def _read_frames(self) -> None:
        """Answer pings, refuse everything else with `not_director`; return when the socket closes."""
        session_id = self._viewer.broadcast.session_id
        while not self._over:
            msg = await self._ws.receive()
            if msg.type in (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED, WSMsgType.ERROR):
                return
            try:
                if msg.type != WSMsgType.TEXT:
                    raise ProtocolError(ErrorCode.BINARY_NOT_ALLOWED,
                                        "binary frames are server-to-client only; send JSON text")
                message = self._parse(msg.data)
                if not isinstance(message, SessionPing):
                    raise _not_director(type(message).TYPE)
                await self._sink.send(Pong())
            except ProtocolError as exc:
                self._metrics.errors_total.labels(code=exc.code.value).inc()
                try:
                    await self._sink.send(ErrorMessage(exc.code, exc.message, event_id=exc.event_id,
                                                       request_id=session_id))
                except ClientGone:
                    return
            except ClientGone:
                return

    def _on_drop(self) -> None:
        """The viewer fell behind too often: if a send is stuck on it, abort (no `error` could reach it), else
        `_stream` sends `viewer_too_slow` when it asks for its next chunk."""
        self._too_slow = True
        self._metrics.viewers_dropped_total.labels(reason="too_slow").inc()
        if self._sink.sending:
            self._sink.abort()

    def _parse(self, text: str) -> object:
        """A client message; a known type that fails its checks is refused as `not_director` all the same."""
        try:
            return parse_client_text(text, self._limits)
        except ProtocolError as exc:
            if exc.code in _NOT_A_MESSAGE:
                raise
            raise _not_director("this message") from None

    def _count(self, data: bytes) -> None:
        self._metrics.viewer_chunks_total.inc()
        self._metrics.viewer_bytes_total.inc(len(data))
