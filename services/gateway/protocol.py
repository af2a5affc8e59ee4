"""Wire protocol of `/v1/realtime/video` (vLLM-Omni compatible): message dataclasses and parsing.

Knows nothing about sockets, sessions or the backend: it turns one client text frame into one
frozen message dataclass (or raises `ProtocolError` with a named code) and turns server message
dataclasses into JSON-ready dicts.

Client -> server (JSON text frames):
  session.start        first message, within `start_timeout_s`, <= `max_start_bytes`
  session.interaction  {"interaction": {"event_id"?, "event": {"prompt"}, "transition_chunks"?}}
                       (an event id whose update got `interaction_failed` may be used again)
  session.stop         ends the session; the server answers `session.done{stopped: true}`
  session.ping         refreshes the stall clock; the server answers `session.pong`
Server -> client: video.start, video.chunk_metadata (+ exactly one binary fMP4 frame after it),
  session.interaction.queued, session.queued, session.pong, session.done, error; to viewers also
  video.init_segment (+ exactly one binary frame after it).
Additive to vLLM-Omni: `session.queued{position}`, `error.code` and `error.fault` on every error, and the chunk
metadata fields `request_index`, `phase_index`, `timings`. A chunk is one phase of generation, except a session's
first phase, which goes out as three chunks (its first 5 frames as soon as its first clip is decoded, that clip's
other 12, then the rest): all carry that phase's `generation_chunk_index` and indexes, while
`transport_chunk_index` counts every binary frame; the phase's started/completed event ids ride on its first chunk.
As in vLLM-Omni, `extra_params.pace_to_media_time` (+ `pacing_lead_seconds`, `pacing_max_lag_seconds`) makes the
gateway send each chunk no earlier than its media time; `extra_params.hold_for_prompt`
(+ `hold_max_seconds`, `hold_fallback_prompt`) is passed to the backend as `HoldSettings`.
session.start is read as vLLM-Omni reads its VideoGenerationRequest: a `sampling_params` object supplies request
fields absent at the top level, and its other keys go into `extra_params`; `video_params{width, height, fps,
num_frames}` fills fields absent at the top level, `size` ("WxH") wins over width/height, `seconds` sets num_frames
(at fps). `num_frames` is a frame budget, as for TaoMate-H3 in vLLM-Omni: the session streams the whole 5 s requests
that hold that many frames (124 in the first, 119 in each later one), then a trailer and `session.done{stopped:
false}`; without it the session runs until stopped. `num_inference_steps`, `guidance_scale` and `negative_prompt`
are type-checked and ignored, other unknown fields ignored. The trailer's `generation_chunk_index` is null.

Viewers (a broadcast): the client that sent `session.start` is the session's director; its `video.start` carries
`watch_url` (`/v1/realtime/video/watch/{request_id}`, a websocket) and `hls_url`
(`/v1/realtime/video/hls/{request_id}/playlist.m3u8`), both root-relative. A viewer on the watch websocket gets
`video.start` (the director's, plus `"role": "viewer"`), then `video.init_segment{byte_length}` + one binary frame
(the init segment, `ftyp` + `moov`), then the `video.chunk_metadata` + binary frame pairs the director got from the
newest media chunk on (every chunk opens with a keyframe; a chunk's `byte_length` is that of the viewer's frame, which
differs from the director's only on chunk 0, whose init segment the viewer got apart), then `session.done`
(`chunks`: the chunk frames this viewer was sent; `stopped` false only when the session completed its budget) when
the director's session ends, however it ends. A viewer may send `session.ping` (answered with `session.pong`); any
other message gets `not_director` and the connection stays open. A viewer that falls behind skips ahead to the newest
chunk, and is dropped with `viewer_too_slow` after `broadcast.viewer_max_skips` skips without catching up (or
without an `error` after `send_timeout_s` without reading, as any client). Watching an unknown session is HTTP 404
`unknown_session`; one that ended less than `broadcast.linger_s` ago answers `video.start`, then `session.done`.
With `gateway.auth` on the watch websocket takes a viewer or a director token.

Error codes, their faults and which close the connection: `services/gateway/errors.py`.
A frame above the transport limit `max_frame_bytes` closes the socket with code 1009 and no
`error` message (the websocket layer drops it before it can be read).
Close codes: 1000 after `session.done`; 1008 for a rejected start or start_timeout (1009 for
message_too_large, 1013 for queue_full and viewer_too_slow); 1011 when a running session fails (stall, backend).
`session.ping` is answered with `session.pong` before `session.start` too.
A client that reads nothing for `send_timeout_s` while the server has a message for it is dropped without
an `error` (the socket is aborted; it could not have been read) and its slot or queue place is freed. The server
pings every `heartbeat_s` (websocket ping frames, which browsers answer by themselves); a peer that has not answered
within half of that is dropped the same way.
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar, Union

from services.common.media import VIDEO_FPS
from services.gateway.errors import ErrorCode, ErrorMessage, ProtocolError
from services.gateway.pipeline import HoldSettings

FORMAT_M4S = "m4s"
MAX_EVENT_ID_CHARS = 256
WATCH_PATH = "/v1/realtime/video/watch/{session_id}"
"""A session's viewers' websocket (root-relative; `video.start.watch_url`)."""
HLS_PLAYLIST_PATH = "/v1/realtime/video/hls/{session_id}/playlist.m3u8"
"""A session's LL-HLS playlist (root-relative; `video.start.hls_url`)."""


