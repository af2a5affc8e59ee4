"""Session recordings: each session's stream appended to a file as it goes, then made a progressive MP4.

`Recordings` owns one directory (`gateway.recordings_dir`, one gateway per directory). `record(broadcast)` follows a
session's broadcast from its first chunk: the init segment (its `mvhd` stamped with the time) and every fragment
are appended to `<session id>.partial.mp4` as they are published, each written through to the operating system at
once, so a gateway that dies loses at most the chunk it was writing, and the file so far is a playable fragmented
MP4. When the session ends the file is remuxed (`remux`) into `<session id>.mp4`, a progressive MP4 with its audio
edit list (priming skipped, the last AAC frame's padding trimmed to the samples the session fed), and the partial
file is deleted. At start-up, partial files left by a gateway that died are finalized the same way from their whole
fragments (their audio is not trimmed at the end: the sample count died with the gateway); one without an init
segment and a whole fragment is deleted. Retention (`max_count`, `max_age_s`, by creation time) is enforced at
start-up and after each recording is finalized.

All file work runs on one worker thread, in submission order, off the event loop. Knows nothing about HTTP,
websockets or the pipeline: it reads broadcasts (`broadcast.Broadcast`) and files.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import datetime
import logging
import re
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from services.gateway import isobmff, remux
from services.gateway.broadcast import Broadcast

logger = logging.getLogger(__name__)

PARTIAL_SUFFIX = ".partial.mp4"
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,200}\.mp4$")
"""A finalized recording's file name (a session id + .mp4: no dot, no slash before the suffix)."""
CLOSE_TIMEOUT_S = 30.0
"""At shutdown, how long recordings still being finalized are waited for."""


@dataclass(frozen=True)
class RecordingInfo:
    """One finalized recording, as listed."""

    name: str
    bytes: int
    duration_s: float
    created: float
    """Unix time of the session's first chunk."""

    def to_wire(self) -> dict[str, Any]:
        created = datetime.datetime.fromtimestamp(self.created, datetime.timezone.utc)
        return {"name": self.name, "bytes": self.bytes, "duration_s": round(self.duration_s, 3),
                "created": created.isoformat().replace("+00:00", "Z")}


