"""aiohttp routes of a session's LL-HLS stream: the playlist, the init segment, parts and whole segments.

Under `/v1/realtime/video/hls/{session_id}/`: `playlist.m3u8` (blocking reloads with `_HLS_msn` / `_HLS_part`),
`init.mp4`, `part/<transport index>.m4s` (the hinted next part blocks until it exists) and `seg/<msn>.m4s`. Every
answer needs a viewer token when `gateway.auth` is on (Bearer, or `?token=`, which the playlist then carries into
every URI it lists, so a browser player can fetch them); pages on the origins `gateway.auth` allows get CORS
headers. Media answers are immutable (`public, max-age, immutable`: a CDN may keep them); playlists are short-lived.
A plain playlist request waits for the session's first whole segment (a player that does not read parts finds an
empty list otherwise; one that does starts its hold-back behind the live edge anyway). A wait (blocking reload,
hinted part, the first segment) ends after three target durations with 503, as RFC 8216bis suggests.

Knows nothing about sessions or playlist rules: it reads broadcasts (`broadcast.Broadcasts`) and renders with
`hls`.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from aiohttp import web

from services.gateway import hls
from services.gateway.access import Access, Refusal
from services.gateway.broadcast import Broadcast, Broadcasts

logger = logging.getLogger(__name__)

HLS_ROOT = "/v1/realtime/video/hls/{session_id}"
PLAYLIST_TYPE = "application/vnd.apple.mpegurl"
INIT_TYPE = "video/mp4"
SEGMENT_TYPE = "video/iso.segment"
MEDIA_CACHE = "public, max-age=86400, immutable"
"""Init, parts and segments never change once they exist (their URIs name the session and the index)."""
LIVE_PLAYLIST_CACHE = "public, max-age=1"
BLOCKING_PLAYLIST_CACHE = "no-cache"
ENDED_PLAYLIST_CACHE = "public, max-age=60"


class HlsRoutes:
    """The HLS handlers of one gateway (see the module docstring)."""

    def __init__(self, broadcasts: Broadcasts, access: Access, timing: hls.HlsTiming) -> None:
        self._broadcasts = broadcasts
        self._access = access
        self._timing = timing
        self.wait_s = 3.0 * timing.target_duration_s
        """How long a request may wait for media that does not exist yet."""

    def register(self, router: web.UrlDispatcher) -> None:
        """Add the routes (GET, HEAD, and OPTIONS for CORS preflights)."""
        for tail, handler in (("/playlist.m3u8", self.playlist), ("/init.mp4", self.init),
                              (r"/part/{index:\d{1,12}}.m4s", self.part), (r"/seg/{msn:\d{1,12}}.m4s", self.segment)):
            router.add_get(HLS_ROOT + tail, handler)
            router.add_route("OPTIONS", HLS_ROOT + tail, self.preflight)

    # -- handlers --
    async def playlist(self, request: web.Request) -> web.Response:
        """The media playlist; with `_HLS_msn` (+ `_HLS_part`) held until that part or segment is listed."""
        broadcast = self._admit(request)
        try:
            blocking = hls.parse_blocking_request(request.query)
        except hls.HlsRequestError as exc:
            raise self._error(request, exc.status, exc.code, exc.message) from None
        deadline = time.monotonic() + self.wait_s
        while True:
            playlist = hls.build_playlist(broadcast, self._timing)
            if blocking is not None:
                try:
                    playlist.check_reach(blocking, self._timing.advance_part_limit)
                except hls.HlsRequestError as exc:
                    raise self._error(request, exc.status, exc.code, exc.message) from None
                if playlist.satisfies(blocking):
                    break
            elif playlist.ended or any(s.complete for s in playlist.segments):
                break  # a plain request waits for the first whole segment: players without parts need one
            await self._wait_next(request, broadcast, deadline)
        cache = (ENDED_PLAYLIST_CACHE if playlist.ended else BLOCKING_PLAYLIST_CACHE if blocking is not None
                 else LIVE_PLAYLIST_CACHE)
        text = playlist.render(token=request.query.get("token"))
        return web.Response(text=text, headers={"Content-Type": PLAYLIST_TYPE, "Cache-Control": cache,
                                                **self._cors(request)})

    async def init(self, request: web.Request) -> web.Response:
        """The init segment (`ftyp` + `moov`), once the session's first chunk is in."""
        broadcast = self._admit(request)
        deadline = time.monotonic() + self.wait_s
        while broadcast.init_segment is None:
            if broadcast.ended:
                raise self._error(request, 404, "unknown_part", "the session ended without media")
            await self._wait_next(request, broadcast, deadline)
        return self._media(request, broadcast.init_segment, INIT_TYPE)

    async def part(self, request: web.Request) -> web.Response:
        """One chunk's fragment; the next one (the playlist's preload hint) is held until it exists."""
        broadcast = self._admit(request)
        index = int(request.match_info["index"])
        if index == broadcast.next_index and not broadcast.ended:
            deadline = time.monotonic() + self.wait_s
            while broadcast.next_index <= index and not broadcast.ended:
                await self._wait_next(request, broadcast, deadline)
        chunk = broadcast.chunk(index)
        if chunk is None:
            raise self._error(request, 404, "unknown_part", f"part {index} of session {broadcast.session_id} is "
                                                            "not in its window (gone, or not the next one)")
        return self._media(request, chunk.data, SEGMENT_TYPE)

    async def segment(self, request: web.Request) -> web.StreamResponse:
        """A whole segment (one request): its parts' bytes, once it is complete, written part by part from the shared
        chunks (never joined into a copy: fifty readers of a 4 MB segment would hold fifty copies)."""
        broadcast = self._admit(request)
        msn = int(request.match_info["msn"])
        found = hls.build_playlist(broadcast, self._timing).segment(msn)
        chunks = [broadcast.chunk(p.index) for p in found.parts] if found is not None and found.complete else []
        if not chunks or any(c is None for c in chunks):
            raise self._error(request, 404, "unknown_segment", f"segment {msn} of session {broadcast.session_id} "
                                                               "is not complete in its window")
        response = web.StreamResponse(headers={"Content-Type": SEGMENT_TYPE, "Cache-Control": MEDIA_CACHE,
                                               **self._cors(request)})
        response.content_length = sum(len(c.data) for c in chunks if c is not None)
        await response.prepare(request)
        if request.method != "HEAD":
            for chunk in chunks:
                if chunk is not None:
                    await response.write(chunk.data)
        await response.write_eof()
        return response

    async def preflight(self, request: web.Request) -> web.Response:
        """A CORS preflight (a player sending `Authorization` or `Range`)."""
        headers = self._cors(request)
        if headers:
            headers.update({"Access-Control-Allow-Methods": "GET, HEAD, OPTIONS",
                            "Access-Control-Allow-Headers": "Authorization, Range",
                            "Access-Control-Max-Age": "600"})
        return web.Response(status=204, headers=headers)

    # -- helpers --
    def _admit(self, request: web.Request) -> Broadcast:
        """The requested session's broadcast, after the viewer token check; raise the HTTP error."""
        refusal = self._access.check_token(request.headers, request.query, watch=True)
        if refusal is not None:
            raise self._refused(request, refusal)
        session_id = request.match_info["session_id"]
        broadcast = self._broadcasts.get(session_id)
        if broadcast is None:
            raise self._error(request, 404, "unknown_session", f"no live session {session_id}")
        return broadcast

    async def _wait_next(self, request: web.Request, broadcast: Broadcast, deadline: float) -> None:
        """Wait for the broadcast's next chunk (or its end); raise 503 past the deadline."""
        remaining = deadline - time.monotonic()
        try:
            if remaining <= 0:
                raise asyncio.TimeoutError
            await asyncio.wait_for(broadcast.wait_for(broadcast.next_index), remaining)
        except asyncio.TimeoutError:
            raise self._error(request, 503, "hls_wait_timeout",
                              f"nothing new in session {broadcast.session_id} for {self.wait_s:g} s",
                              retry_after=True) from None

    def _media(self, request: web.Request, data: bytes, content_type: str) -> web.Response:
        return web.Response(body=data, headers={"Content-Type": content_type, "Cache-Control": MEDIA_CACHE,
                                                **self._cors(request)})

    def _cors(self, request: web.Request) -> dict[str, str]:
        """CORS headers for a page on an allowed origin (`gateway.auth.allowed_origins`, loopback, the own)."""
        origin = request.headers.get("Origin")
        if not origin or self._access.check_origin(origin, request.host) is not None:
            return {"Vary": "Origin"}
        return {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}

    def _refused(self, request: web.Request, refusal: Refusal) -> web.HTTPException:
        error = self._error(request, refusal.status, refusal.code, refusal.message)
        if refusal.status == 401:
            error.headers["WWW-Authenticate"] = "Bearer"
        return error

    def _error(self, request: web.Request, status: int, code: str, message: str, *,
               retry_after: bool = False) -> web.HTTPException:
        """An HTTP error with a protocol-shaped body (never cached: the part may exist a moment later)."""
        headers = {"Cache-Control": "no-store", **self._cors(request)}
        if retry_after:
            headers["Retry-After"] = "1"
        body = json.dumps({"type": "error", "code": code, "message": message, "fault": "client"})
        return _ERRORS[status](headers=headers, text=body, content_type="application/json")


_ERRORS: dict[int, type[web.HTTPException]] = {
    400: web.HTTPBadRequest, 401: web.HTTPUnauthorized, 403: web.HTTPForbidden, 404: web.HTTPNotFound,
    429: web.HTTPTooManyRequests, 503: web.HTTPServiceUnavailable}