def watch_path(session_id: str) -> str:
    """The root-relative watch websocket URL of `session_id`."""
    return WATCH_PATH.format(session_id=session_id)


def hls_path(session_id: str) -> str:
    """The root-relative LL-HLS playlist URL of `session_id`."""
    return HLS_PLAYLIST_PATH.format(session_id=session_id)


@dataclass(frozen=True)
class MessageLimits:
    """Size limits applied while parsing client frames."""

    max_start_bytes: int
    max_interaction_bytes: int
    max_prompt_chars: int


# ---------------------------------------------------------------- client -> server


@dataclass(frozen=True)
class PacingSettings:
    """Gateway-side pacing (`extra_params.pace_to_media_time`): send chunks at media speed."""

    lead_s: float = 0.5
    """Send each chunk this many seconds before its media time (`pacing_lead_seconds`)."""
    max_lag_s: float = 5.0
    """When sending falls this far behind media time, restart the clock instead of bursting
    (`pacing_max_lag_seconds`)."""


@dataclass(frozen=True)
class SessionStart:
    """`session.start`: the session's first prompt and settings (canvas checks happen later)."""

    TYPE: ClassVar[str] = "session.start"
    prompt: str
    model: str | None = None
    format: str = FORMAT_M4S
    width: int | None = None
    height: int | None = None
    fps: int | None = None
    seed: int | None = None
    num_frames: int | None = None
    """Frame budget: the session ends after the whole 5 s requests that hold this many frames (None: until
    stopped)."""
    hold: HoldSettings = field(default_factory=HoldSettings)
    pacing: PacingSettings | None = None
    """None: send chunks as soon as they are ready."""
    extra_params: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    """`extra_params` without the hold and pacing keys, passed to the backend untouched."""


@dataclass(frozen=True)
class SessionInteraction:
    """`session.interaction`: a live prompt update."""

    TYPE: ClassVar[str] = "session.interaction"
    prompt: str
    event_id: str | None = None
    """Client's id for the update (None: the server assigns one)."""
    transition_chunks: int | None = None
    """Accepted for compatibility; TaoMate switches prompts hard (0)."""


@dataclass(frozen=True)
class SessionStop:
    """`session.stop`: end the session."""

    TYPE: ClassVar[str] = "session.stop"


@dataclass(frozen=True)
class SessionPing:
    """`session.ping`: keep-alive."""

    TYPE: ClassVar[str] = "session.ping"


ClientMessage = Union[SessionStart, SessionInteraction, SessionStop, SessionPing]

