"""aiohttp transport: `/v1/realtime/video` websocket, its viewers' watch websockets, `/healthz`, `/metrics`, the pages.

Knows nothing about how chunks are generated: it reads frames, parses them with `protocol`,
drives `service.Session`, and writes what the session emits. Which errors close the connection is
documented in `protocol`'s module docstring and decided here.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any

from aiohttp import WSCloseCode, WSMsgType, web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from services.common.config import GatewayConfig
from services.gateway.access import Access, Refusal
from services.gateway.broadcast import TooManyViewers
from services.gateway.errors import ErrorCode, ErrorMessage, ProtocolError
from services.gateway.hls import HlsTiming
from services.gateway.hls_routes import HlsRoutes
from services.gateway.recording import Recordings
from services.gateway.recording_routes import RecordingRoutes
from services.gateway.metrics import GatewayMetrics
from services.gateway.pipeline import Pipeline
from services.gateway.protocol import (
    WATCH_PATH,
    ChunkMetadata,
    MessageLimits,
    Pong,
    ServerMessage,
    SessionInteraction,
    SessionPing,
    SessionStart,
    SessionStop,
    parse_client_text,
)
from services.gateway.service import ClientGone, Outcome, Session, SessionService
from services.gateway.watch import WatchConnection

logger = logging.getLogger(__name__)

REALTIME_PATH = "/v1/realtime/video"
SERVICE_KEY = web.AppKey("session_service", SessionService)
CONFIG_KEY = web.AppKey("gateway_config", GatewayConfig)
REGISTRY_KEY = web.AppKey("metrics_registry", CollectorRegistry)
ACCESS_KEY = web.AppKey("access", Access)
STATIC_DIR = Path(__file__).resolve().parent / "static"

# Errors about a frame that is not recognisably a session.start keep a not-yet-started
# connection open (the start timer keeps running); every other pre-start error closes it.
_PRESTART_KEEP_OPEN = {
    ErrorCode.INVALID_JSON, ErrorCode.BINARY_NOT_ALLOWED, ErrorCode.UNKNOWN_TYPE,
    ErrorCode.SESSION_NOT_STARTED,
}
# Once a session runs, message errors never close the connection.
_CLOSE_CODES = {
    ErrorCode.QUEUE_FULL: WSCloseCode.TRY_AGAIN_LATER,
    ErrorCode.MESSAGE_TOO_LARGE: WSCloseCode.MESSAGE_TOO_BIG,
}


def create_app(config: GatewayConfig, pipeline: Pipeline, registry: CollectorRegistry | None = None,
               access: Access | None = None) -> web.Application:
    """Build the gateway's aiohttp application (metrics go to `registry`, a fresh one if None; `access`: the
    token, origin and per-address checks, built from `config.auth` without tokens if None)."""
    registry = registry if registry is not None else CollectorRegistry()
    recordings = None
    if config.recordings_dir is not None:
        recordings = Recordings(config.recordings_dir, max_count=config.recordings_max_count,
                                max_age_s=config.recordings_max_age_s)
    service = SessionService(config, pipeline, GatewayMetrics(registry), recordings)
    app = web.Application()
    app[SERVICE_KEY] = service
    app[CONFIG_KEY] = config
    app[REGISTRY_KEY] = registry
    app[ACCESS_KEY] = access if access is not None else Access(config.auth)
    static_dir = Path(config.static_dir) if config.static_dir else STATIC_DIR
    index = static_dir / "index.html"
    watch_page = static_dir / "watch.html"

    async def index_page(_request: web.Request) -> web.FileResponse:
        return web.FileResponse(index)

    async def watch_page_of(_request: web.Request) -> web.FileResponse:
        return web.FileResponse(watch_page)

    app.router.add_get("/", index_page)
    app.router.add_get("/watch/{session_id}", watch_page_of)
    app.router.add_static("/static/", static_dir)
    app.router.add_get(REALTIME_PATH, realtime_video)
    app.router.add_get(WATCH_PATH, watch_video)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)
    HlsRoutes(service.broadcasts, app[ACCESS_KEY],
              HlsTiming(config.hls_part_target_s, config.hls_target_duration_s)).register(app.router)
    if recordings is not None:
        RecordingRoutes(recordings, app[ACCESS_KEY]).register(app.router)

        async def start_recordings(_app: web.Application) -> None:
            await recordings.start()

        async def close_recordings(_app: web.Application) -> None:
            await recordings.close()

        app.on_startup.append(start_recordings)
        app.on_cleanup.append(close_recordings)
    return app


async def healthz(request: web.Request) -> web.Response:
    """Answer 200 with occupancy when the backend is serving, 503 otherwise."""
    report = await request.app[SERVICE_KEY].health()
    return web.json_response(report, status=200 if report["ok"] else 503)


def refused(refusal: Refusal) -> web.Response:
    """The HTTP answer to a refused request: its status and a protocol-shaped error body."""
    headers = {"WWW-Authenticate": "Bearer"} if refusal.status == 401 else None
    return web.json_response({"type": "error", "code": refusal.code, "message": refusal.message,
                              "fault": "client"}, status=refusal.status, headers=headers)


async def metrics(request: web.Request) -> web.Response:
    """Expose the Prometheus registry (behind the token when `gateway.auth.protect_metrics`)."""
    access = request.app[ACCESS_KEY]
    if access.config.protect_metrics:
        refusal = access.check_token(request.headers, request.query)
        if refusal is not None:
            return refused(refusal)
    body = generate_latest(request.app[REGISTRY_KEY])
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def realtime_video(request: web.Request) -> web.StreamResponse:
    """Serve one realtime session over a websocket, once the origin, the token and the address's limit allow."""
    config, access = request.app[CONFIG_KEY], request.app[ACCESS_KEY]
    refusal = (access.check_origin(request.headers.get("Origin"), request.host)
               or access.check_token(request.headers, request.query))
    if refusal is not None:
        logger.info("websocket from %s refused: %s", request.remote, refusal.code)
        return refused(refusal)
    address = request.remote or "unknown"
    refusal = access.open_connection(address)
    if refusal is not None:
        return refused(refusal)
    try:
        ws = web.WebSocketResponse(max_msg_size=config.max_frame_bytes, heartbeat=config.heartbeat_s)
        await ws.prepare(request)
        connection = _Connection(ws, request.transport, request.app[SERVICE_KEY], config,
                                 lambda: access.allow_start(address))
        try:
            await connection.serve()
        finally:
            if not ws.closed:
                await ws.close()
        return ws
    finally:
        access.close_connection(address)


