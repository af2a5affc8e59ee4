"""Broadcast scale benchmark: `python -m tools.broadcast_bench [--viewers 0 50 200] [--hls-pollers 50]`.

Brings the four services up on a copy of the tiny CPU profile, then runs the same session (`--requests` 5 s
requests, paced to media time as a live broadcast is) once per entry of `--viewers`, with that many websocket
viewers on its watch URL, and once more with `--hls-pollers` LL-HLS readers of its playlist (skipped, with a
message, when the gateway serves no HLS routes). Each viewer connects as soon as the director has `video.start` and
reads everything (a raw socket that counts bytes and notes when each chunk's metadata arrives: the load of the
clients on this machine stays small); an HLS reader fetches the playlist with blocking reloads and every part it
lists. The viewers run in a process of their own, so their load never delays the director's client. Prints per
run: the director's media-chunk intervals and their ratio to the 0-viewer run, how much later than in that run its
chunks came, the viewers' lag behind the director, the gateway's CPU and peak memory (from /proc) and their
increase per viewer, and the bytes the gateway sent to viewers (its metrics).

Knows only the profile format, `services.up`, the websocket protocol, HLS playlists and the gateway's /metrics.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import json
import logging
import multiprocessing
import os
import pathlib
import re
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from urllib.parse import urljoin

import aiohttp
import numpy as np
import yaml

from tools.bench_tiny import ROOT, bring_up_logged, write_profile
from tools.soak import metric_total

log = logging.getLogger("broadcast_bench")

PROMPT = "a lighthouse on a cliff, waves breaking below"
FPS = 24
FIRST_REQUEST_FRAMES = 124
LATER_REQUEST_FRAMES = 119
CLOCK_TICK = os.sysconf("SC_CLK_TCK")
_INDEX = re.compile(rb'"transport_chunk_index": (\d+)')
_DONE = b'"type": "session.done"'


def gateway_cpu_s(pid: int) -> float:
    """User + system CPU seconds of `pid` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICK


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


class RawViewer(asyncio.Protocol):
    """A watch-websocket client that parses nothing but the handshake: it counts bytes, notes the arrival time of
    each chunk's metadata (by its transport index) and stops at `session.done`."""

    def __init__(self, path: str, host: str) -> None:
        self._request = (f"GET {path} HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                         f"Sec-WebSocket-Key: {base64.b64encode(os.urandom(16)).decode()}\r\n"
                         "Sec-WebSocket-Version: 13\r\n\r\n").encode()
        self._head = b""
        self._upgraded = False
        self._tail = b""
        self.received = 0
        self.arrivals: dict[int, float] = {}
        self.done = asyncio.get_running_loop().create_future()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        transport.write(self._request)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        if not self._upgraded:
            self._head += data
            if b"\r\n\r\n" not in self._head:
                return
            head, data = self._head.split(b"\r\n\r\n", 1)
            if not head.startswith(b"HTTP/1.1 101"):
                self._finish(f"refused: {head.splitlines()[0].decode(errors='replace')}")
                return
            self._upgraded = True
        now = time.monotonic()
        self.received += len(data)
        window = self._tail + data
        for match in _INDEX.finditer(window):
            self.arrivals.setdefault(int(match.group(1)), now)
        if _DONE in window:
            self._finish("done")
        self._tail = window[-48:]

    def connection_lost(self, exc: Exception | None) -> None:
        self._finish("closed before session.done")

    def _finish(self, how: str) -> None:
        if not self.done.done():
            self.done.set_result(how)
        if self.transport is not None and how != "closed before session.done":
            self.transport.close()


@dataclass
class HlsReader:
    """What one LL-HLS reader fetched."""

    received: int = 0
    parts: int = 0
    segments: int = 0
    """Whole segments fetched at the end: an ended playlist lists segments only, so the parts of the last
    segment that arrived after the reader's last blocking reload come as their segment."""
    playlists: int = 0
    arrivals: dict[str, float] = field(default_factory=dict)
    how: str = ""


