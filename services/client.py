"""Command-line client of `/v1/realtime/video`: streams one session, sends scheduled prompt updates,
prints per-chunk latency and writes the received stream to an MP4 file.

    python -m services.client --url ws://127.0.0.1:8000/v1/realtime/video \\
        --prompt "a lake at dawn" --seconds 20 --update 10s:"a storm rolls in" --out out.mp4

Knows only the wire protocol (no gateway or backend imports). The concatenated binary frames are a
playable fragmented MP4; `--remux` rewrites them as a progressive MP4 (stream copy, no re-encode).
Clocks: `--clock media` (default) measures seconds of media received (frames / fps), so updates land at
the same place in the video however fast the server is; `--clock wall` measures seconds since the
first chunk arrived.

`--hold` (`extra_params.hold_for_prompt`) makes the server wait, at each ~5 s request boundary after the first, for
a prompt newer than the last applied; without `--hold-max-seconds` that wait has no end. Under `--clock media` the
clock then stops with the media, so an `--update` scheduled past the boundary could never become due. The client
therefore treats "hold unbounded, every sent update taken by the server, and no media for `--hold-idle-seconds`"
as a held server: it sends the next scheduled update at once (it lands at this boundary, the earliest it can), and
once no update is left it sends `session.stop` and ends with the media it already has, logging why (the run still
exits 0; `ClientResult.stop_reason` says so). For updates to land where scheduled, schedule one before each
boundary; or pass `--hold-max-seconds` (a hold then ends by itself) or `--clock wall`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from services.common.media import VIDEO_FPS

logger = logging.getLogger("services.client")

_UPDATE_RE = re.compile(r"^\s*(?P<at>\d+(?:\.\d+)?)\s*s?\s*:(?P<prompt>.+)$", re.DOTALL)


class ClientError(Exception):
    """The session could not be completed (server error, protocol violation, lost connection)."""


@dataclass(frozen=True)
class PromptUpdate:
    """A prompt change scheduled `at_s` seconds into the session (see the module docstring)."""

    at_s: float
    prompt: str


def parse_update(text: str) -> PromptUpdate:
    """Parse `10s:new prompt` (or `10:new prompt`)."""
    match = _UPDATE_RE.match(text)
    if match is None or not match.group("prompt").strip():
        raise ValueError(f"update {text!r} must look like 10s:\"new prompt\"")
    prompt = match.group("prompt").strip()
    if len(prompt) >= 2 and prompt[0] == prompt[-1] and prompt[0] in "\"'":
        prompt = prompt[1:-1].strip()  # quotes that reached us unstripped (not via a shell)
    if not prompt:
        raise ValueError(f"update {text!r} must look like 10s:\"new prompt\"")
    return PromptUpdate(float(match.group("at")), prompt)


@dataclass(frozen=True)
class ClientOptions:
    """One client run."""

    url: str
    prompt: str
    seconds: float = 20.0
    updates: tuple[PromptUpdate, ...] = ()
    out: Path | None = None
    seed: int | None = None
    width: int | None = None
    height: int | None = None
    model: str | None = None
    hold: bool = False
    hold_max_seconds: float | None = None
    pace: bool = False
    """Ask the gateway to send chunks at media speed (extra_params.pace_to_media_time)."""
    clock: str = "media"
    ping_interval_s: float = 10.0
    remux: bool = False
    hold_idle_s: float = 10.0
    """With an unbounded `--hold` and `--clock media`: this long without media while the server has every sent
    update means the server holds for a prompt (see the module docstring)."""

    def __post_init__(self) -> None:
        if not self.prompt.strip():
            raise ValueError("--prompt is empty")
        if self.seconds <= 0:
            raise ValueError(f"--seconds={self.seconds} must be > 0")
        if self.clock not in ("media", "wall"):
            raise ValueError(f"--clock={self.clock!r} must be 'media' or 'wall'")
        if self.ping_interval_s <= 0:
            raise ValueError(f"--ping-interval={self.ping_interval_s} must be > 0")
        if self.hold_idle_s <= 0:
            raise ValueError(f"--hold-idle-seconds={self.hold_idle_s} must be > 0")
        if self.hold_max_seconds is not None and self.hold_max_seconds < 0:
            raise ValueError(f"--hold-max-seconds={self.hold_max_seconds} must be >= 0 (0 = no limit)")
        if not self.url.startswith(("ws://", "wss://")):
            raise ValueError(f"--url={self.url!r} must start with ws:// or wss://")

    @property
    def hold_unbounded(self) -> bool:
        """A hold can last forever: only a prompt update ends it."""
        return self.hold and not self.hold_max_seconds


@dataclass(frozen=True)
class ChunkStat:
    """What the client saw for one binary frame."""

    index: int
    kind: str
    request_index: int
    phase_index: int
    num_frames: int
    byte_length: int
    arrived_s: float
    """Seconds from sending session.start to this frame's arrival."""
    interval_s: float
    """Seconds since the previous frame (since session.start for the first)."""
    completed_event_ids: tuple[str, ...]


