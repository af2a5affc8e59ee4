"""One live session shared with many viewers: the chunks the director was sent, kept once, fanned out to viewers.

The session core publishes every chunk it sends its director (`Broadcast.publish`, which never waits); the first
chunk's init segment (`ftyp` + `moov`) is split off into `Broadcast.init_segment`, so every retained chunk is one
`moof` + `mdat` fragment that opens with a keyframe. A retained window of the newest chunks (`retain_s` of media)
serves late joiners and playlist readers, who wait for what comes next with `wait_for`. A viewer (`subscribe`)
starts at the newest media chunk and reads from its own bounded queue of references to the shared chunks: one copy
of each chunk in memory however many watch. A viewer whose queue is full when a chunk arrives skips ahead to that
chunk (its queue is emptied: the stream it gets stays decodable); one that has to skip more than `viewer_max_skips`
times without once emptying its queue is dropped (`ViewerTooSlow`). Publishing never waits on any viewer.

`Broadcasts` maps session ids to broadcasts; an ended one stays readable for `linger_s`, then is forgotten (its
chunks with it).

Knows nothing about websockets, HTTP, playlists or the pipeline: it holds bytes and wire dicts it was given.
"""
from __future__ import annotations

import asyncio
import logging
import struct
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from services.common.config import GatewayBroadcastConfig
from services.common.errors import ClientError, InternalError

logger = logging.getLogger(__name__)

INIT_BOX_TYPES = frozenset({b"ftyp", b"moov"})
"""Top-level boxes of an fMP4 init segment."""


class ViewerTooSlow(ClientError):
    """The viewer fell behind the live stream more than it may; it is dropped."""


class TooManyViewers(ClientError):
    """The session already has `max_viewers` viewers."""


class BadFragment(InternalError):
    """Chunk bytes that are not a sequence of whole ISO-BMFF boxes (the backend's muxer is at fault)."""


def split_init_segment(data: bytes) -> tuple[bytes, bytes]:
    """Split fMP4 bytes into (init segment, the rest) by their top-level boxes; raise BadFragment.

    The init segment is the leading `ftyp` and `moov` boxes (b"" when `data` opens with a fragment).
    """
    pos = 0
    init_end = 0
    in_init = True
    while pos < len(data):
        if len(data) - pos < 8:
            raise BadFragment(f"truncated box header at byte {pos} of {len(data)}")
        size, kind = struct.unpack_from(">I4s", data, pos)
        header = 8
        if size == 1:
            if len(data) - pos < 16:
                raise BadFragment(f"truncated 64-bit box size at byte {pos}")
            (size,) = struct.unpack_from(">Q", data, pos + 8)
            header = 16
        elif size == 0:
            size = len(data) - pos
        if size < header or pos + size > len(data):
            raise BadFragment(f"box {kind!r} at byte {pos} claims {size} bytes, {len(data) - pos} remain")
        pos += size
        if in_init and kind in INIT_BOX_TYPES:
            init_end = pos
        else:
            in_init = False
    return data[:init_end], data[init_end:]


@dataclass(frozen=True, eq=False)
class BroadcastChunk:
    """One chunk as the director got it, without the init segment."""

    index: int
    """Its `transport_chunk_index`: absolute, from 0, counting every binary frame of the session."""
    kind: Literal["media", "trailer"]
    request_index: int
    phase_index: int
    num_frames: int
    num_audio_samples: int
    duration_s: float
    """Media time it covers: num_frames / fps (the trailer: its audio, or its frames if longer)."""
    metadata: Mapping[str, Any]
    """The wire dict of the `video.chunk_metadata` sent to the director (its `byte_length` counts the init
    segment on chunk 0)."""
    data: bytes
    """One `moof` + `mdat` fragment, opening with a keyframe."""

    def __post_init__(self) -> None:
        if self.kind not in ("media", "trailer"):
            raise ValueError(f"BroadcastChunk.kind={self.kind!r} must be 'media' or 'trailer'")
        if not self.data:
            raise ValueError(f"BroadcastChunk {self.index} has no bytes")


@dataclass(frozen=True)
class BroadcastEnd:
    """How the session ended, for the `session.done` viewers get."""

    chunks: int
    """Chunks the session published."""
    stopped: bool
    """False only when the session completed its frame budget."""