@dataclass
class Playlist:
    """What a reader needs of one media playlist."""

    parts: list[str]
    """Part URIs, in order."""
    map_uri: str | None
    ended: bool
    following: tuple[int, int]
    """(msn, part) of the next part, for the blocking reload."""
    part_msn: dict[str, int]
    """The media sequence number of the segment each listed part belongs to."""
    segments: dict[int, str]
    """The URI of each whole segment listed, by media sequence number."""


def parse_playlist(text: str) -> Playlist:
    """Read a media playlist's parts, map, end, segments and the next part to ask for."""
    msn, part_in_segment, map_uri, ended = 0, 0, None, False
    parts: list[str] = []
    part_msn: dict[str, int] = {}
    segments: dict[int, str] = {}
    for line in text.splitlines():
        if line.startswith("#EXT-X-MEDIA-SEQUENCE:"):
            msn = int(line.split(":", 1)[1])
        elif line.startswith("#EXT-X-MAP:"):
            map_uri = re.search(r'URI="([^"]+)"', line).group(1)
        elif line.startswith("#EXT-X-PART:"):
            uri = re.search(r'URI="([^"]+)"', line).group(1)
            parts.append(uri)
            part_msn[uri] = msn
            part_in_segment += 1
        elif line.startswith("#EXT-X-ENDLIST"):
            ended = True
        elif line and not line.startswith("#"):  # a whole segment's URI: the segment is complete
            segments[msn] = line
            msn, part_in_segment = msn + 1, 0
    return Playlist(parts, map_uri, ended, (msn, part_in_segment), part_msn, segments)


async def read_hls(http: aiohttp.ClientSession, url: str, timeout_s: float) -> HlsReader:
    """Follow the playlist with blocking reloads to its end, fetching the init segment and every listed part, then
    each whole segment of the ended list whose parts it did not all get."""
    out = HlsReader()
    fetched: set[str] = set()
    part_bytes: dict[int, int] = {}  # bytes of the parts fetched, by segment
    deadline = time.monotonic() + timeout_s
    params: dict[str, str] = {}
    while time.monotonic() < deadline:
        async with http.get(url, params=params) as reply:
            if reply.status != 200:
                params = {}
                await asyncio.sleep(0.2)
                continue
            text = await reply.text()
        out.playlists += 1
        playlist = parse_playlist(text)
        for uri in ([playlist.map_uri] if playlist.map_uri else []) + playlist.parts:
            if uri in fetched:
                continue
            fetched.add(uri)
            async with http.get(urljoin(url, uri)) as reply:
                body = await reply.read()
            out.received += len(body)
            if uri != playlist.map_uri:
                out.parts += 1
                out.arrivals[uri] = time.monotonic()
                msn = playlist.part_msn[uri]
                part_bytes[msn] = part_bytes.get(msn, 0) + len(body)
        if playlist.ended:
            for msn, uri in playlist.segments.items():
                async with http.head(urljoin(url, uri)) as reply:
                    whole = int(reply.headers.get("Content-Length", "0"))
                if part_bytes.get(msn, 0) < whole:
                    async with http.get(urljoin(url, uri)) as reply:
                        body = await reply.read()
                    out.received += len(body) - part_bytes.get(msn, 0)  # what the parts did not bring
                    out.segments += 1  # a catch-up after the end: no arrival of a live chunk
            out.how = "done"
            return out
        following = playlist.following
        params = {"_HLS_msn": str(following[0]), "_HLS_part": str(following[1])}
    out.how = "timeout"
    return out


@dataclass
class Run:
    """One session with its viewers."""

    label: str
    viewers: int
    director_arrivals: list[float]
    """Arrival time of each media chunk at the director, from session.start."""
    director_index_at: dict[int, float]
    """Arrival time (monotonic) of each chunk, by transport index."""
    cpu_s: float
    wall_s: float
    rss_peak_mib: float
    rss_before_mib: float
    viewer_bytes: float
    director_bytes: int
    ended: dict[str, int]
    lags_s: list[float]
    dropped: float
    client_cpu_s: float
    """CPU seconds of the viewers' process over the session."""

    @property
    def intervals(self) -> np.ndarray:
        return np.diff(np.array(self.director_arrivals))


