"""What the gateway needs from the generation backend: a protocol-neutral ABC plus its dataclasses.

Knows nothing about websockets, JSON or gRPC. The gRPC-backed implementation lives in
`grpc_pipeline.py`; tests use a fake that produces real fragmented MP4.

Contract:
- `Pipeline.start(request)` admits one validated session and returns a `PipelineSession`. It may
  raise `InvalidRequest` (bad values the gateway could not judge), `BackendBusy`, `BackendUnavailable` or
  `BackendFailed`: each a `PipelineError` on one side of the `VitascopeError` hierarchy, so its `fault`
  (client or server) goes out with its `code`.
- `PipelineSession.chunks()` yields `MediaChunk`s in order, exactly once per session. The first
  media chunk's `data` starts with the fMP4 init segment. The iterator ends after the last chunk,
  or soon after `cancel()` (a `kind="trailer"` chunk holding the muxer's closing bytes may come
  last). Errors raised from it end the session.
- `update_prompt(event_id, prompt)` queues a prompt change; it returns once the backend accepted
  it for a later chunk boundary. The event id then shows up in the chunks' event-id lists.
- `cancel()` is idempotent and safe to call at any time, including after the iterator ended.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from services.common.errors import ClientError, ServerError, VitascopeError


class PipelineError(VitascopeError):
    """A backend error; `code` is the wire error code sent to the client, `fault` whose fault it was.

    The common base of the kinds below, which each derive from `ClientError` or `ServerError` as well; raise
    one of them (a bare PipelineError counts as a server fault).
    """

    code = "internal_error"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code

    @property
    def message(self) -> str:
        return str(self)


class InvalidRequest(PipelineError, ClientError):
    """The backend rejected the request or an interaction because of its content."""

    code = "invalid_request"


class BackendBusy(PipelineError, ClientError):
    """Every slot of the backend is taken (its RESOURCE_EXHAUSTED); the client may retry later."""

    code = "backend_busy"


class BackendUnavailable(PipelineError, ServerError):
    """A backend stage cannot be reached or is not serving."""

    code = "backend_unavailable"


class BackendFailed(PipelineError, ServerError):
    """A backend stage failed while serving the session (an INTERNAL status, a broken stream, a process that
    died); the message names the stage."""

    code = "backend_failed"


@dataclass(frozen=True)
class HoldSettings:
    """Hold-for-prompt behaviour: request k >= 1 waits for a prompt newer than the last applied."""

    enabled: bool = False
    """Wait for a new prompt at each 5-second request boundary (request 0 never waits)."""

    max_seconds: float = 0.0
    """Longest wait; 0 means wait forever (clients keep the session alive with `session.ping`)."""

    fallback_prompt: str | None = None
    """Prompt used when a finite hold expires (None: keep the previous prompt)."""

    def __post_init__(self) -> None:
        if self.max_seconds < 0:
            raise ValueError(f"HoldSettings.max_seconds={self.max_seconds} must be >= 0 (0 = no limit)")


@dataclass(frozen=True)
class SessionRequest:
    """A validated session start, as the backend receives it."""

    request_id: str
    """Gateway-assigned id (`video_stream-<uuid>`), used in logs and for cancellation."""

    prompt: str
    """First prompt (non-empty)."""

    seed: int
    """Noise seed."""

    width: int
    """Canvas width in pixels (one of the deployment's allowed canvases)."""

    height: int
    """Canvas height in pixels."""

    fps: int
    """Output frame rate."""

    hold: HoldSettings = field(default_factory=HoldSettings)
    """Hold-for-prompt settings."""

    extra: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    """Remaining `extra_params` entries the gateway did not interpret, passed through untouched."""

    max_requests: int = 0
    """The frame budget in whole 5 s requests (0: until stopped): the backend generates and delivers nothing past
    the last phase of request `max_requests - 1`."""

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ValueError("SessionRequest.prompt is empty")
        if self.max_requests < 0:
            raise ValueError(f"SessionRequest.max_requests={self.max_requests} must be >= 0 (0: no budget)")
        if self.width <= 0 or self.height <= 0 or self.fps <= 0:
            raise ValueError(
                f"SessionRequest canvas/fps must be positive, got {self.width}x{self.height}@{self.fps}"
            )
        object.__setattr__(self, "extra", MappingProxyType(dict(self.extra)))


@dataclass(frozen=True)
class StageTimings:
    """Seconds each backend stage spent on one chunk (0 where a stage did not report)."""

    text: float = 0.0
    """Prompt encoding (only on chunks where a new prompt was encoded)."""

    dit: float = 0.0
    """DiT denoise + commit for the phase."""

    vae: float = 0.0
    """Video + audio decode."""

    mux: float = 0.0
    """fMP4 muxing."""

    def as_dict(self) -> dict[str, float]:
        return {"text": self.text, "dit": self.dit, "vae": self.vae, "mux": self.mux}


@dataclass(frozen=True)
class MediaChunk:
    """One fMP4 fragment (or the muxer's trailer) with the metadata of the phase it holds (all of it, or a part)."""

    data: bytes
    """fMP4 bytes: init segment + first fragment on the first chunk, one moof+mdat group after."""

    request_index: int
    """5-second request the phase belongs to (0-based)."""

    phase_index: int
    """Phase within the request (0-based)."""

    num_frames: int
    """Video frames in this fragment."""

    num_audio_samples: int
    """Audio samples per channel in this fragment."""

    audio_sample_rate: int = 32000
    """Audio sample rate in Hz."""

    started_event_ids: tuple[str, ...] = ()
    """Prompt events that started influencing generation at this chunk."""

    active_event_ids: tuple[str, ...] = ()
    """Prompt events in effect for this chunk."""

    completed_event_ids: tuple[str, ...] = ()
    """Prompt events installed at this chunk boundary (the ack a client waits for)."""

    timings: StageTimings = field(default_factory=StageTimings)
    """Per-stage seconds for this chunk."""

    kind: Literal["media", "trailer"] = "media"
    """`trailer` carries only the muxer's closing bytes (no frames)."""

    phase_continues: bool = False
    """More chunks of this phase follow (a session's first phase goes out as its first 5 frames, the rest of its
    first clip, then the rest); its event ids ride on the phase's first chunk."""

    def __post_init__(self) -> None:
        if not self.data:
            raise ValueError("MediaChunk.data is empty; every chunk must carry fMP4 bytes")
        if self.kind not in ("media", "trailer"):
            raise ValueError(f"MediaChunk.kind={self.kind!r} must be 'media' or 'trailer'")
        if min(self.request_index, self.phase_index, self.num_frames, self.num_audio_samples) < 0:
            raise ValueError(
                "MediaChunk indexes and counts must be >= 0, got request_index="
                f"{self.request_index}, phase_index={self.phase_index}, num_frames={self.num_frames}, "
                f"num_audio_samples={self.num_audio_samples}"
            )
        if self.audio_sample_rate <= 0:
            raise ValueError(f"MediaChunk.audio_sample_rate={self.audio_sample_rate} must be > 0")
        for name in ("started_event_ids", "active_event_ids", "completed_event_ids"):
            object.__setattr__(self, name, tuple(getattr(self, name)))


class PipelineSession(ABC):
    """One running generation session in the backend."""

    @abstractmethod
    def chunks(self) -> AsyncIterator[MediaChunk]:
        """Yield the session's chunks in order; end after the last one or after cancel()."""

    @abstractmethod
    async def update_prompt(self, event_id: str, prompt: str) -> None:
        """Queue a prompt change, installed at a later chunk boundary."""

    @abstractmethod
    async def cancel(self) -> None:
        """Stop generating and release backend resources (idempotent)."""


class Pipeline(ABC):
    """The generation backend as the gateway sees it."""

    @abstractmethod
    async def start(self, request: SessionRequest) -> PipelineSession:
        """Start one session; raise a PipelineError subclass when it cannot start."""

    @abstractmethod
    async def health(self) -> bool:
        """Report whether every backend stage is serving."""

    def stages_down(self) -> list[str]:
        """The backend stages not serving now (none known: a backend that does not watch its stages)."""
        return []

    async def wait_ready(self, timeout_s: float) -> list[str]:
        """Wait up to `timeout_s` for every stage to serve; the stages still down (empty: ready)."""
        return self.stages_down()