async def watch_video(request: web.Request) -> web.StreamResponse:
    """Stream a live session to one viewer over a websocket, once the origin, the token, the id and the limits allow."""
    config, access, service = request.app[CONFIG_KEY], request.app[ACCESS_KEY], request.app[SERVICE_KEY]
    refusal = (access.check_origin(request.headers.get("Origin"), request.host)
               or access.check_token(request.headers, request.query, watch=True))
    if refusal is not None:
        logger.info("watch websocket from %s refused: %s", request.remote, refusal.code)
        return refused(refusal)
    session_id = request.match_info["session_id"]
    broadcast = service.broadcasts.get(session_id)
    if broadcast is None:
        return refused(Refusal(404, ErrorCode.UNKNOWN_SESSION.value, "no live session has this id"))
    address = request.remote or "unknown"
    refusal = access.open_connection(address)
    if refusal is not None:
        return refused(refusal)
    try:
        try:
            viewer = broadcast.subscribe()
        except TooManyViewers as exc:
            return refused(Refusal(503, ErrorCode.TOO_MANY_VIEWERS.value, str(exc)))
        with viewer:
            # No compression: fMP4 does not deflate, and deflating once per viewer would cost CPU per viewer.
            ws = web.WebSocketResponse(max_msg_size=config.max_interaction_bytes, heartbeat=config.heartbeat_s,
                                       compress=False)
            await ws.prepare(request)
            limits = MessageLimits(config.max_interaction_bytes, config.max_interaction_bytes,
                                   config.max_prompt_chars)
            sink = _WebSocketSink(ws, request.transport, config.send_timeout_s)
            try:
                await WatchConnection(ws, sink, viewer, limits, service.metrics).serve()
            finally:
                if not ws.closed:
                    await ws.close()
            return ws
    finally:
        access.close_connection(address)


