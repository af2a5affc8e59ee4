"""LL-HLS media playlists of a live session (RFC 8216bis, protocol version 9), built from its broadcast window.

Knows nothing about aiohttp, sockets or how chunks are made: it reads the retained chunks of a broadcast (anything
shaped like `ChunkWindow`) and returns playlist text, and it decides the rules of blocking playlist reloads.

The mapping: the init segment is the `EXT-X-MAP`; each 5 s request (`request_index`) is one media segment, its media
sequence number; each chunk is one partial segment (`EXT-X-PART`, `INDEPENDENT=YES`: every media chunk opens with an
IDR frame, the trailer with the decoder's held-back frames, or it holds AAC frames only, each independent). The
trailer joins the last segment. A segment is complete (its `EXTINF` and URI listed) once a chunk of a later request
arrived or the session ended: only then is it known that no part will join it. Part URIs name the chunk's
transport index (`part/<index>.m4s`), so the next part's URI is known before it exists (`EXT-X-PRELOAD-HINT`);
segment URIs name the media sequence number (`seg/<msn>.m4s`, its parts' bytes concatenated).

Target durations cannot change while a playlist lives, so they come from the deployment (`HlsTiming`), not from
the chunks seen so far; a part or segment longer than them raises them (with a warning), so what is listed always
satisfies the spec. The window is the broadcast's: the oldest retained request is listed only when all its chunks
still are. Part tags are kept for the segments of the last three target durations, as the spec suggests, and dropped
once the session ended: the list is then whole segments and `EXT-X-ENDLIST`, which a player ends at its last segment
(hls.js takes a part list as ended when the middle of its last part is buffered, which an audio-only trailer part,
past the end of the video, never is in a muxed buffer).
"""
from __future__ import annotations

import logging
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import quote

from services.common.errors import ClientError
from services.gateway import isobmff

logger = logging.getLogger(__name__)

PLAYLIST_VERSION = 9
PART_SEGMENTS_TARGET_DURATIONS = 3
"""Segments ending within this many target durations of the playlist's end keep their `EXT-X-PART` tags."""


class ChunkLike(Protocol):
    """What the playlist reads of one retained chunk (`broadcast.BroadcastChunk`)."""

    index: int
    kind: str
    request_index: int
    duration_s: float
    data: bytes


class ChunkWindow(Protocol):
    """What the playlist reads of one session's stream (`broadcast.Broadcast`)."""

    init_segment: bytes | None
    ended: bool
    chunks: Sequence[ChunkLike]
    next_index: int