_START_IGNORED = {"num_inference_steps": int, "guidance_scale": float, "negative_prompt": str}
# The fields of vLLM-Omni's VideoGenerationRequest: a `sampling_params` key outside them goes into extra_params.
_REQUEST_FIELDS = frozenset({
    "model", "prompt", "seconds", "size", "image_reference", "video_params", "user", "width", "height", "fps",
    "num_frames", "negative_prompt", "num_inference_steps", "guidance_scale", "guidance_scale_2", "boundary_ratio",
    "flow_shift", "true_cfg_scale", "seed", "generate_sound", "sound_duration", "enable_frame_interpolation",
    "frame_interpolation_exp", "frame_interpolation_scale", "frame_interpolation_model_path", "quality", "lora",
    "extra_params",
})
_START_UNSUPPORTED = ("image_reference", "lora")
_HOLD_KEYS = ("hold_for_prompt", "hold_max_seconds", "hold_fallback_prompt")
_PACING_KEYS = ("pace_to_media_time", "pacing_lead_seconds", "pacing_max_lag_seconds")


def _reject_non_json_constant(name: str) -> None:
    # Python's parser accepts NaN and ±Infinity, which are not JSON: echoed back in video.start they would
    # make the reply unreadable to a strict JSON parser (every browser's).
    raise ValueError(f"{name} is not a JSON value")


def _finite_float(literal: str) -> float:
    # A literal past a double's range (1e999) is valid JSON that Python reads as inf: echoed back it would be the
    # non-JSON Infinity, so it is rejected like the constants.
    value = float(literal)
    if not math.isfinite(value):
        raise ValueError(f"number {literal[:40]} is out of range for a double")
    return value


def parse_client_text(text: str, limits: MessageLimits) -> ClientMessage:
    """Parse one client text frame into a message dataclass or raise ProtocolError."""
    size = len(text.encode("utf-8"))
    if size > limits.max_start_bytes:
        raise ProtocolError(
            ErrorCode.MESSAGE_TOO_LARGE,
            f"message is {size} bytes; the limit is {limits.max_start_bytes} bytes for session.start",
        )
    try:
        body = json.loads(text, parse_constant=_reject_non_json_constant, parse_float=_finite_float)
    except (ValueError, RecursionError) as exc:  # ValueError: JSONDecodeError, or an over-long integer
        raise ProtocolError(ErrorCode.INVALID_JSON, f"text frame is not valid JSON ({exc})") from None
    if not isinstance(body, dict):
        raise ProtocolError(
            ErrorCode.INVALID_JSON, f"message must be a JSON object, got {type(body).__name__}"
        )
    kind = body.get("type")
    if kind is None:
        raise ProtocolError(ErrorCode.UNKNOWN_TYPE, "message has no 'type' field")
    if kind != SessionStart.TYPE and size > limits.max_interaction_bytes:
        raise ProtocolError(
            ErrorCode.MESSAGE_TOO_LARGE,
            f"{kind} message is {size} bytes; the limit is {limits.max_interaction_bytes} bytes",
        )
    if kind == SessionStart.TYPE:
        return _parse_start(body, limits)
    if kind == SessionInteraction.TYPE:
        return _parse_interaction(body, limits)
    if kind == SessionStop.TYPE:
        return SessionStop()
    if kind == SessionPing.TYPE:
        return SessionPing()
    raise ProtocolError(
        ErrorCode.UNKNOWN_TYPE,
        f"unknown message type {kind!r}; expected one of session.start, session.interaction, "
        "session.stop, session.ping",
    )


def _field(body: Mapping[str, Any], key: str, kind: type, where: str, *, required: bool = False):
    """Return body[key] checked against `kind` (None when optional and absent or null)."""
    if key not in body or body[key] is None:
        if required:
            raise ProtocolError(ErrorCode.MISSING_FIELD, f"{where}.{key} is required")
        return None
    value = body[key]
    ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and _finite(value)
    if not ok:
        raise ProtocolError(
            ErrorCode.INVALID_TYPE,
            f"{where}.{key} must be {_type_name(kind)}, got {type(value).__name__}",
        )
    return value


def _finite(value: int | float) -> bool:
    """True for a number a float can hold (JSON integers can be arbitrarily large)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _type_name(kind: type) -> str:
    return {str: "a string", int: "an integer", float: "a finite number", bool: "a boolean",
            dict: "an object"}.get(kind, kind.__name__)


def _check_unicode(text: str, where: str) -> str:
    """Reject lone surrogates (JSON `\\ud800` escapes): no stage can encode them as UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ProtocolError(
            ErrorCode.INVALID_VALUE, f"{where} is not valid Unicode (lone surrogate at index {exc.start})"
        ) from None
    return text