@dataclass
class Watched:
    """What one viewer (websocket or HLS) got."""

    how: str
    received: int
    arrivals: dict[int, float]
    """Monotonic time (a clock all processes share) at which each chunk, by transport index, reached it."""


async def watch_all(port: int, watch_path: str, viewers: int, hls_path: str, hls_readers: int,
                    timeout_s: float) -> list[Watched]:
    """Connect `viewers` raw websocket viewers and start `hls_readers` HLS readers; wait for all of them."""
    loop, host = asyncio.get_running_loop(), f"127.0.0.1:{port}"
    raw: list[RawViewer] = []
    for _ in range(viewers):
        _, viewer = await loop.create_connection(lambda: RawViewer(watch_path, host), "127.0.0.1", port)
        raw.append(viewer)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        readers = [read_hls(http, f"http://{host}{hls_path}", timeout_s) for _ in range(hls_readers)]
        hls = await asyncio.wait_for(asyncio.gather(*readers), timeout_s) if readers else []
        ends = await asyncio.wait_for(asyncio.gather(*(v.done for v in raw)), timeout_s) if raw else []
    out = [Watched(how, v.received, v.arrivals) for how, v in zip(ends, raw)]
    for reader in hls:  # a part's URI names its transport index (`part/<index>.m4s`)
        arrivals = {int(m.group(1)): at for uri, at in reader.arrivals.items()
                    if (m := re.search(r"part/(\d+)\.m4s", uri))}
        out.append(Watched(reader.how, reader.received, arrivals))
    return out


def viewer_process(conn, port: int, timeout_s: float) -> None:
    """The viewers' own process (so their load never delays the director's client): one job per session."""
    while (job := conn.recv()) is not None:
        started = time.process_time()
        watched = asyncio.run(watch_all(port, *job, timeout_s))
        conn.send((watched, time.process_time() - started))


async def run_session(port: int, pid: int, viewers_conn, num_frames: int, viewers: int, hls_readers: int,
                      timeout_s: float, label: str) -> Run:
    """One paced session; `viewers` websocket viewers or `hls_readers` HLS readers join at its video.start."""
    http_url, host = f"http://127.0.0.1:{port}", f"127.0.0.1:{port}"
    bytes_before = metric_total(http_url + "/metrics", "vitascope_viewer_bytes_total")
    dropped_before = metric_total(http_url + "/metrics", "vitascope_viewers_dropped_total")
    rss_before = rss_mib(pid)
    loop = asyncio.get_running_loop()
    peak = [rss_before]
    sampling = True

    async def sample_rss() -> None:
        while sampling:
            peak[0] = max(peak[0], rss_mib(pid))
            await asyncio.sleep(0.2)

    sampler = asyncio.ensure_future(sample_rss())
    arrivals: list[float] = []
    index_at: dict[int, float] = {}
    director_bytes = 0
    watching = viewers or hls_readers
    async with aiohttp.ClientSession() as http:
        async with http.ws_connect(f"ws://{host}/v1/realtime/video", max_msg_size=0, compress=0) as ws:
            cpu0, t0 = gateway_cpu_s(pid), time.monotonic()
            await ws.send_str(json.dumps({"type": "session.start", "prompt": PROMPT, "seed": 7,
                                          "num_frames": num_frames,
                                          "extra_params": {"pace_to_media_time": True}}))
            async for msg in ws:
                if msg.type == aiohttp.WSMsgType.BINARY:
                    director_bytes += len(msg.data)
                    continue
                if msg.type != aiohttp.WSMsgType.TEXT:
                    break
                body = json.loads(msg.data)
                if body["type"] == "video.start" and watching:
                    viewers_conn.send((body["watch_url"], viewers, body["hls_url"], hls_readers))
                elif body["type"] == "video.chunk_metadata":
                    index_at[body["transport_chunk_index"]] = time.monotonic()
                    if body["kind"] == "media":
                        arrivals.append(time.monotonic() - t0)
                elif body["type"] in ("session.done", "error"):
                    if body["type"] == "error":
                        raise RuntimeError(f"the director got an error: {body}")
                    break
            cpu1, t1 = gateway_cpu_s(pid), time.monotonic()
    watched, client_cpu = (await asyncio.wait_for(loop.run_in_executor(None, viewers_conn.recv), timeout_s)
                           if watching else ([], 0.0))
    sampling = False
    await sampler
    lags = [at - index_at[i] for w in watched for i, at in w.arrivals.items() if i in index_at]
    ended: dict[str, int] = {}
    for w in watched:
        ended[w.how] = ended.get(w.how, 0) + 1
    viewer_bytes = metric_total(http_url + "/metrics", "vitascope_viewer_bytes_total") - bytes_before
    if hls_readers:
        viewer_bytes = float(sum(w.received for w in watched))  # HLS answers are not in the websocket counters
    return Run(label=label, viewers=watching, director_arrivals=arrivals, director_index_at=index_at,
               cpu_s=cpu1 - cpu0, wall_s=t1 - t0, rss_peak_mib=peak[0], rss_before_mib=rss_before,
               viewer_bytes=viewer_bytes, director_bytes=director_bytes, ended=ended, lags_s=lags,
               dropped=metric_total(http_url + "/metrics", "vitascope_viewers_dropped_total") - dropped_before,
               client_cpu_s=client_cpu)


