"""Fragmented MP4 file -> progressive MP4 file (`ftyp` + `moov` + one `mdat`), in pure Python.

Knows nothing about sessions, HTTP or the event loop: it reads one file written as an init segment followed by
`moof` + `mdat` fragments (what the VAE muxes) and writes another whose `moov` holds the sample tables built from
the fragments' `tfhd` / `tfdt` / `trun`. The samples' bytes are copied in their order (a fragment's video, then its
audio), so the file stays interleaved as it was streamed; the `moov` comes first, so a player can start before the
whole file is in. A file cut off mid-fragment (a gateway that died while writing) keeps its whole fragments.

Edit lists: a track whose init segment has one (the audio's, which skips the AAC encoder's priming samples) keeps its
media time; its duration, open-ended in a fragmented file, becomes what the fragments hold from that time on, or
`audio_samples` when given (the PCM samples the session fed the encoder: the padding of the last AAC frame is then
not played either). Durations are exact in the movie timescale, the least common multiple of the tracks'.
"""
from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from services.common.errors import InternalError
from services.gateway import isobmff
from services.gateway.isobmff import Box, BoxError, TrackRun, box, full_box

MP4_EPOCH_OFFSET = 2_082_844_800
"""Seconds from 1904-01-01 (MP4 times) to 1970-01-01 (Unix times)."""
_COPY_BLOCK = 1 << 20


class RemuxError(InternalError):
    """A file that holds no playable init segment and fragment."""


@dataclass
class FragmentedFile:
    """What a fragmented file holds: its init segment and, in file order, the runs of its whole fragments."""

    init: bytes
    runs: list[TrackRun] = field(default_factory=list)
    """Track runs with data offsets absolute in the file."""
    truncated: bool = False
    """Bytes after the last whole fragment were dropped."""


@dataclass(frozen=True)
class MovieInfo:
    """What a progressive file's `mvhd` says."""

    duration_s: float
    created: float
    """Unix time."""


def scan_fragmented(path: Path) -> FragmentedFile:
    """Read a fragmented file's init segment and fragment runs; raise RemuxError without an init segment."""
    size = path.stat().st_size
    with path.open("rb") as f:
        init = b""
        scanned: FragmentedFile | None = None
        defaults: dict[int, isobmff.TrackDefaults] = {}
        pos = 0
        pending: tuple[int, list[TrackRun]] | None = None  # a moof waiting for its mdat
        while pos < size:
            try:
                found = _header_at(f, pos, size)
            except BoxError:
                break
            if scanned is None and found.type in ("ftyp", "moov"):
                init += _read_at(f, pos, found.size)
                if found.type == "moov":
                    moov = next(b for b in isobmff.iter_boxes(init) if b.type == "moov")
                    defaults = isobmff.trex_defaults(init, moov)
                    scanned = FragmentedFile(init)
            elif scanned is not None and found.type == "moof":
                moof_bytes = _read_at(f, pos, found.size)
                moof = Box("moof", 0, found.size, found.header)
                try:
                    runs = isobmff.parse_moof(moof_bytes, moof, defaults)
                except (BoxError, struct.error):
                    break
                pending = (pos, [_shifted(run, pos) for run in runs])
            elif scanned is not None and found.type == "mdat" and pending is not None:
                start, end = pos + found.header, pos + found.size
                runs = pending[1]
                if any(run.data_offset < start or run.data_offset + run.num_bytes > end for run in runs):
                    break
                scanned.runs += runs
                pending = None
            pos += found.size
        if scanned is None:
            raise RemuxError(f"{path} holds no init segment (ftyp + moov)")
        scanned.truncated = pos < size or pending is not None
        return scanned


def remux(source: Path, target: Path, *, audio_samples: int | None = None, created: float | None = None
          ) -> MovieInfo:
    """Write `source` (fragmented) as the progressive MP4 `target` (atomically: a temporary file, then renamed)."""
    scanned = scan_fragmented(source)
    if not scanned.runs:
        raise RemuxError(f"{source} holds no whole fragment")
    init = scanned.init
    moov = next(b for b in isobmff.iter_boxes(init) if b.type == "moov")
    tracks = [_Track.read(init, trak) for trak in isobmff.children(init, moov) if trak.type == "trak"]
    movie_timescale = math.lcm(*(t.timescale for t in tracks))
    if movie_timescale > 0xFFFFFFFF:
        movie_timescale = 1000
    ftyp = box(b"ftyp", b"isom", struct.pack(">I", 0x200), b"isomiso2avc1mp41")
    payload = sum(run.num_bytes for run in scanned.runs)
    mdat_header = 16 if payload + 8 > 0xFFFFFFFF else 8
    moov_bytes, data_start = b"", 0
    for _ in range(3):  # the chunk offsets depend on the moov's size, which depends on their width (stco / co64)
        data_start = len(ftyp) + len(moov_bytes) + mdat_header
        moov_bytes = _movie(init, moov, tracks, scanned.runs, data_start, movie_timescale, created, audio_samples)
        if len(ftyp) + len(moov_bytes) + mdat_header == data_start:
            break
    else:
        raise RemuxError("the moov's size did not settle")  # cannot happen: the width changes once at most
    partial = target.with_name(target.name + ".tmp")
    with source.open("rb") as src, partial.open("wb") as out:
        out.write(ftyp + moov_bytes)
        out.write(struct.pack(">I4sQ", 1, b"mdat", payload + 16) if mdat_header == 16
                  else struct.pack(">I4s", payload + 8, b"mdat"))
        for offset, length in _coalesced(scanned.runs):
            _copy(src, out, offset, length)
        out.flush()
        os.fsync(out.fileno())
    os.replace(partial, target)
    return read_movie_info(target)


