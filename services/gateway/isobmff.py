"""ISO-BMFF (MP4) boxes, read and written with `struct`: the fragments the VAE muxes, the boxes of a progressive file.

Knows nothing about sessions, HTTP or files on disk: it works on byte strings. Reading covers what a fragmented
stream holds (top-level boxes, the `moov` tree of an init segment, `moof`'s `tfhd` / `tfdt` / `trun` with every
optional field ISO/IEC 14496-12 8.8 allows); writing builds boxes and the sample tables (`stbl`, 8.5-8.7) of a
progressive file from those runs.
"""
from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from services.common.errors import InternalError

CONTAINERS = frozenset({"moov", "trak", "mdia", "minf", "stbl", "edts", "dinf", "mvex", "moof", "traf", "udta"})
"""Boxes whose payload is a sequence of boxes."""
NON_SYNC_SAMPLE = 0x00010000
"""`sample_is_non_sync_sample` in a sample's flags (8.8.3.1)."""


class BoxError(InternalError):
    """Bytes that are not the boxes they should be (truncated, or a size that does not fit)."""


class Box(NamedTuple):
    """One box inside a byte string: its type, where it starts, its whole size and its header's size."""

    type: str
    offset: int
    size: int
    header: int

    @property
    def payload(self) -> slice:
        return slice(self.offset + self.header, self.offset + self.size)

    @property
    def end(self) -> int:
        return self.offset + self.size


def read_box_header(data: bytes, pos: int, end: int) -> Box:
    """The box starting at `pos` (not past `end`); raise BoxError when its header or its size does not fit."""
    if end - pos < 8:
        raise BoxError(f"truncated box header at byte {pos} of {end}")
    size, kind = struct.unpack_from(">I4s", data, pos)
    header = 8
    if size == 1:
        if end - pos < 16:
            raise BoxError(f"truncated 64-bit box size at byte {pos}")
        (size,) = struct.unpack_from(">Q", data, pos + 8)
        header = 16
    elif size == 0:
        size = end - pos
    if size < header or pos + size > end:
        raise BoxError(f"box {kind!r} at byte {pos} claims {size} bytes, {end - pos} remain")
    return Box(kind.decode("latin-1"), pos, size, header)


def iter_boxes(data: bytes, start: int = 0, end: int | None = None) -> Iterator[Box]:
    """The boxes of data[start:end], which must be whole boxes only (else BoxError)."""
    end = len(data) if end is None else end
    pos = start
    while pos < end:
        found = read_box_header(data, pos, end)
        yield found
        pos = found.end


def children(data: bytes, parent: Box) -> list[Box]:
    """The boxes inside a container box."""
    return list(iter_boxes(data, parent.offset + parent.header, parent.end))


def child(data: bytes, parent: Box, kind: str) -> Box | None:
    """The first box of type `kind` directly inside `parent`."""
    return next((b for b in children(data, parent) if b.type == kind), None)


def find_path(data: bytes, parent: Box, path: str) -> Box | None:
    """The box at a '/'-separated path below `parent`, e.g. 'mdia/minf/stbl'."""
    node: Box | None = parent
    for kind in path.split("/"):
        node = child(data, node, kind) if node is not None else None
    return node


def full_box_header(data: bytes, found: Box) -> tuple[int, int]:
    """(version, flags) of a full box."""
    (word,) = struct.unpack_from(">I", data, found.offset + found.header)
    return word >> 24, word & 0xFFFFFF


# --- writing -----------------------------------------------------------------------------------------------


def box(kind: bytes, *payload: bytes) -> bytes:
    """A box with a 32-bit size (a 64-bit one when the payload needs it)."""
    body = b"".join(payload)
    if 8 + len(body) > 0xFFFFFFFF:
        return struct.pack(">I4sQ", 1, kind, 16 + len(body)) + body
    return struct.pack(">I4s", 8 + len(body), kind) + body


def full_box(kind: bytes, version: int, flags: int, *payload: bytes) -> bytes:
    return box(kind, struct.pack(">I", (version << 24) | flags), *payload)


# --- fragments ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrackDefaults:
    """A track's `trex` defaults (8.8.3), used where a fragment's `tfhd` and `trun` leave a field out."""

    duration: int = 0
    size: int = 0
    flags: int = 0


@dataclass(frozen=True)
class TrackRun:
    """One `trun` of a fragment: a track's samples stored contiguously from `data_offset` on."""

    track_id: int
    base_time: int
    """Decode time of the first sample, in the track's timescale (`tfdt`)."""
    data_offset: int
    """Where the first sample's bytes start, relative to the start of the byte string the moof was read from."""
    durations: tuple[int, ...]
    sizes: tuple[int, ...]
    sync: tuple[bool, ...]

    @property
    def num_bytes(self) -> int:
        return sum(self.sizes)


def trex_defaults(data: bytes, moov: Box) -> dict[int, TrackDefaults]:
    """Track id -> the `trex` defaults of an init segment's `moov/mvex`."""
    mvex = child(data, moov, "mvex")
    found: dict[int, TrackDefaults] = {}
    for trex in (b for b in children(data, mvex) if b.type == "trex") if mvex is not None else ():
        track_id, _index, duration, size, flags = struct.unpack_from(">5I", data, trex.offset + trex.header + 4)
        found[track_id] = TrackDefaults(duration, size, flags)
    return found