class HlsRequestError(ClientError):
    """A playlist request the spec says to refuse: `status` (400) and a named code."""

    def __init__(self, code: str, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.code = code
        self.status = status
        self.message = message


@dataclass(frozen=True)
class HlsTiming:
    """The deployment's target durations (fixed for a playlist's life)."""

    part_target_s: float
    """`PART-TARGET`: at least the longest chunk (34 frames, 1.417 s at 24 fps)."""
    target_duration_s: int
    """`EXT-X-TARGETDURATION`: at least the longest request rounded (124 frames, 5.17 s -> 5)."""

    def __post_init__(self) -> None:
        if not self.part_target_s > 0 or self.target_duration_s < 1:
            raise ValueError(f"HlsTiming({self.part_target_s}, {self.target_duration_s}): the part target must be "
                             "> 0 s and the target duration >= 1 s")

    @property
    def advance_part_limit(self) -> int:
        """How many parts past the last one a blocking request may ask for (the spec's Advance Part Limit)."""
        return 3 if self.part_target_s >= 1.0 else math.ceil(3 / self.part_target_s)


@dataclass(frozen=True)
class Part:
    index: int
    """The chunk's transport index (its URI)."""
    duration_s: float


@dataclass(frozen=True)
class Segment:
    msn: int
    """Media sequence number: the chunks' request index."""
    parts: tuple[Part, ...]
    complete: bool

    @property
    def duration_s(self) -> float:
        return sum(p.duration_s for p in self.parts)


@dataclass(frozen=True)
class BlockingRequest:
    """A blocking playlist reload: wait for segment `msn` (complete), or for its part `part` (or anything later)."""

    msn: int
    part: int | None = None


@dataclass(frozen=True)
class MediaPlaylist:
    """One rendering's worth of a session's playlist."""

    segments: tuple[Segment, ...]
    ended: bool
    next_index: int
    """The transport index of the next chunk (the preload hint), meaningless once ended."""
    part_target_s: float
    target_duration_s: int

    @property
    def last_part(self) -> tuple[int, int] | None:
        """(msn, part number within the segment) of the newest part listed."""
        if not self.segments:
            return None
        last = self.segments[-1]
        return last.msn, len(last.parts) - 1

    def segment(self, msn: int) -> Segment | None:
        return next((s for s in self.segments if s.msn == msn), None)

    def satisfies(self, request: BlockingRequest) -> bool:
        """True when the playlist holds what a blocking request waits for (or never will: it ended)."""
        if self.ended:
            return True
        if request.part is None:
            return any(s.complete and s.msn >= request.msn for s in self.segments)
        last = self.last_part
        return last is not None and last >= (request.msn, request.part)

    def check_reach(self, request: BlockingRequest, limit: int) -> None:
        """Raise HlsRequestError (400) for a blocking request too far past the live edge (RFC 8216bis 6.2.5.2)."""
        if self.ended:
            return
        last_msn, last_part = self.last_part or (-1, -1)
        if request.msn > last_msn + 2:
            raise HlsRequestError("hls_too_far_ahead", f"_HLS_msn={request.msn} is more than two segments past the "
                                                       f"newest ({last_msn})")
        if request.part is not None and (
                (request.msn == last_msn and request.part - last_part > limit)
                or (request.msn > last_msn and request.part + 1 > limit)):
            raise HlsRequestError("hls_too_far_ahead", f"_HLS_part={request.part} of segment {request.msn} is more "
                                                       f"than {limit} parts past the newest part ({last_msn}, "
                                                       f"{last_part})")

    def render(self, token: str | None = None) -> str:
        """The playlist text; `token` is appended to every URI (a browser player cannot send headers)."""
        suffix = f"?token={quote(token, safe='')}" if token else ""
        part_target = _ms_ceil(self.part_target_s)
        lines = ["#EXTM3U", f"#EXT-X-VERSION:{PLAYLIST_VERSION}", f"#EXT-X-TARGETDURATION:{self.target_duration_s}",
                 f"#EXT-X-PART-INF:PART-TARGET={part_target:.3f}",
                 f"#EXT-X-SERVER-CONTROL:CAN-BLOCK-RELOAD=YES,PART-HOLD-BACK={3 * part_target:.3f}",
                 f"#EXT-X-MEDIA-SEQUENCE:{self.segments[0].msn if self.segments else 0}",
                 "#EXT-X-INDEPENDENT-SEGMENTS", f'#EXT-X-MAP:URI="init.mp4{suffix}"']
        with_parts, tail = set(), 0.0
        for seg in reversed(self.segments):
            if tail >= PART_SEGMENTS_TARGET_DURATIONS * self.target_duration_s:
                break
            with_parts.add(seg.msn)
            tail += seg.duration_s
        for seg in self.segments:
            if seg.msn in with_parts and not self.ended:
                lines += [f'#EXT-X-PART:DURATION={p.duration_s:.3f},URI="part/{p.index}.m4s{suffix}",INDEPENDENT=YES'
                          for p in seg.parts]
            if seg.complete:
                lines += [f"#EXTINF:{seg.duration_s:.3f},", f"seg/{seg.msn}.m4s{suffix}"]
        if self.ended:
            lines.append("#EXT-X-ENDLIST")
        else:
            lines.append(f'#EXT-X-PRELOAD-HINT:TYPE=PART,URI="part/{self.next_index}.m4s{suffix}"')
        return "\n".join(lines) + "\n"


def parse_blocking_request(query: Mapping[str, str]) -> BlockingRequest | None:
    """The `_HLS_msn` / `_HLS_part` of a playlist request (None without them); raise HlsRequestError (400)."""
    msn, part = query.get("_HLS_msn"), query.get("_HLS_part")
    if msn is None:
        if part is not None:
            raise HlsRequestError("hls_bad_request", "_HLS_part needs _HLS_msn")
        return None
    values = []
    for name, text in (("_HLS_msn", msn), ("_HLS_part", part)):
        if text is None:
            values.append(None)
        elif not text.isdigit() or len(text) > 12:
            raise HlsRequestError("hls_bad_request", f"{name}={text!r} must be a non-negative integer")
        else:
            values.append(int(text))
    return BlockingRequest(values[0], values[1])


def build_playlist(window: ChunkWindow, timing: HlsTiming) -> MediaPlaylist:
    """The playlist of a broadcast's window as it is now."""
    chunks = list(window.chunks)
    groups: list[tuple[int, list[ChunkLike]]] = []
    for chunk in chunks:
        if chunk.kind == "trailer" and groups:
            groups[-1][1].append(chunk)  # the trailer belongs to the last segment
        elif groups and groups[-1][0] == chunk.request_index:
            groups[-1][1].append(chunk)
        else:
            groups.append((chunk.request_index, [chunk]))
    if chunks and chunks[0].index > 0 and groups:
        groups.pop(0)  # the oldest request may have lost chunks to the window: list whole ones only
    segments = []
    for number, (msn, members) in enumerate(groups):
        parts = tuple(Part(c.index, _duration_s(window.init_segment, c)) for c in members)
        complete = window.ended or number < len(groups) - 1
        segments.append(Segment(msn, parts, complete))
    part_target = timing.part_target_s
    longest_part = max((p.duration_s for s in segments for p in s.parts), default=0.0)
    if longest_part > part_target:
        logger.warning("a chunk of %.3f s is longer than the HLS part target %.3f s; the playlist lists the longer",
                       longest_part, part_target)
        part_target = longest_part
    target = max([timing.target_duration_s, *(round(s.duration_s) for s in segments)])
    return MediaPlaylist(tuple(segments), window.ended, window.next_index, part_target, target)


def _ms_ceil(seconds: float) -> float:
    """`seconds` rounded up to the millisecond (the playlist writes three decimals)."""
    return math.ceil(round(seconds * 1000, 6)) / 1000


def _duration_s(init: bytes | None, chunk: ChunkLike) -> float:
    """A chunk's media duration: the broadcast's (its frames at the frame rate), or, for a trailer holding only the
    AAC encoder's flush (no frames, no count of its samples), its audio as written in its boxes."""
    if chunk.duration_s > 0 or not init:
        return chunk.duration_s
    return fragment_duration_s(init, chunk.data)


def fragment_duration_s(init: bytes, data: bytes) -> float:
    """The longest track's duration in fragments `data`, with the timescales of init segment `init`."""
    timescales = track_timescales(init)
    moov = next(b for b in isobmff.iter_boxes(init) if b.type == "moov")
    defaults = isobmff.trex_defaults(init, moov)
    totals: dict[int, int] = {}
    for found in isobmff.iter_boxes(data):
        if found.type == "moof":
            for run in isobmff.parse_moof(data, found, defaults):
                totals[run.track_id] = totals.get(run.track_id, 0) + sum(run.durations)
    return max((ticks / timescales[track] for track, ticks in totals.items() if timescales.get(track)),
               default=0.0)


def track_timescales(init: bytes) -> dict[int, int]:
    """Track id -> media timescale, from an init segment's `moov`."""
    moov = next((b for b in isobmff.iter_boxes(init) if b.type == "moov"), None)
    if moov is None:
        raise isobmff.BoxError("the init segment has no moov")
    found = {}
    for trak in (b for b in isobmff.children(init, moov) if b.type == "trak"):
        tkhd, mdhd = isobmff.child(init, trak, "tkhd"), isobmff.find_path(init, trak, "mdia/mdhd")
        if tkhd is None or mdhd is None:
            raise isobmff.BoxError("a trak without tkhd or mdhd")
        version, _ = isobmff.full_box_header(init, tkhd)
        (track_id,) = struct.unpack_from(">I", init, tkhd.offset + tkhd.header + (20 if version == 1 else 12))
        version, _ = isobmff.full_box_header(init, mdhd)
        (found[track_id],) = struct.unpack_from(">I", init, mdhd.offset + mdhd.header + (20 if version == 1 else 12))
    return found