@dataclass
class ClientResult:
    """Everything one run received."""

    request_id: str | None = None
    config: dict[str, Any] = field(default_factory=dict)
    chunks: list[ChunkStat] = field(default_factory=list)
    queue_positions: list[int] = field(default_factory=list)
    queued_event_ids: list[str] = field(default_factory=list)
    applied_at: dict[str, int] = field(default_factory=dict)
    """event id -> transport index of the chunk whose completed_event_ids held it."""
    sent_updates: dict[str, PromptUpdate] = field(default_factory=dict)
    errors: list[dict[str, Any]] = field(default_factory=list)
    done: dict[str, Any] | None = None
    data: bytearray = field(default_factory=bytearray)
    media_seconds: float = 0.0
    wall_seconds: float = 0.0
    stop_reason: str | None = None
    """Why the client stopped before `--seconds` (a held server with no update left); None otherwise."""

    @property
    def time_to_first_chunk_s(self) -> float | None:
        media = [c for c in self.chunks if c.kind == "media"]
        return media[0].arrived_s if media else None


class _Run:
    """State of one streaming run."""

    def __init__(self, options: ClientOptions) -> None:
        self.options = options
        self.result = ClientResult()
        self.pending_updates = sorted(options.updates, key=lambda u: u.at_s)
        self.stop_sent = False
        self.fps = VIDEO_FPS
        self.t_start = 0.0
        self.t_first_chunk: float | None = None
        self.t_last = 0.0
        self.t_progress = 0.0
        """Monotonic time of the last binary frame or sent update (the hold detector's idle clock)."""
        self.taken: set[str] = set()
        """Event ids the server reported started/completed on a chunk, or rejected with an error."""
        self.meta: dict[str, Any] | None = None

    def clock(self) -> float:
        if self.options.clock == "media":
            return self.result.media_seconds
        return 0.0 if self.t_first_chunk is None else time.monotonic() - self.t_first_chunk

    def start_message(self) -> dict[str, Any]:
        o = self.options
        body: dict[str, Any] = {"type": "session.start", "prompt": o.prompt, "format": "m4s"}
        for key in ("seed", "width", "height", "model"):
            if getattr(o, key) is not None:
                body[key] = getattr(o, key)
        extra: dict[str, Any] = {}
        if o.hold:
            extra["hold_for_prompt"] = True
        if o.hold_max_seconds is not None:
            extra["hold_max_seconds"] = o.hold_max_seconds
        if o.pace:
            extra["pace_to_media_time"] = True
        if extra:
            body["extra_params"] = extra
        return body

    async def tick(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        """Send due prompt updates, and session.stop once the session is long enough."""
        if self.result.request_id is None or self.stop_sent:
            return
        now = self.clock()
        while self.pending_updates and self.pending_updates[0].at_s <= now:
            await self._send_update(ws, now)
        if now >= self.options.seconds:
            await self._send_stop(ws, now)
        elif self.server_holds():
            idle = time.monotonic() - self.t_progress
            if self.pending_updates:
                logger.warning("t=%.2fs  no media for %.1f s and the server has every update: it holds for a new "
                               "prompt (--hold); sending the update scheduled at %.2f s now", now, idle,
                               self.pending_updates[0].at_s)
                await self._send_update(ws, now)
            else:
                self.result.stop_reason = (
                    f"the server holds for a new prompt after {now:.2f} s of media (--hold without "
                    f"--hold-max-seconds) and every --update was sent, so no media can come; stopped short of "
                    f"--seconds={self.options.seconds:g}. Schedule an --update before each ~5 s request boundary, "
                    f"or pass --hold-max-seconds so a hold ends by itself (or --clock wall)")
                logger.warning("t=%.2fs  %s", now, self.result.stop_reason)
                await self._send_stop(ws, now)

    def server_holds(self) -> bool:
        """True when the media clock cannot advance: an unbounded hold has nothing to wait for but our next update."""
        o = self.options
        if not (o.hold_unbounded and o.clock == "media") or self.t_first_chunk is None:
            return False
        if any(event_id not in self.taken for event_id in self.result.sent_updates):
            return False  # the server has an update it has not applied yet: it is not (or not for long) held
        return time.monotonic() - self.t_progress >= o.hold_idle_s

    async def _send_update(self, ws: aiohttp.ClientWebSocketResponse, now: float) -> None:
        update = self.pending_updates.pop(0)
        event_id = f"cli-{uuid.uuid4().hex[:8]}"
        self.result.sent_updates[event_id] = update
        self.t_progress = time.monotonic()
        logger.info("t=%.2fs  update %s: %s", now, event_id, update.prompt)
        await ws.send_str(json.dumps({"type": "session.interaction", "interaction": {
            "event_id": event_id, "event": {"prompt": update.prompt}}}))

    async def _send_stop(self, ws: aiohttp.ClientWebSocketResponse, now: float) -> None:
        self.stop_sent = True
        logger.info("t=%.2fs  sending session.stop", now)
        await ws.send_str(json.dumps({"type": "session.stop"}))

    def on_text(self, msg: dict[str, Any]) -> None:
        kind = msg.get("type")
        r = self.result
        if kind == "video.start":
            r.request_id = msg.get("request_id")
            r.config = dict(msg.get("config") or {})
            self.fps = int(r.config.get("fps") or 24)
            logger.info("video.start %s %sx%s@%s", r.request_id, r.config.get("width"),
                        r.config.get("height"), self.fps)
        elif kind == "session.queued":
            r.queue_positions.append(int(msg["position"]))
            logger.info("queued: position %s", msg["position"])
        elif kind == "video.chunk_metadata":
            if self.meta is not None:
                raise ClientError("two video.chunk_metadata messages without a binary frame between")
            self.meta = msg
        elif kind == "session.interaction.queued":
            r.queued_event_ids.append(msg["event_id"])
            logger.info("update %s queued by the server", msg["event_id"])
        elif kind == "session.done":
            r.done = msg
        elif kind == "error":
            r.errors.append(msg)
            if msg.get("event_id"):
                self.taken.add(str(msg["event_id"]))  # a rejected update will never apply
            logger.warning("server error %s: %s", msg.get("code"), msg.get("message"))

    def on_binary(self, data: bytes) -> None:
        meta = self.meta
        if meta is None:
            raise ClientError("binary frame without a preceding video.chunk_metadata")
        self.meta = None
        if meta.get("byte_length") != len(data):
            raise ClientError(f"binary frame has {len(data)} bytes, metadata said {meta.get('byte_length')}")
        now = time.monotonic()
        if self.t_first_chunk is None:
            self.t_first_chunk = now
        r = self.result
        stat = ChunkStat(
            index=int(meta["transport_chunk_index"]), kind=str(meta.get("kind", "media")),
            request_index=int(meta.get("request_index", 0)), phase_index=int(meta.get("phase_index", 0)),
            num_frames=int(meta.get("num_frames", 0)), byte_length=len(data),
            arrived_s=now - self.t_start, interval_s=now - (self.t_last or self.t_start),
            completed_event_ids=tuple(meta.get("completed_event_ids") or ()),
        )
        self.t_last = self.t_progress = now
        self.taken.update(str(e) for e in meta.get("started_event_ids") or ())
        self.taken.update(stat.completed_event_ids)
        r.chunks.append(stat)
        r.data.extend(data)
        r.media_seconds += stat.num_frames / self.fps
        for event_id in stat.completed_event_ids:
            r.applied_at.setdefault(event_id, stat.index)
        logger.info(
            "chunk %3d %-7s req %d phase %d: %3d frames %7.1f KiB  +%6.0f ms  (t=%.2fs, media %.2fs)%s",
            stat.index, stat.kind, stat.request_index, stat.phase_index, stat.num_frames,
            stat.byte_length / 1024, stat.interval_s * 1000, stat.arrived_s, r.media_seconds,
            f"  applied {list(stat.completed_event_ids)}" if stat.completed_event_ids else "",
        )


async def stream(options: ClientOptions) -> ClientResult:
    """Run one session to session.done; raise ClientError if it ends any other way."""
    run = _Run(options)
    async with aiohttp.ClientSession() as http, http.ws_connect(options.url, max_msg_size=0) as ws:
        run.t_start = time.monotonic()
        await ws.send_str(json.dumps(run.start_message()))
        ticker = asyncio.create_task(_ticker(run, ws))
        try:
            async for msg in ws:
                if msg.type == aiohttp.WSMsgType.TEXT:
                    run.on_text(json.loads(msg.data))
                elif msg.type == aiohttp.WSMsgType.BINARY:
                    run.on_binary(msg.data)
                if run.result.done is not None:
                    break
                await run.tick(ws)
        finally:
            ticker.cancel()
            await asyncio.gather(ticker, return_exceptions=True)
    run.result.wall_seconds = time.monotonic() - run.t_start
    if run.result.done is None:
        errors = ", ".join(f"{e.get('code')}: {e.get('message')}" for e in run.result.errors)
        raise ClientError(f"connection closed before session.done ({errors or 'no error message'})")
    return run.result


async def _ticker(run: _Run, ws: aiohttp.ClientWebSocketResponse) -> None:
    """Keep the session alive with pings and fire wall-clock updates between frames."""
    last_ping = time.monotonic()
    while not ws.closed and run.result.done is None:
        await asyncio.sleep(0.05)
        await run.tick(ws)
        if time.monotonic() - last_ping >= run.options.ping_interval_s:
            last_ping = time.monotonic()
            await ws.send_str(json.dumps({"type": "session.ping"}))


def remux_to_progressive(src: Path, dst: Path) -> None:
    """Copy the streams of a fragmented MP4 into a progressive MP4 (no re-encode)."""
    import av  # only needed for --remux

    with av.open(str(src)) as inp, av.open(str(dst), "w", format="mp4") as out:
        mapping = {s.index: out.add_stream_from_template(s) for s in inp.streams if s.type in ("video", "audio")}
        for packet in inp.demux(*[s for s in inp.streams if s.index in mapping]):
            if packet.dts is None:
                continue
            packet.stream = mapping[packet.stream.index]
            out.mux(packet)


def write_output(result: ClientResult, out: Path, remux: bool) -> None:
    """Write the received fMP4 (or its progressive remux) to `out`."""
    out.parent.mkdir(parents=True, exist_ok=True)
    if not remux:
        out.write_bytes(bytes(result.data))
        return
    fragmented = out.with_name(out.name + ".fmp4")
    fragmented.write_bytes(bytes(result.data))
    try:
        remux_to_progressive(fragmented, out)
    finally:
        fragmented.unlink(missing_ok=True)


def _summary(result: ClientResult) -> str:
    media = [c for c in result.chunks if c.kind == "media"]
    intervals = [c.interval_s for c in media[1:]]
    mean = sum(intervals) / len(intervals) if intervals else 0.0
    rtf = result.wall_seconds / result.media_seconds if result.media_seconds else float("inf")
    ttfc = result.time_to_first_chunk_s
    return (f"{len(media)} media chunks, {result.media_seconds:.2f} s of media in {result.wall_seconds:.2f} s "
            f"(real-time factor {rtf:.2f}), first chunk after {ttfc if ttfc is not None else float('nan'):.2f} s, "
            f"mean chunk interval {mean * 1000:.0f} ms, {len(result.data)} bytes")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m services.client", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n")[-1])
    p.add_argument("--url", default="ws://127.0.0.1:8000/v1/realtime/video")
    p.add_argument("--prompt", required=True)
    p.add_argument("--seconds", type=float, default=20.0, help="stop after this many seconds (see --clock)")
    p.add_argument("--update", action="append", default=[], metavar='T:"PROMPT"',
                   help='prompt update at T seconds, e.g. 10s:"a storm rolls in" (repeatable)')
    p.add_argument("--out", type=Path, default=None, help="write the stream here (MP4)")
    p.add_argument("--remux", action="store_true", help="write a progressive MP4 instead of the fMP4 stream")
    p.add_argument("--seed", type=int)
    p.add_argument("--width", type=int)
    p.add_argument("--height", type=int)
    p.add_argument("--model")
    p.add_argument("--hold", action="store_true",
                   help="hold each 5 s request until a new prompt arrives. With --clock media and no "
                        "--hold-max-seconds, a held server gets the next --update at once, and once none is left "
                        "the client stops with the media it has (see --hold-idle-seconds)")
    p.add_argument("--hold-max-seconds", type=float,
                   help="longest hold; then the server continues with the previous (or fallback) prompt "
                        "(0 or unset: no limit)")
    p.add_argument("--hold-idle-seconds", type=float, default=10.0,
                   help="with an unbounded --hold and --clock media: this long without media, while the server "
                        "has every sent update, means it holds for a prompt (default 10)")
    p.add_argument("--pace", action="store_true", help="ask the server to send chunks at media speed")
    p.add_argument("--clock", choices=("media", "wall"), default="media")
    p.add_argument("--ping-interval", type=float, default=10.0)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    try:
        options = ClientOptions(
            url=args.url, prompt=args.prompt, seconds=args.seconds,
            updates=tuple(parse_update(u) for u in args.update), out=args.out, seed=args.seed,
            width=args.width, height=args.height, model=args.model, hold=args.hold,
            hold_max_seconds=args.hold_max_seconds, pace=args.pace, clock=args.clock,
            ping_interval_s=args.ping_interval, remux=args.remux, hold_idle_s=args.hold_idle_seconds,
        )
    except ValueError as exc:
        parser.error(str(exc))
    try:
        result = asyncio.run(stream(options))
    except (ClientError, aiohttp.ClientError, OSError) as exc:
        logger.error("session failed: %s", exc)
        return 1
    logger.info("%s", _summary(result))
    if result.stop_reason is not None:
        logger.warning("ended early: %s", result.stop_reason)
    missing = [eid for eid in result.sent_updates if eid not in result.applied_at]
    if missing:
        logger.info("updates not applied before the end: %s", missing)
    if options.out is not None:
        write_output(result, options.out, options.remux)
        logger.info("wrote %s", options.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