def hls_served(port: int) -> bool:
    """True when the gateway has the HLS routes: an unknown session's playlist is then a named 404."""
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/realtime/video/hls/none/playlist.m3u8", timeout=5)
    except urllib.error.HTTPError as exc:
        body = exc.read()
        return exc.code != 404 or body.startswith(b"{")
    return True


def report(runs: list[Run], base: Run, args, loads: tuple) -> str:
    lines = [
        f"command: {' '.join([os.path.relpath(sys.executable, ROOT), '-m', 'tools.broadcast_bench', *sys.argv[1:]])}",
        f"machine: {os.cpu_count()} CPUs; load average before {'/'.join(f'{x:.2f}' for x in loads[0])}, "
        f"after {'/'.join(f'{x:.2f}' for x in loads[1])} (1/5/15 min)",
        f"session: {args.requests} requests paced to media time, {len(base.director_arrivals)} media chunks, "
        f"{base.director_bytes / 1e6:.1f} MB to the director, tiny preset 320x192",
        "",
        f"{'run':<10} {'interval mean/p95/max s':>24} {'ratio':>6} {'first':>6} {'later':>7}{'':4} "
        f"{'lag p50/p95 s':>17} "
        f"{'CPU %':>6} {'per viewer':>10} {'RSS MiB':>8} {'per viewer':>11} {'to viewers MB':>14} "
        f"{'each':>6} {'clients %':>9}  ended",
    ]
    for run in runs:
        iv = run.intervals
        first, first_base = run.director_arrivals[0], base.director_arrivals[0]
        late = [(a - first) - (b - first_base) for a, b in zip(run.director_arrivals, base.director_arrivals)]
        worst = int(np.argmax(late))
        cpu_pct = 100 * run.cpu_s / run.wall_s
        extra_cpu = (cpu_pct - 100 * base.cpu_s / base.wall_s) / run.viewers if run.viewers else 0.0
        extra_rss = (run.rss_peak_mib - base.rss_peak_mib) * 1024 / run.viewers if run.viewers else 0.0
        lag = (f"{np.percentile(run.lags_s, 50):.3f}/{np.percentile(run.lags_s, 95):.3f}" if run.lags_s else "-")
        ended = ", ".join(f"{n} {how}" for how, n in sorted(run.ended.items())) or "-"
        if run.dropped:
            ended += f" ({run.dropped:.0f} dropped)"
        lines.append(
            f"{run.label:<10} {iv.mean():>8.3f}/{np.percentile(iv, 95):.3f}/{iv.max():.3f}  "
            f"{iv.mean() / base.intervals.mean():>6.3f} {first:>6.3f} {late[worst]:>+7.3f}{f'@{worst}':<4} {lag:>17} {cpu_pct:>6.1f} "
            f"{extra_cpu:>9.3f}% {run.rss_peak_mib:>8.1f} {extra_rss:>7.0f} KiB {run.viewer_bytes / 1e6:>14.1f} "
            f"{(run.viewer_bytes / run.viewers / 1e6 if run.viewers else 0):>6.2f} "
            f"{100 * run.client_cpu_s / run.wall_s:>9.1f}  {ended}")
    lines += ["", "interval: between the director's media chunks; ratio: mean against the 0-viewer run; first: "
              "session.start to the first media chunk (s); later: the most any chunk reached the director later, "
              "counted from its first chunk, than in the 0-viewer run (s), @ which media chunk; lag: a chunk's "
              "metadata at a viewer after it reached the director; CPU %: the gateway's, one core = 100, over the "
              "session; per viewer: above the 0-viewer run, divided by the viewers; RSS: the gateway's peak; "
              "clients %: the viewers' process's CPU over the session (the director's client runs in a process of its own)"]
    return "\n".join(lines)