def _check_prompt(prompt: str, where: str, limits: MessageLimits) -> str:
    _check_unicode(prompt, where)
    if not prompt.strip():
        raise ProtocolError(ErrorCode.EMPTY_PROMPT, f"{where} is empty")
    if len(prompt) > limits.max_prompt_chars:
        raise ProtocolError(
            ErrorCode.PROMPT_TOO_LONG,
            f"{where} has {len(prompt)} characters; the limit is {limits.max_prompt_chars}",
        )
    return prompt


def _positive(value: int | None, where: str) -> int | None:
    if value is not None and value <= 0:
        raise ProtocolError(ErrorCode.INVALID_VALUE, f"{where}={value} must be > 0")
    return value


def _fold_sampling_params(body: dict[str, Any]) -> dict[str, Any]:
    """Fold `sampling_params` in as vLLM-Omni does: request fields not given at the top level move up, every other
    key goes into extra_params (over the top-level extra_params)."""
    sampling = _field(body, "sampling_params", dict, "session.start")
    merged = {k: v for k, v in body.items() if k != "sampling_params"}
    if not sampling:
        return merged
    extra = dict(_field(merged, "extra_params", dict, "session.start") or {})
    for key, value in sampling.items():
        if key in _REQUEST_FIELDS and key not in merged:
            merged[key] = value
        else:
            extra[key] = value
    if extra:
        merged["extra_params"] = extra
    return merged


def _parse_video_params(merged: Mapping[str, Any]) -> tuple[int | None, int | None, int | None, int | None]:
    """(width, height, fps, num_frames) resolved as VideoGenerationRequest does: top-level fields, then
    `video_params`; `size` ("WxH") wins over both; `seconds` counts frames at the requested fps."""
    where = "session.start"
    nested = _field(merged, "video_params", dict, where) or {}
    values = []
    for key in ("width", "height", "fps", "num_frames"):
        value = _positive(_field(merged, key, int, where), f"{where}.{key}")
        if value is None:
            value = _positive(_field(nested, key, int, f"{where}.video_params"), f"{where}.video_params.{key}")
        values.append(value)
    width, height, fps, num_frames = values
    size = _field(merged, "size", str, where)
    if size is not None:
        match = re.fullmatch(r"([1-9][0-9]{0,5})x([1-9][0-9]{0,5})", size)
        if match is None:
            raise ProtocolError(ErrorCode.INVALID_VALUE, f"{where}.size={size!r} must be 'WIDTHxHEIGHT'")
        width, height = int(match[1]), int(match[2])
    seconds = _field(merged, "seconds", str, where)
    if seconds is not None and re.fullmatch(r"[1-9][0-9]{0,5}", seconds) is None:
        raise ProtocolError(ErrorCode.INVALID_VALUE, f"{where}.seconds={seconds!r} must be a positive whole number")
    if num_frames is None and seconds is not None:
        num_frames = int(seconds) * (fps or VIDEO_FPS)
    return width, height, fps, num_frames


def _parse_start(body: dict[str, Any], limits: MessageLimits) -> SessionStart:
    merged = _fold_sampling_params(body)
    for key in _START_UNSUPPORTED:
        if merged.get(key) is not None:
            raise ProtocolError(ErrorCode.UNSUPPORTED_FIELD, f"session.start.{key} is not supported")
    for key, kind in _START_IGNORED.items():
        _field(merged, key, kind, "session.start")  # type-checked, then ignored
    prompt = _check_prompt(
        _field(merged, "prompt", str, "session.start", required=True), "session.start.prompt", limits
    )
    seed = _field(merged, "seed", int, "session.start")
    if seed is not None and not 0 <= seed < 2**63:
        raise ProtocolError(ErrorCode.INVALID_VALUE, f"session.start.seed={seed} must be in [0, 2**63)")
    fmt = _field(merged, "format", str, "session.start")
    if fmt is not None and fmt != FORMAT_M4S:
        raise ProtocolError(
            ErrorCode.UNSUPPORTED_FORMAT, f"session.start.format={fmt!r}; only 'm4s' is supported"
        )
    extra = dict(_field(merged, "extra_params", dict, "session.start") or {})
    hold = _parse_hold(extra, limits)
    pacing = _parse_pacing(extra)
    for key in _HOLD_KEYS + _PACING_KEYS:
        extra.pop(key, None)
    width, height, fps, num_frames = _parse_video_params(merged)
    return SessionStart(
        prompt=prompt,
        model=_field(merged, "model", str, "session.start"),
        format=FORMAT_M4S,
        width=width,
        height=height,
        fps=fps,
        seed=seed,
        num_frames=num_frames,
        hold=hold,
        pacing=pacing,
        extra_params=MappingProxyType(extra),
    )