class Broadcast:
    """One session's shared stream (see the module docstring)."""

    def __init__(self, session_id: str, config: GatewayBroadcastConfig, *, fps: int,
                 start: Mapping[str, Any] | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.session_id = session_id
        self.config = config
        self.fps = fps
        self.start: Mapping[str, Any] = dict(start or {})
        """The wire dict of the director's `video.start` (set by the session before its first chunk)."""
        self.init_segment: bytes | None = None
        self.done: BroadcastEnd | None = None
        self.ended_at: float | None = None
        self.bytes_published = 0
        self.on_end: Callable[[], None] | None = None
        """Called once when the broadcast ends (the registry schedules its removal)."""
        self._clock = clock
        self._chunks: deque[BroadcastChunk] = deque()
        self._retained_s = 0.0
        self._next_index = 0
        self._viewers: set[Viewer] = set()
        self._changed = asyncio.Event()

    # -- reading --
    @property
    def ended(self) -> bool:
        return self.done is not None

    @property
    def chunks(self) -> tuple[BroadcastChunk, ...]:
        """The retained chunks, oldest first (consecutive absolute indexes)."""
        return tuple(self._chunks)

    @property
    def next_index(self) -> int:
        """The index the next published chunk will have."""
        return self._next_index

    @property
    def num_viewers(self) -> int:
        return len(self._viewers)

    def chunk(self, index: int) -> BroadcastChunk | None:
        """The chunk with absolute `index`, or None if it was not published yet or left the window."""
        if not self._chunks:
            return None
        offset = index - self._chunks[0].index
        return self._chunks[offset] if 0 <= offset < len(self._chunks) else None

    async def wait_for(self, index: int) -> bool:
        """Wait until chunk `index` is published (True) or the broadcast ends without it (False)."""
        while self._next_index <= index and not self.ended:
            await self._changed.wait()
        return self._next_index > index

    # -- writing (the session core) --
    def publish(self, metadata: Mapping[str, Any], data: bytes) -> BroadcastChunk:
        """Publish one chunk exactly as sent to the director; its bytes may open with the init segment."""
        if self.ended:
            raise RuntimeError(f"broadcast {self.session_id} has ended; nothing more can be published")
        init, fragment = split_init_segment(data)
        if init:
            if self.init_segment is not None and init != self.init_segment:
                raise BadFragment(f"chunk {metadata.get('transport_chunk_index')} carries a second, different "
                                  "init segment")
            self.init_segment = init
        index = metadata["transport_chunk_index"]
        if index != self._next_index:
            raise InternalError(f"broadcast {self.session_id}: chunk {index} published, {self._next_index} expected")
        chunk = BroadcastChunk(
            index=index, kind=metadata["kind"], request_index=metadata["request_index"],
            phase_index=metadata["phase_index"], num_frames=metadata["num_frames"],
            num_audio_samples=metadata["num_audio_samples"],
            duration_s=self._duration(metadata), metadata=dict(metadata), data=fragment)
        self._next_index += 1
        self.bytes_published += len(data)
        self._retain(chunk)
        for viewer in tuple(self._viewers):
            viewer._offer(chunk)
        self._notify()
        return chunk

    def end(self, *, chunks: int, stopped: bool) -> None:
        """Mark the session over: waiting readers wake, viewers finish their queues, then get the end."""
        if self.ended:
            return
        self.done = BroadcastEnd(chunks=chunks, stopped=stopped)
        self.ended_at = self._clock()
        for viewer in tuple(self._viewers):
            viewer._wake()
        self._notify()
        if self.on_end is not None:
            self.on_end()

    # -- viewers --
    def subscribe(self) -> Viewer:
        """A new viewer, starting at the newest media chunk (and what follows it); raise TooManyViewers."""
        if len(self._viewers) >= self.config.max_viewers:
            raise TooManyViewers(f"session {self.session_id} already has {self.config.max_viewers} viewers")
        viewer = Viewer(self, self.config.viewer_queue_chunks, self.config.viewer_max_skips)
        if not self.ended:
            for chunk in self._join_point():
                viewer._queue.append(chunk)
        self._viewers.add(viewer)
        return viewer

    def _unsubscribe(self, viewer: Viewer) -> None:
        self._viewers.discard(viewer)

    def _join_point(self) -> Iterator[BroadcastChunk]:
        """The newest media chunk and any chunk after it (a late joiner's first chunks)."""
        chunks = list(self._chunks)
        for at in range(len(chunks) - 1, -1, -1):
            if chunks[at].kind == "media":
                yield from chunks[at:]
                return

    def _duration(self, metadata: Mapping[str, Any]) -> float:
        video_s = metadata["num_frames"] / self.fps
        if metadata["kind"] == "media":
            return video_s
        rate = metadata.get("audio_sample_rate") or 0
        return max(video_s, metadata["num_audio_samples"] / rate if rate else 0.0)

    def _retain(self, chunk: BroadcastChunk) -> None:
        self._chunks.append(chunk)
        self._retained_s += chunk.duration_s
        while len(self._chunks) > 1 and self._retained_s - self._chunks[0].duration_s >= self.config.retain_s:
            self._retained_s -= self._chunks.popleft().duration_s

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()


class Viewer:
    """One viewer's place in a broadcast: a bounded queue of shared chunks and the skip-ahead policy.

    Use as a context manager (or call `close`) so the broadcast forgets the viewer when it leaves.
    """

    def __init__(self, broadcast: Broadcast, queue_chunks: int, max_skips: int) -> None:
        self.broadcast = broadcast
        self._queue: deque[BroadcastChunk] = deque()
        self._queue_chunks = queue_chunks
        self._max_skips = max_skips
        self._skips_in_row = 0
        self.skips = 0
        """Times this viewer skipped ahead."""
        self.chunks_skipped = 0
        """Chunks it never got because it skipped ahead past them."""
        self.dropped = False
        self.on_drop: Callable[[], None] | None = None
        """Called (synchronously, once) when the viewer is dropped: its transport may be stuck in a send."""
        self._ready = asyncio.Event()

    def __enter__(self) -> Viewer:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    @property
    def queued(self) -> int:
        """Chunks waiting for this viewer."""
        return len(self._queue)

    async def next(self) -> BroadcastChunk | None:
        """The viewer's next chunk; None once the broadcast ended and the queue is empty; raise ViewerTooSlow."""
        while True:
            if self.dropped:
                raise ViewerTooSlow(f"the viewer fell behind more than {self._max_skips} times in a row")
            if self._queue:
                chunk = self._queue.popleft()
                if not self._queue:
                    self._skips_in_row = 0  # it caught up
                return chunk
            if self.broadcast.ended:
                return None
            self._ready.clear()
            await self._ready.wait()

    def close(self) -> None:
        """Leave the broadcast (idempotent)."""
        self.broadcast._unsubscribe(self)
        self._queue.clear()

    def _offer(self, chunk: BroadcastChunk) -> None:
        """Queue `chunk`, or skip ahead to it when the queue is full (called by the broadcast; never waits)."""
        if self.dropped:
            return
        if len(self._queue) >= self._queue_chunks:
            self.skips += 1
            self._skips_in_row += 1
            self.chunks_skipped += len(self._queue)
            self._queue.clear()
            if self._skips_in_row > self._max_skips:
                self.dropped = True
                self.broadcast._unsubscribe(self)
                logger.info("session %s: a viewer fell behind %d times in a row; dropped",
                            self.broadcast.session_id, self._skips_in_row)
                self._wake()
                if self.on_drop is not None:
                    self.on_drop()
                return
        self._queue.append(chunk)
        self._wake()

    def _wake(self) -> None:
        self._ready.set()


class Broadcasts:
    """The live (and lingering) broadcasts by session id."""

    def __init__(self, config: GatewayBroadcastConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._by_id: dict[str, Broadcast] = {}

    def open(self, session_id: str, *, fps: int) -> Broadcast:
        """Register a new session's broadcast."""
        self._forget_old()
        if session_id in self._by_id:
            raise ValueError(f"a broadcast for session {session_id} already exists")
        broadcast = Broadcast(session_id, self.config, fps=fps, clock=self._clock)
        broadcast.on_end = self._schedule_forget
        self._by_id[session_id] = broadcast
        return broadcast

    def get(self, session_id: str) -> Broadcast | None:
        """The broadcast of `session_id`: live, or ended less than `linger_s` ago; else None."""
        self._forget_old()
        return self._by_id.get(session_id)

    def __len__(self) -> int:
        self._forget_old()
        return len(self._by_id)

    def _schedule_forget(self) -> None:
        """Forget ended broadcasts once their linger is over, even if nobody opens or asks for one by then."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # ended outside a loop: the next open or get forgets it
            return
        loop.call_later(self.config.linger_s * 1.01, self._forget_old)

    def _forget_old(self) -> None:
        now = self._clock()
        for session_id in [s for s, b in self._by_id.items()
                           if b.ended_at is not None and now - b.ended_at >= self.config.linger_s]:
            del self._by_id[session_id]