def read_movie_info(path: Path) -> MovieInfo:
    """The duration and creation time of a progressive MP4's `mvhd` (read without reading the whole file)."""
    size = path.stat().st_size
    with path.open("rb") as f:
        pos = 0
        while pos < size:
            found = _header_at(f, pos, size)
            if found.type == "moov":
                inner = pos + found.header
                while inner < pos + found.size:
                    child = _header_at(f, inner, pos + found.size)
                    if child.type == "mvhd":
                        mvhd = _read_at(f, inner, child.size)
                        return _movie_info(mvhd, Box("mvhd", 0, child.size, child.header))
                    inner += child.size
                break
            pos += found.size
    raise RemuxError(f"{path} has no moov/mvhd")


# --- the moov ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Track:
    track_id: int
    handler: str
    timescale: int
    media_time: int | None
    """The init segment's edit list's media time (None: no edit list)."""
    trak: Box

    @classmethod
    def read(cls, init: bytes, trak: Box) -> _Track:
        tkhd, mdhd = isobmff.child(init, trak, "tkhd"), isobmff.find_path(init, trak, "mdia/mdhd")
        hdlr = isobmff.find_path(init, trak, "mdia/hdlr")
        if tkhd is None or mdhd is None or hdlr is None:
            raise RemuxError("a trak of the init segment lacks tkhd, mdhd or hdlr")
        (track_id,) = struct.unpack(">I", _times(init, tkhd, 8)[2][:4])
        (timescale,) = struct.unpack(">I", _times(init, mdhd, 4)[2])
        elst = isobmff.find_path(init, trak, "edts/elst")
        media_time = None
        if elst is not None:
            version, _ = isobmff.full_box_header(init, elst)
            at = elst.offset + elst.header + 8 + (8 if version == 1 else 4)  # after the count and 1st duration
            (media_time,) = struct.unpack_from(">q" if version == 1 else ">i", init, at)
        handler = init[hdlr.offset + hdlr.header + 8:hdlr.offset + hdlr.header + 12].decode("latin-1")
        return cls(track_id, handler, timescale, media_time, trak)


def _movie(init: bytes, moov: Box, tracks: list[_Track], runs: list[TrackRun], data_start: int, movie_timescale: int,
           created: float | None, audio_samples: int | None) -> bytes:
    offsets: dict[int, list[int]] = {t.track_id: [] for t in tracks}
    for offset, run in zip(_new_offsets(runs, data_start), runs):
        offsets.setdefault(run.track_id, []).append(offset)
    when = None if created is None else int(created) + MP4_EPOCH_OFFSET
    traks, longest = [], 0
    for track in tracks:
        mine = [r for r in runs if r.track_id == track.track_id]
        media = sum(sum(r.durations) for r in mine)
        shown = media - (track.media_time or 0)
        if track.handler == "soun" and audio_samples is not None:  # its timescale is the sample rate
            shown = min(shown, audio_samples)
        shown = max(shown, 0)
        duration = shown * movie_timescale // track.timescale
        longest = max(longest, duration)
        traks.append(_trak(init, track, mine, offsets[track.track_id], media, duration, when))
    out = []
    for found in isobmff.children(init, moov):
        if found.type == "mvhd":
            out.append(_retimed(init, found, 4, duration=longest, when=when, timescale=movie_timescale))
        elif found.type == "trak":
            out.append(traks.pop(0))
        elif found.type != "mvex":  # a progressive file has no fragments to announce
            out.append(init[found.offset:found.end])
    return box(b"moov", *out)


