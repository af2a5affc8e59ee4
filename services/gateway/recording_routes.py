"""aiohttp routes of the session recordings: `/v1/recordings` (JSON listing) and `/v1/recordings/{name}` (the MP4).

Both need a director token when `gateway.auth` is on (Bearer or `?token=`), as the realtime websocket does. The
download supports range requests (a player seeks in it). Knows nothing about how recordings are written: it asks
`recording.Recordings`.
"""
from __future__ import annotations

import json

from aiohttp import web

from services.gateway.access import Access, Refusal
from services.gateway.recording import Recordings

RECORDINGS_PATH = "/v1/recordings"


class RecordingRoutes:
    """The listing and download handlers."""

    def __init__(self, recordings: Recordings, access: Access) -> None:
        self._recordings = recordings
        self._access = access

    def register(self, router: web.UrlDispatcher) -> None:
        router.add_get(RECORDINGS_PATH, self.listing)
        router.add_get(RECORDINGS_PATH + "/{name}", self.download)

    async def listing(self, request: web.Request) -> web.Response:
        """Every finalized recording, newest first: name, bytes, duration_s, created (UTC, ISO 8601), url."""
        self._check(request)
        found = [{**r.to_wire(), "url": f"{RECORDINGS_PATH}/{r.name}"} for r in await self._recordings.list()]
        return web.json_response({"recordings": found}, headers={"Cache-Control": "no-store"})

    async def download(self, request: web.Request) -> web.StreamResponse:
        """One recording's progressive MP4."""
        self._check(request)
        name = request.match_info["name"]
        path = self._recordings.path_of(name)
        if path is None:
            raise _error(Refusal(404, "unknown_recording", f"no recording named {name!r}"))
        return web.FileResponse(path, headers={"Content-Type": "video/mp4", "Cache-Control": "private, max-age=3600",
                                               "Content-Disposition": f'inline; filename="{name}"'})

    def _check(self, request: web.Request) -> None:
        refusal = self._access.check_token(request.headers, request.query)
        if refusal is not None:
            raise _error(refusal)


def _error(refusal: Refusal) -> web.HTTPException:
    """An HTTP error with a protocol-shaped body."""
    body = json.dumps({"type": "error", "code": refusal.code, "message": refusal.message, "fault": "client"})
    headers = {"Cache-Control": "no-store"}
    if refusal.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    error = {401: web.HTTPUnauthorized, 403: web.HTTPForbidden, 404: web.HTTPNotFound}[refusal.status]
    return error(headers=headers, text=body, content_type="application/json")