def _parse_hold(extra: Mapping[str, Any], limits: MessageLimits) -> HoldSettings:
    where = "session.start.extra_params"
    enabled = _field(extra, "hold_for_prompt", bool, where)
    max_seconds = _field(extra, "hold_max_seconds", float, where)
    if max_seconds is not None and max_seconds < 0:
        raise ProtocolError(
            ErrorCode.INVALID_VALUE, f"{where}.hold_max_seconds={max_seconds} must be >= 0 (0 = no limit)"
        )
    fallback = _field(extra, "hold_fallback_prompt", str, where)
    if fallback is not None:
        _check_prompt(fallback, f"{where}.hold_fallback_prompt", limits)
    return HoldSettings(
        enabled=bool(enabled), max_seconds=float(max_seconds or 0.0), fallback_prompt=fallback
    )


def _parse_pacing(extra: Mapping[str, Any]) -> PacingSettings | None:
    where = "session.start.extra_params"
    enabled = _field(extra, "pace_to_media_time", bool, where)
    lead = _field(extra, "pacing_lead_seconds", float, where)
    max_lag = _field(extra, "pacing_max_lag_seconds", float, where)
    if lead is not None and lead < 0:
        raise ProtocolError(ErrorCode.INVALID_VALUE, f"{where}.pacing_lead_seconds={lead} must be >= 0")
    if max_lag is not None and max_lag <= 0:
        raise ProtocolError(ErrorCode.INVALID_VALUE, f"{where}.pacing_max_lag_seconds={max_lag} must be > 0")
    if not enabled:
        return None
    defaults = PacingSettings()
    return PacingSettings(
        lead_s=defaults.lead_s if lead is None else float(lead),
        max_lag_s=defaults.max_lag_s if max_lag is None else float(max_lag),
    )


def _parse_interaction(body: dict[str, Any], limits: MessageLimits) -> SessionInteraction:
    where = "session.interaction.interaction"
    interaction = _field(body, "interaction", dict, "session.interaction", required=True)
    event_id = _field(interaction, "event_id", str, where)
    if event_id is not None and not 0 < len(event_id) <= MAX_EVENT_ID_CHARS:
        raise ProtocolError(
            ErrorCode.INVALID_VALUE,
            f"{where}.event_id must have 1..{MAX_EVENT_ID_CHARS} characters, got {len(event_id)}",
        )
    if event_id is not None:
        _check_unicode(event_id, f"{where}.event_id")
    try:
        transition = interaction.get("transition_chunks")
        if isinstance(transition, float) and transition.is_integer():  # 2.0 is 2, as in vLLM-Omni
            transition = int(transition)
        transition = _field({"transition_chunks": transition}, "transition_chunks", int, where)
        if transition is not None and transition < 0:
            raise ProtocolError(
                ErrorCode.INVALID_VALUE, f"{where}.transition_chunks={transition} must be >= 0"
            )
        event = _field(interaction, "event", dict, where, required=True)
        for key in ("multi_modal_data", "negative_prompt"):
            if event.get(key) is not None:
                raise ProtocolError(ErrorCode.UNSUPPORTED_FIELD, f"{where}.event.{key} is not supported")
        prompt = _check_prompt(
            _field(event, "prompt", str, f"{where}.event", required=True), f"{where}.event.prompt", limits
        )
    except ProtocolError as exc:
        exc.event_id = event_id
        raise
    return SessionInteraction(prompt=prompt, event_id=event_id, transition_chunks=transition)


# ---------------------------------------------------------------- server -> client