async def bench(args, port: int, pid: int, viewers_conn, timeout_s: float) -> list[Run]:
    requests_frames = FIRST_REQUEST_FRAMES + LATER_REQUEST_FRAMES * (args.requests - 1)
    await run_session(port, pid, viewers_conn, FIRST_REQUEST_FRAMES, 0, 0, timeout_s, "warm-up")
    runs = []
    for n in args.viewers:
        runs.append(await run_session(port, pid, viewers_conn, requests_frames, n, 0, timeout_s, f"{n} ws"))
        print(f"  {runs[-1].label}: done", file=sys.stderr, flush=True)
    if args.hls_pollers:
        if hls_served(port):
            runs.append(await run_session(port, pid, viewers_conn, requests_frames, 0, args.hls_pollers,
                                          timeout_s, f"{args.hls_pollers} hls"))
        else:
            print(f"skipping the {args.hls_pollers} HLS readers: this gateway serves no "
                  "/v1/realtime/video/hls/{id}/playlist.m3u8", flush=True)
    return runs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--viewers", type=int, nargs="+", default=[0, 50, 200],
                        help="websocket viewers per run; the first must be 0 (the baseline)")
    parser.add_argument("--hls-pollers", type=int, default=50, help="LL-HLS readers of the last run (0: none)")
    parser.add_argument("--requests", type=int, default=3, help="5-second requests in each session")
    parser.add_argument("--profile", type=pathlib.Path, default=ROOT / "configs" / "tiny_cpu.yaml")
    parser.add_argument("--service-log", type=pathlib.Path, default=pathlib.Path(tempfile.gettempdir())
                        / "broadcast_bench_services.log", help="where the services' output goes")
    args = parser.parse_args()
    if args.viewers[0] != 0:
        parser.error("--viewers must start with 0: the other runs are compared with it")
    if args.requests < 1:
        parser.error(f"--requests={args.requests}: need at least 1")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    loads = [os.getloadavg()]
    with tempfile.TemporaryDirectory(prefix="broadcast_bench_") as tmp:
        profile, port = write_profile(args.profile, pathlib.Path(tmp))
        raw = yaml.safe_load(profile.read_text())
        # every client comes from 127.0.0.1 here; the raw viewers answer no websocket ping
        raw["gateway"].update(auth={"max_connections_per_address": 4096}, heartbeat_s=600.0,
                              broadcast={"max_viewers": max([*args.viewers, args.hls_pollers, 1])})
        profile.write_text(yaml.safe_dump(raw))
        timeout_s = 60.0 + 10.0 * args.requests
        context = multiprocessing.get_context("spawn")
        viewers_conn, child_conn = context.Pipe()
        viewers = context.Process(target=viewer_process, args=(child_conn, port, timeout_s), daemon=True)
        viewers.start()
        supervisor = bring_up_logged(profile, str(args.service_log))
        try:
            runs = asyncio.run(bench(args, port, supervisor.process("gateway").pid, viewers_conn, timeout_s))
        finally:
            supervisor.stop_all()
            viewers_conn.send(None)
            viewers.join(10)
    loads.append(os.getloadavg())
    print(report(runs, runs[0], args, tuple(loads)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