def _trak(init: bytes, track: _Track, runs: list[TrackRun], offsets: list[int], media: int, duration: int,
          when: int | None) -> bytes:
    parts = []
    for found in isobmff.children(init, track.trak):
        if found.type == "tkhd":
            parts.append(_retimed(init, found, 8, duration=duration, when=when))
            if track.media_time is not None:
                elst = full_box(b"elst", 1, 0, struct.pack(">IQqhh", 1, duration, track.media_time, 1, 0))
                parts.append(box(b"edts", elst))
        elif found.type == "mdia":
            parts.append(_mdia(init, found, runs, offsets, media, when))
        elif found.type != "edts":
            parts.append(init[found.offset:found.end])
    return box(b"trak", *parts)


def _mdia(init: bytes, mdia: Box, runs: list[TrackRun], offsets: list[int], media: int, when: int | None) -> bytes:
    parts = []
    for found in isobmff.children(init, mdia):
        if found.type == "mdhd":
            parts.append(_retimed(init, found, 4, duration=media, when=when))
        elif found.type == "minf":
            inner = []
            for sub in isobmff.children(init, found):
                if sub.type == "stbl":
                    stsd = isobmff.child(init, sub, "stsd")
                    if stsd is None:
                        raise RemuxError("the init segment's stbl has no stsd")
                    inner.append(isobmff.sample_table(init[stsd.offset:stsd.end], runs, offsets))
                else:
                    inner.append(init[sub.offset:sub.end])
            parts.append(box(b"minf", *inner))
        else:
            parts.append(init[found.offset:found.end])
    return box(b"mdia", *parts)


def _times(data: bytes, found: Box, middle: int) -> tuple[int, int, bytes, int, bytes]:
    """(creation, modification, the `middle` bytes between them and the duration, duration, the rest) of an
    mvhd / mdhd (middle 4: the timescale) or tkhd (middle 8: track id and a reserved word), either version."""
    version, _ = isobmff.full_box_header(data, found)
    pos = found.offset + found.header + 4
    wide = version == 1
    fmt = ">QQ" if wide else ">II"
    created, modified = struct.unpack_from(fmt, data, pos)
    pos += 16 if wide else 8
    mid = data[pos:pos + middle]
    pos += middle
    (duration,) = struct.unpack_from(">Q" if wide else ">I", data, pos)
    pos += 8 if wide else 4
    return created, modified, mid, duration, data[pos:found.end]


def _retimed(data: bytes, found: Box, middle: int, *, duration: int, when: int | None,
             timescale: int | None = None) -> bytes:
    """The box again as version 1, with a new duration (and creation time, and timescale for mvhd)."""
    created, modified, mid, _, rest = _times(data, found, middle)
    if when is not None:
        created = modified = when
    if timescale is not None:
        mid = struct.pack(">I", timescale)
    _, flags = isobmff.full_box_header(data, found)
    return full_box(found.type.encode("latin-1"), 1, flags, struct.pack(">QQ", created, modified), mid,
                    struct.pack(">Q", duration), rest)


def _movie_info(data: bytes, mvhd: Box) -> MovieInfo:
    created, _, mid, duration, _ = _times(data, mvhd, 4)
    (timescale,) = struct.unpack(">I", mid)
    return MovieInfo(duration / timescale if timescale else 0.0, float(created - MP4_EPOCH_OFFSET) if created else 0.0)


# --- bytes -------------------------------------------------------------------------------------------------


def _shifted(run: TrackRun, by: int) -> TrackRun:
    return TrackRun(run.track_id, run.base_time, run.data_offset + by, run.durations, run.sizes, run.sync)


def _new_offsets(runs: list[TrackRun], data_start: int) -> list[int]:
    offsets, position = [], data_start
    for run in runs:
        offsets.append(position)
        position += run.num_bytes
    return offsets


def _coalesced(runs: list[TrackRun]) -> list[tuple[int, int]]:
    """The runs' byte ranges in order, adjacent ones merged (one read for a fragment's video and audio)."""
    ranges: list[tuple[int, int]] = []
    for run in runs:
        if ranges and ranges[-1][0] + ranges[-1][1] == run.data_offset:
            ranges[-1] = (ranges[-1][0], ranges[-1][1] + run.num_bytes)
        elif run.num_bytes:
            ranges.append((run.data_offset, run.num_bytes))
    return ranges


def _header_at(f: BinaryIO, pos: int, end: int) -> Box:
    """The header of the box at file position `pos` (the file's boxes end at `end`), its offset made absolute."""
    found = isobmff.read_box_header(_read_at(f, pos, min(16, end - pos)), 0, end - pos)
    return found._replace(offset=pos)


def _read_at(f: BinaryIO, pos: int, length: int) -> bytes:
    f.seek(pos)
    return f.read(length)


def _copy(src: BinaryIO, out: BinaryIO, offset: int, length: int) -> None:
    src.seek(offset)
    while length > 0:
        block = src.read(min(_COPY_BLOCK, length))
        if not block:
            raise RemuxError(f"the source ended {length} bytes early at byte {offset}")
        out.write(block)
        length -= len(block)