class _WebSocketSink:
    """MessageSink over one websocket; a lock keeps metadata and its bytes adjacent.

    Every message must reach the socket within `timeout_s`. One that does not (the client stopped reading)
    drops the connection: a frame cut off half-way leaves the stream unusable, and aborting the transport
    also ends the frame reader, which ends the session and frees its slot.
    """

    def __init__(self, ws: web.WebSocketResponse, transport: asyncio.BaseTransport | None,
                 timeout_s: float) -> None:
        self._ws = ws
        self._transport = transport
        self._timeout_s = timeout_s
        self._lock = asyncio.Lock()
        self._dropped = False

    async def send(self, message: ServerMessage) -> None:
        async with self._lock:
            await self._bounded(self._ws.send_str(json.dumps(message.to_wire())))

    async def send_media(self, metadata: ChunkMetadata, data: bytes) -> None:
        await self.send_wire(metadata.to_wire(), data)

    async def send_wire(self, wire: Mapping[str, Any], data: bytes | None = None) -> None:
        """Send a JSON-ready dict, then (when given) its binary frame right after it."""
        async with self._lock:
            await self._bounded(self._ws.send_str(json.dumps(wire)))
            if data is not None:
                await self._bounded(self._ws.send_bytes(data))

    @property
    def dropped(self) -> bool:
        """True once a send timed out and the connection was aborted."""
        return self._dropped

    async def _bounded(self, send: Coroutine[Any, Any, None]) -> None:
        if self._dropped or self._ws.closed:
            send.close()
            raise ClientGone("websocket closed")
        try:
            await asyncio.wait_for(send, self._timeout_s)
        except asyncio.TimeoutError:
            logger.warning("the client read nothing for %g s; dropping the connection", self._timeout_s)
            self.abort()
            raise ClientGone("the client stopped reading") from None
        except (ConnectionError, RuntimeError) as exc:
            raise ClientGone(str(exc)) from None

    @property
    def sending(self) -> bool:
        """True while a message is on its way to the socket (it may be stuck behind a client that reads nothing)."""
        return self._lock.locked()

    def abort(self) -> None:
        """Drop the connection now (every later send raises ClientGone)."""
        self._dropped = True
        if self._transport is not None:
            self._transport.abort()