def parse_moof(data: bytes, moof: Box, defaults: dict[int, TrackDefaults]) -> list[TrackRun]:
    """The track runs of one `moof` (its data offsets made relative to `data`); raise BoxError if malformed."""
    runs: list[TrackRun] = []
    previous_end = moof.offset
    for traf in (b for b in children(data, moof) if b.type == "traf"):
        tfhd = child(data, traf, "tfhd")
        if tfhd is None:
            raise BoxError(f"traf at byte {traf.offset} has no tfhd")
        _, flags = full_box_header(data, tfhd)
        pos = tfhd.offset + tfhd.header + 4
        (track_id,) = struct.unpack_from(">I", data, pos)
        pos += 4
        base = defaults.get(track_id, TrackDefaults())
        # the base: given, the moof (default-base-is-moof), else where the previous traf's data ended
        base_offset = moof.offset if flags & 0x020000 else previous_end
        if flags & 0x000001:
            (base_offset,) = struct.unpack_from(">Q", data, pos)
            pos += 8
        if flags & 0x000002:
            pos += 4  # sample-description-index
        given: dict[int, int] = {}
        for bit in (0x000008, 0x000010, 0x000020):  # default sample duration, size, flags
            if flags & bit:
                (given[bit],) = struct.unpack_from(">I", data, pos)
                pos += 4
        traf_defaults = TrackDefaults(given.get(0x000008, base.duration), given.get(0x000010, base.size),
                                      given.get(0x000020, base.flags))
        tfdt = child(data, traf, "tfdt")
        base_time = 0
        if tfdt is not None:
            version, _ = full_box_header(data, tfdt)
            (base_time,) = struct.unpack_from(">Q" if version == 1 else ">I", data, tfdt.offset + tfdt.header + 4)
        implicit = base_offset  # a trun without a data offset starts where the previous one's data ended
        for trun in (b for b in children(data, traf) if b.type == "trun"):
            durations, sizes, sync, offset = _parse_trun(data, trun, base_offset, implicit, traf_defaults)
            runs.append(TrackRun(track_id, base_time, offset, durations, sizes, sync))
            base_time += sum(durations)
            implicit = previous_end = offset + sum(sizes)
    return runs


def _parse_trun(data: bytes, trun: Box, base_offset: int, implicit_offset: int, defaults: TrackDefaults
                ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[bool, ...], int]:
    _, flags = full_box_header(data, trun)
    pos = trun.offset + trun.header + 4
    (count,) = struct.unpack_from(">I", data, pos)
    pos += 4
    offset = implicit_offset
    if flags & 0x000001:
        (relative,) = struct.unpack_from(">i", data, pos)
        offset = base_offset + relative
        pos += 4
    first_flags = None
    if flags & 0x000004:
        (first_flags,) = struct.unpack_from(">I", data, pos)
        pos += 4
    # per-sample duration, size, flags, composition offset (read past: the VAE's streams have no B-frames)
    fields = [bit for bit in (0x000100, 0x000200, 0x000400, 0x000800) if flags & bit]
    if pos + count * 4 * len(fields) > trun.end:
        raise BoxError(f"trun at byte {trun.offset} holds fewer than its {count} samples")
    durations, sizes, sync = [], [], []
    for i in range(count):
        values = dict(zip(fields, struct.unpack_from(f">{len(fields)}I", data, pos)))
        pos += 4 * len(fields)
        sample_flags = values.get(0x000400, first_flags if i == 0 and first_flags is not None else defaults.flags)
        durations.append(values.get(0x000100, defaults.duration))
        sizes.append(values.get(0x000200, defaults.size))
        sync.append(not sample_flags & NON_SYNC_SAMPLE)
    return tuple(durations), tuple(sizes), tuple(sync), offset


# --- sample tables -----------------------------------------------------------------------------------------


def sample_table(stsd: bytes, runs: Sequence[TrackRun], chunk_offsets: Sequence[int]) -> bytes:
    """`stbl` of one track: its sample description box as read, then times, sizes, chunks (one per run)."""
    durations = [d for run in runs for d in run.durations]
    stts_entries: list[tuple[int, int]] = []
    for d in durations:
        if stts_entries and stts_entries[-1][1] == d:
            stts_entries[-1] = (stts_entries[-1][0] + 1, d)
        else:
            stts_entries.append((1, d))
    stts = full_box(b"stts", 0, 0, struct.pack(">I", len(stts_entries)),
                    *(struct.pack(">II", n, d) for n, d in stts_entries))
    sync = [s for run in runs for s in run.sync]
    stss = b""
    if not all(sync):
        numbers = [i + 1 for i, s in enumerate(sync) if s]
        stss = full_box(b"stss", 0, 0, struct.pack(">I", len(numbers)), struct.pack(f">{len(numbers)}I", *numbers))
    sizes = [s for run in runs for s in run.sizes]
    stsz = full_box(b"stsz", 0, 0, struct.pack(">II", 0, len(sizes)), struct.pack(f">{len(sizes)}I", *sizes))
    stsc_entries: list[tuple[int, int]] = []  # (first chunk, samples per chunk); sample description 1
    for number, run in enumerate(runs, start=1):
        if not stsc_entries or stsc_entries[-1][1] != len(run.sizes):
            stsc_entries.append((number, len(run.sizes)))
    stsc = full_box(b"stsc", 0, 0, struct.pack(">I", len(stsc_entries)),
                    *(struct.pack(">III", first, n, 1) for first, n in stsc_entries))
    if chunk_offsets and max(chunk_offsets) > 0xFFFFFFFF:
        stco = full_box(b"co64", 0, 0, struct.pack(">I", len(chunk_offsets)),
                        struct.pack(f">{len(chunk_offsets)}Q", *chunk_offsets))
    else:
        stco = full_box(b"stco", 0, 0, struct.pack(">I", len(chunk_offsets)),
                        struct.pack(f">{len(chunk_offsets)}I", *chunk_offsets))
    return box(b"stbl", stsd, stts, stss, stsz, stsc, stco)