class Recordings:
    """The recordings directory (see the module docstring)."""

    def __init__(self, directory: str | Path, *, max_count: int | None = None, max_age_s: float | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.directory = Path(directory)
        self.max_count = max_count
        self.max_age_s = max_age_s
        self._clock = clock
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="recordings")
        self._tasks: set[asyncio.Task[None]] = set()

    # -- lifecycle --
    async def start(self) -> None:
        """Create the directory, finalize what a previous gateway left unfinished, apply the retention."""
        await self._run(self._start_up)

    async def close(self) -> None:
        """Wait (bounded) for the recordings being followed or finalized, then stop the worker thread."""
        if self._tasks:
            done, pending = await asyncio.wait(set(self._tasks), timeout=CLOSE_TIMEOUT_S)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        await asyncio.get_running_loop().run_in_executor(None, self._executor.shutdown, True)

    def record(self, broadcast: Broadcast) -> None:
        """Record a session's broadcast from its first chunk to its end (nothing if it ends without one)."""
        task = asyncio.create_task(self._follow(broadcast), name=f"record-{broadcast.session_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def idle(self) -> None:
        """Wait until every recording started so far is finalized."""
        while self._tasks:
            await asyncio.gather(*set(self._tasks), return_exceptions=True)

    # -- reading --
    async def list(self) -> list[RecordingInfo]:
        """The finalized recordings, newest first."""
        return await self._run(self._list)

    def path_of(self, name: str) -> Path | None:
        """The file of a finalized recording named `name`, or None (no such recording, or not a valid name)."""
        if not _NAME.match(name) or name.endswith(PARTIAL_SUFFIX):
            return None
        path = self.directory / name
        return path if path.is_file() else None

    # -- the follower (event loop) --
    async def _follow(self, broadcast: Broadcast) -> None:
        index, samples = 0, 0
        partial: _PartialFile | None = None
        try:
            while await broadcast.wait_for(index):
                chunk = broadcast.chunk(index)
                if chunk is None:
                    logger.error("recording of session %s: chunk %d left the broadcast window before it was "
                                 "written; the recording ends before it", broadcast.session_id, index)
                    break
                if partial is None:
                    if broadcast.init_segment is None:
                        logger.error("recording of session %s: no init segment; not recorded", broadcast.session_id)
                        return
                    partial = _PartialFile(self.directory / f"{broadcast.session_id}{PARTIAL_SUFFIX}",
                                           self._clock())
                    self._submit(partial.open, broadcast.init_segment)
                self._submit(partial.append, chunk.data)
                samples += chunk.num_audio_samples
                index += 1
        finally:
            if partial is not None:
                await asyncio.shield(self._run(self._finalize, partial, samples))

    def _submit(self, work: Callable[..., None], *args: Any) -> None:
        """Queue file work behind what was queued before (nothing waits for it here)."""
        self._executor.submit(work, *args)

    async def _run(self, work: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.wrap_future(self._executor.submit(work, *args))

    # -- file work (the worker thread) --
    def _start_up(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        for path in sorted(self.directory.glob(f"*{PARTIAL_SUFFIX}")):
            logger.warning("recording %s was left unfinished (the gateway stopped while writing it); finalizing "
                           "its whole fragments", path.name)
            self._finish_file(path, audio_samples=None)
        self._apply_retention()

    def _finalize(self, partial: _PartialFile, audio_samples: int) -> None:
        partial.close()
        if not partial.exists:
            return
        if partial.failed:
            logger.warning("recording %s: writing failed, finalizing what was written", partial.path.name)
        self._finish_file(partial.path, audio_samples=audio_samples if not partial.failed else None)
        self._apply_retention()

    def _finish_file(self, path: Path, *, audio_samples: int | None) -> None:
        target = path.with_name(path.name[: -len(PARTIAL_SUFFIX)] + ".mp4")
        try:
            info = remux.remux(path, target, audio_samples=audio_samples)
        except (remux.RemuxError, isobmff.BoxError) as exc:
            logger.warning("recording %s holds nothing playable (%s); deleted", path.name, exc)
            path.unlink(missing_ok=True)
            return
        except OSError:
            logger.exception("recording %s could not be finalized; the fragmented file is kept", path.name)
            return
        path.unlink(missing_ok=True)
        logger.info("recording %s finalized (%.2f s, %d bytes)", target.name, info.duration_s, target.stat().st_size)

    def _list(self) -> list[RecordingInfo]:
        found = []
        for path in self.directory.glob("*.mp4"):
            if not _NAME.match(path.name):
                continue  # partial files (and anything not written here)
            try:
                info = remux.read_movie_info(path)
                stat = path.stat()
            except (OSError, remux.RemuxError, isobmff.BoxError, struct.error):
                logger.warning("recording %s is unreadable; not listed", path.name)
                continue
            found.append((RecordingInfo(path.name, stat.st_size, info.duration_s, info.created or stat.st_mtime),
                          stat.st_mtime_ns))  # MP4 times are whole seconds: the later finalized is the newer
        return [r for r, _ in sorted(found, key=lambda f: (f[0].created, f[1]), reverse=True)]

    def _apply_retention(self) -> None:
        recordings = self._list()
        now = self._clock()
        doomed = [r for r in recordings if self.max_age_s is not None and now - r.created > self.max_age_s]
        kept = [r for r in recordings if r not in doomed]
        if self.max_count is not None:
            doomed += kept[self.max_count:]
        for recording in doomed:
            logger.info("recording %s removed by the retention (created %s)", recording.name,
                        recording.to_wire()["created"])
            (self.directory / recording.name).unlink(missing_ok=True)


class _PartialFile:
    """A recording being written: opened with the init segment, appended to per chunk (on the worker thread)."""

    def __init__(self, path: Path, created: float) -> None:
        self.path = path
        self.created = created
        self.failed = False
        self._file: BinaryIO | None = None

    def open(self, init: bytes) -> None:
        try:
            self._file = self.path.open("wb", buffering=0)  # every write goes to the OS at once
            self._write(stamp_creation_time(init, self.created))
        except OSError:
            self._fail()

    def append(self, data: bytes) -> None:
        if self._file is not None and not self.failed:
            try:
                self._write(data)
            except OSError:
                self._fail()

    @property
    def exists(self) -> bool:
        return self.path.exists()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _write(self, data: bytes) -> None:
        if self._file is None:
            raise OSError(f"{self.path.name} is not open")
        view = memoryview(data)
        while view:
            view = view[self._file.write(view):]

    def _fail(self) -> None:
        logger.exception("recording %s: writing failed; nothing more is recorded", self.path.name)
        self.failed = True


def stamp_creation_time(init: bytes, created: float) -> bytes:
    """The init segment with its `mvhd` creation and modification times set to Unix time `created`."""
    moov = next((b for b in isobmff.iter_boxes(init) if b.type == "moov"), None)
    mvhd = isobmff.child(init, moov, "mvhd") if moov is not None else None
    if mvhd is None:
        return init
    version, _ = isobmff.full_box_header(init, mvhd)
    when = int(created) + remux.MP4_EPOCH_OFFSET
    at = mvhd.offset + mvhd.header + 4
    stamp = struct.pack(">QQ", when, when) if version == 1 else struct.pack(">II", when, when)
    return init[:at] + stamp + init[at + len(stamp):]