class _Connection:
    """One websocket: waits for session.start, then runs the session and reads control frames."""

    def __init__(self, ws: web.WebSocketResponse, transport: asyncio.BaseTransport | None,
                 service: SessionService, config: GatewayConfig,
                 allow_start: Callable[[], Refusal | None] = lambda: None) -> None:
        self._ws = ws
        self._allow_start = allow_start
        self._service = service
        self._config = config
        self._sink = _WebSocketSink(ws, transport, config.send_timeout_s)
        self._limits = MessageLimits(config.max_start_bytes, config.max_interaction_bytes,
                                     config.max_prompt_chars)
        self._session_over = False
        """Set when the session ended: the frame reader stops at its next frame even if its cancel was lost."""

    async def serve(self) -> None:
        session = await self._await_start()
        if session is None:
            return
        run = asyncio.create_task(session.run())
        reader = asyncio.create_task(self._read_session_frames(session))
        try:
            await asyncio.wait({run, reader}, return_when=asyncio.FIRST_COMPLETED)
            if run.done():
                outcome = run.result()
                code = WSCloseCode.OK if outcome in (Outcome.COMPLETED, Outcome.STOPPED) else (
                    WSCloseCode.INTERNAL_ERROR)
                # Stop the reader first: a close() that finds a receive() pending breaks it and drops
                # the connection at once, and clients then see 1006 instead of the closing handshake.
                # A cancel that lands as the reader's error reply completes is swallowed by Python 3.11's
                # wait_for, so the reader also checks the flag before it reads again.
                self._session_over = True
                reader.cancel()
                await asyncio.gather(reader, return_exceptions=True)
                await self._ws.close(code=code)
            else:
                logger.info("session %s: client disconnected", session.request_id)
        finally:
            # The client went away (or aiohttp cancelled this handler because the transport was
            # lost): cancelling run() cancels the backend session and frees the slot.
            for task in (run, reader):
                task.cancel()
            await asyncio.gather(run, reader, return_exceptions=True)
            session.abandon()

    async def _await_start(self) -> Session | None:
        """Handle frames until a session starts; None when the connection ended instead."""
        deadline = time.monotonic() + self._config.start_timeout_s
        while True:
            remaining = deadline - time.monotonic()
            try:
                if remaining <= 0:
                    raise asyncio.TimeoutError
                msg = await self._ws.receive(timeout=remaining)
            except asyncio.TimeoutError:
                await self._reject(ProtocolError(
                    ErrorCode.START_TIMEOUT,
                    f"no session.start within {self._config.start_timeout_s:g} s"))
                return None
            if msg.type in (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED, WSMsgType.ERROR):
                return None
            try:
                message = self._parse_before_start(msg)
                if isinstance(message, SessionStart):
                    refusal = self._allow_start()
                    if refusal is not None:
                        self._service.metrics.sessions_total.labels(outcome="rejected").inc()
                        raise ProtocolError(ErrorCode.RATE_LIMITED, refusal.message)
                    return self._service.open(message, self._sink)
                if isinstance(message, SessionPing):
                    await self._sink.send(Pong())
                else:
                    raise ProtocolError(
                        ErrorCode.SESSION_NOT_STARTED,
                        f"{type(message).TYPE} before session.start; send session.start first")
            except ProtocolError as exc:
                if exc.code in _PRESTART_KEEP_OPEN:
                    await self._send_error(exc)
                else:
                    await self._reject(exc)
                    return None
            except ClientGone:
                return None

    async def _read_session_frames(self, session: Session) -> None:
        """Handle control frames while the session runs; return when the socket closes or the session ended."""
        while not self._session_over:
            msg = await self._ws.receive()
            if msg.type in (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED, WSMsgType.ERROR):
                return
            try:
                message = self._parse(msg)
                if isinstance(message, SessionStart):
                    raise ProtocolError(
                        ErrorCode.SESSION_ALREADY_STARTED,
                        f"session {session.request_id} is already running; one session per connection")
                if isinstance(message, SessionPing):
                    session.ping()
                    await self._sink.send(Pong())
                elif isinstance(message, SessionStop):
                    session.stop()
                elif isinstance(message, SessionInteraction):
                    session.interact(message)
            except ProtocolError as exc:
                await self._send_error(exc, request_id=session.request_id)
            except ClientGone:
                return

    def _parse_before_start(self, msg) -> object:
        """Parse a frame before the session starts; a frame refused as (maybe) a start counts as a rejected session
        (`open()` counts the starts it refuses)."""
        try:
            return self._parse(msg)
        except ProtocolError as exc:
            if exc.code not in _PRESTART_KEEP_OPEN:
                self._service.metrics.sessions_total.labels(outcome="rejected").inc()
            raise

    def _parse(self, msg) -> object:
        if msg.type == WSMsgType.BINARY:
            raise ProtocolError(ErrorCode.BINARY_NOT_ALLOWED,
                                "binary frames are server-to-client only; send JSON text")
        if msg.type != WSMsgType.TEXT:
            raise ProtocolError(ErrorCode.INVALID_JSON, f"unexpected websocket frame {msg.type!r}")
        return parse_client_text(msg.data, self._limits)

    async def _send_error(self, exc: ProtocolError, *, request_id: str | None = None) -> None:
        self._service.metrics.errors_total.labels(code=exc.code.value).inc()
        await self._sink.send(ErrorMessage(exc.code, exc.message, event_id=exc.event_id,
                                           request_id=request_id))

    async def _reject(self, exc: ProtocolError) -> None:
        """Send the error, then close the connection with a matching close code."""
        logger.info("rejecting connection: %s", exc)
        try:
            await self._send_error(exc)
        except ClientGone:
            return
        await self._ws.close(code=_CLOSE_CODES.get(exc.code, WSCloseCode.POLICY_VIOLATION),
                             message=exc.code.value.encode())
