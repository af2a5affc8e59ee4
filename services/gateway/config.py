"""Gateway configuration: one frozen, validated dataclass.

Knows nothing about YAML, flags or environment variables: `__main__` reads those and builds a
`GatewayConfig`; everything below it receives the finished object.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from services.common.media import VIDEO_FPS

MiB = 1024 * 1024
KiB = 1024


@dataclass(frozen=True)
class GatewayConfig:
    """Settings of the realtime websocket gateway."""

    host: str = "127.0.0.1"
    """Address the HTTP server binds."""

    port: int = 8000
    """TCP port of HTTP, `/v1/realtime/video`, `/healthz` and `/metrics` (0 picks a free port)."""

    model: str = "TaoMate-H3"
    """Served model name; a `session.start` naming another model is rejected (`model_mismatch`)."""

    num_slots: int = 1
    """Sessions generating at once (one per DiT group)."""

    queue_limit: int = 8
    """Sessions allowed to wait for a slot; one more gets `queue_full`. 0 disables waiting."""

    start_timeout_s: float = 10.0
    """Seconds a new connection has to send `session.start`."""

    stall_timeout_s: float = 60.0
    """Seconds without a chunk and without `session.ping` before an active session is aborted."""

    send_timeout_s: float = 30.0
    """Seconds one outbound message may take to reach the socket; a client that reads nothing for that long
    (TCP backpressure) is dropped, so it cannot hold a slot or a queue place."""

    heartbeat_s: float = 20.0
    """Seconds between websocket pings; a peer that has not answered one within half of that is dropped (a dead
    network path, or a client that stopped reading while it waits in the queue and so is sent next to nothing)."""

    max_start_bytes: int = 4 * MiB
    """Largest accepted `session.start` text frame (UTF-8 bytes)."""

    max_interaction_bytes: int = 128 * KiB
    """Largest accepted text frame of any other message type."""

    max_frame_bytes: int = 8 * MiB
    """Transport hard limit: a larger frame closes the connection with code 1009 and no reply."""

    max_prompt_chars: int = 2000
    """Longest accepted prompt, in characters."""

    max_pending_updates: int = 16
    """Prompt updates a session may have waiting for the backend; one more gets `too_many_updates`.
    Only the newest pending update reaches generation at a request boundary, so more is never useful."""

    allowed_canvases: tuple[tuple[int, int], ...] = ((480, 864),)
    """Accepted (width, height) pairs; the canvas is fixed per deployment."""

    default_canvas: tuple[int, int] = (480, 864)
    """(width, height) used when `session.start` names neither."""

    fps: int = VIDEO_FPS
    """Frame rate of the served model; a `session.start` asking for another rate is rejected."""

    default_seed: int = 8301
    """Seed used when `session.start` carries none."""

    queue_poll_s: float = 1.0
    """Seconds between stall checks and queue-position refreshes."""

    drain_timeout_s: float = 5.0
    """Seconds to wait for the pipeline's last chunks after `session.stop` before giving up."""

    static_dir: str | None = field(default=None)
    """Directory served at `/` (None: the page shipped in `services/gateway/static`)."""

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("GatewayConfig.host is empty; use e.g. '127.0.0.1' or '0.0.0.0'")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"GatewayConfig.port={self.port} is outside 0..65535")
        if not self.model:
            raise ValueError("GatewayConfig.model is empty; set the served model name")
        if self.num_slots < 1:
            raise ValueError(f"GatewayConfig.num_slots={self.num_slots} must be >= 1")
        if self.queue_limit < 0:
            raise ValueError(f"GatewayConfig.queue_limit={self.queue_limit} must be >= 0")
        for name in ("start_timeout_s", "stall_timeout_s", "send_timeout_s", "heartbeat_s", "queue_poll_s",
                     "drain_timeout_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"GatewayConfig.{name}={value} must be > 0 seconds")
        if self.max_start_bytes < 1 or self.max_interaction_bytes < 1:
            raise ValueError(
                f"GatewayConfig message limits must be >= 1 byte, got max_start_bytes="
                f"{self.max_start_bytes}, max_interaction_bytes={self.max_interaction_bytes}"
            )
        if self.max_frame_bytes < max(self.max_start_bytes, self.max_interaction_bytes):
            raise ValueError(
                f"GatewayConfig.max_frame_bytes={self.max_frame_bytes} must be >= max_start_bytes "
                f"({self.max_start_bytes}) and max_interaction_bytes ({self.max_interaction_bytes})"
            )
        if self.max_pending_updates < 1:
            raise ValueError(f"GatewayConfig.max_pending_updates={self.max_pending_updates} must be >= 1")
        if self.max_prompt_chars < 1:
            raise ValueError(f"GatewayConfig.max_prompt_chars={self.max_prompt_chars} must be >= 1")
        if not self.allowed_canvases:
            raise ValueError("GatewayConfig.allowed_canvases is empty; list at least one (width, height)")
        for canvas in self.allowed_canvases:
            if len(canvas) != 2 or any(int(v) <= 0 or int(v) % 2 for v in canvas):
                raise ValueError(
                    f"GatewayConfig.allowed_canvases entry {canvas!r} must be a (width, height) of "
                    "positive even integers"
                )
        if tuple(self.default_canvas) not in {tuple(c) for c in self.allowed_canvases}:
            raise ValueError(
                f"GatewayConfig.default_canvas={self.default_canvas!r} is not in allowed_canvases "
                f"{self.allowed_canvases!r}"
            )
        if self.fps < 1:
            raise ValueError(f"GatewayConfig.fps={self.fps} must be >= 1")