@dataclass(frozen=True)
class VideoStart:
    """`video.start`: the session was accepted and is starting."""

    request_id: str
    config: Mapping[str, Any]
    format: str = FORMAT_M4S
    watch_url: str | None = None
    """Root-relative websocket URL viewers of this session connect to."""
    hls_url: str | None = None
    """Root-relative LL-HLS playlist URL of this session."""

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"type": "video.start", "request_id": self.request_id, "format": self.format,
                                "config": dict(self.config)}
        if self.watch_url is not None:
            wire["watch_url"] = self.watch_url
        if self.hls_url is not None:
            wire["hls_url"] = self.hls_url
        return wire


@dataclass(frozen=True)
class ChunkMetadata:
    """`video.chunk_metadata`: describes the binary frame sent right after it."""

    request_id: str
    kind: str
    transport_chunk_index: int
    generation_chunk_index: int | None
    """The phase's index; None on the trailer, which belongs to no phase."""
    request_index: int
    phase_index: int
    num_frames: int
    num_audio_samples: int
    audio_sample_rate: int
    byte_length: int
    started_event_ids: tuple[str, ...]
    active_event_ids: tuple[str, ...]
    completed_event_ids: tuple[str, ...]
    timings: Mapping[str, float]

    def __post_init__(self) -> None:
        if self.byte_length <= 0:
            raise ValueError(f"ChunkMetadata.byte_length={self.byte_length} must be > 0")
        if (self.generation_chunk_index is None) != (self.kind == "trailer"):
            raise ValueError(f"ChunkMetadata.generation_chunk_index={self.generation_chunk_index} must be None "
                             f"exactly on the trailer (kind={self.kind!r})")

    def to_wire(self) -> dict[str, Any]:
        return {
            "type": "video.chunk_metadata", "request_id": self.request_id, "kind": self.kind,
            "transport_chunk_index": self.transport_chunk_index,
            "generation_chunk_index": self.generation_chunk_index,
            "request_index": self.request_index, "phase_index": self.phase_index,
            "num_frames": self.num_frames, "num_audio_samples": self.num_audio_samples,
            "audio_sample_rate": self.audio_sample_rate, "byte_length": self.byte_length,
            "started_event_ids": list(self.started_event_ids),
            "active_event_ids": list(self.active_event_ids),
            "completed_event_ids": list(self.completed_event_ids),
            "timings": dict(self.timings),
        }


@dataclass(frozen=True)
class InitSegment:
    """`video.init_segment`: a viewer's fMP4 init segment (`ftyp` + `moov`) is the binary frame right after it."""

    request_id: str
    byte_length: int

    def __post_init__(self) -> None:
        if self.byte_length <= 0:
            raise ValueError(f"InitSegment.byte_length={self.byte_length} must be > 0")

    def to_wire(self) -> dict[str, Any]:
        return {"type": "video.init_segment", "request_id": self.request_id, "byte_length": self.byte_length}


@dataclass(frozen=True)
class InteractionQueued:
    """`session.interaction.queued`: the prompt update was accepted for a later boundary."""

    request_id: str
    event_id: str

    def to_wire(self) -> dict[str, Any]:
        return {"type": "session.interaction.queued", "request_id": self.request_id,
                "event_id": self.event_id}


@dataclass(frozen=True)
class SessionQueued:
    """`session.queued`: waiting for a free slot; position 1 is next."""

    request_id: str
    position: int

    def __post_init__(self) -> None:
        if self.position < 1:
            raise ValueError(f"SessionQueued.position={self.position} must be >= 1")

    def to_wire(self) -> dict[str, Any]:
        return {"type": "session.queued", "request_id": self.request_id, "position": self.position}


@dataclass(frozen=True)
class Pong:
    """`session.pong`: reply to `session.ping`."""

    def to_wire(self) -> dict[str, Any]:
        return {"type": "session.pong"}


@dataclass(frozen=True)
class SessionDone:
    """`session.done`: the session ended; `chunks` binary frames were sent."""

    request_id: str
    chunks: int
    stopped: bool

    def to_wire(self) -> dict[str, Any]:
        return {"type": "session.done", "request_id": self.request_id, "chunks": self.chunks,
                "stopped": self.stopped}


ServerMessage = Union[
    VideoStart, ChunkMetadata, InitSegment, InteractionQueued, SessionQueued, Pong, SessionDone, ErrorMessage
]
