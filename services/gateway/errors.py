"""Error codes of the gateway's websockets, whose fault each is, and the `error` message that carries one.

Knows nothing about parsing, sockets or sessions: the codes and their table only (`protocol` raises
`ProtocolError`, the transport decides what closes, as the table says).

Error codes, whether the connection closes after the `error` message, and its `fault`: every `error` carries
`fault`, "client" when the client's message, its order or its timing was wrong (fix it, or retry later: the
busy codes), "server" when the server failed a request that was fine. `interaction_failed` says which (client
when the backend rejected the prompt, server when the backend failed it); the other codes always say the one below.
  code                     closes  fault   when
  invalid_json             no      client  a text frame that is not a JSON object (NaN and Infinity are not JSON,
                                           nor is a number past a double's range, e.g. 1e999)
  binary_not_allowed       no      client  a binary frame from the client
  unknown_type             no      client  `type` missing or not a known message type
  missing_field            *       client  a required field is absent
  invalid_type             *       client  a field has the wrong JSON type
  invalid_value            *       client  a field has an out-of-range value (e.g. negative seed)
  unsupported_field        *       client  a field this server does not implement (image_reference, lora, ...)
  message_too_large        *       client  a frame above `max_start_bytes` (start) / `max_interaction_bytes`
  empty_prompt             *       client  prompt empty or only whitespace
  prompt_too_long          *       client  prompt longer than `max_prompt_chars`
  unsupported_format       yes     client  `format` other than "m4s"
  model_mismatch           yes     client  `model` names another model
  canvas_not_allowed       yes     client  (width, height) not in the deployment's canvases
  fps_not_allowed          yes     client  `fps` differs from the served frame rate
  queue_full               yes     client  the wait queue is at its limit (close code 1013)
  rate_limited             yes     client  the client address sent `starts_per_minute_per_address` starts in 60 s
  invalid_request          yes     client  the backend rejected the start
  start_timeout            yes     client  no `session.start` within `start_timeout_s`
  session_not_started      no      client  interaction or stop before `session.start`
  session_already_started  no      client  a second `session.start`; the running session continues
  event_id_conflict        no      client  an interaction reuses an event id of this session
  too_many_updates         no      client  max_pending_updates prompt updates already wait for the backend
  session_stopped          no      client  an interaction after `session.stop`
  interaction_failed       no      either  the backend rejected a prompt update; streaming continues
  stall_timeout            yes     client  no chunk and no ping for `stall_timeout_s`
  backend_unavailable      yes     server  a backend stage is unreachable or not serving
  backend_failed           yes     server  a backend stage failed the session
  backend_busy             yes     client  a backend stage had no free session capacity for `stall_timeout_s`
  internal_error           yes     server  anything else
  not_director             no      client  a viewer (watch websocket) sent something other than `session.ping`
  viewer_too_slow          yes     client  a viewer fell behind the live stream too often (close code 1013)
  unknown_session          HTTP    client  the watched session id is not live (HTTP 404 before the upgrade)
  too_many_viewers         HTTP    client  the session has `broadcast.max_viewers` viewers (HTTP 503 before the upgrade)
  (*) closes when no session runs yet (the rejected frame was, or may have been, the start);
      stays open once a session runs (the running session continues).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType
from typing import Any

from services.common.errors import ClientError, Fault


class ErrorCode(str, Enum):
    """Named error codes carried in `error.code`."""

    INVALID_JSON = "invalid_json"
    BINARY_NOT_ALLOWED = "binary_not_allowed"
    UNKNOWN_TYPE = "unknown_type"
    MISSING_FIELD = "missing_field"
    INVALID_TYPE = "invalid_type"
    INVALID_VALUE = "invalid_value"
    UNSUPPORTED_FIELD = "unsupported_field"
    MESSAGE_TOO_LARGE = "message_too_large"
    EMPTY_PROMPT = "empty_prompt"
    PROMPT_TOO_LONG = "prompt_too_long"
    UNSUPPORTED_FORMAT = "unsupported_format"
    MODEL_MISMATCH = "model_mismatch"
    CANVAS_NOT_ALLOWED = "canvas_not_allowed"
    FPS_NOT_ALLOWED = "fps_not_allowed"
    QUEUE_FULL = "queue_full"
    RATE_LIMITED = "rate_limited"
    INVALID_REQUEST = "invalid_request"
    START_TIMEOUT = "start_timeout"
    SESSION_NOT_STARTED = "session_not_started"
    SESSION_ALREADY_STARTED = "session_already_started"
    EVENT_ID_CONFLICT = "event_id_conflict"
    TOO_MANY_UPDATES = "too_many_updates"
    SESSION_STOPPED = "session_stopped"
    INTERACTION_FAILED = "interaction_failed"
    STALL_TIMEOUT = "stall_timeout"
    BACKEND_UNAVAILABLE = "backend_unavailable"
    BACKEND_FAILED = "backend_failed"
    BACKEND_BUSY = "backend_busy"
    INTERNAL_ERROR = "internal_error"
    NOT_DIRECTOR = "not_director"
    VIEWER_TOO_SLOW = "viewer_too_slow"
    UNKNOWN_SESSION = "unknown_session"
    TOO_MANY_VIEWERS = "too_many_viewers"


ERROR_FAULTS: Mapping[ErrorCode, Fault] = MappingProxyType({
    **{code: "client" for code in ErrorCode},
    ErrorCode.BACKEND_UNAVAILABLE: "server",
    ErrorCode.BACKEND_FAILED: "server",
    ErrorCode.INTERNAL_ERROR: "server",
})
"""Whose fault each code is (`error.fault`) when the message does not say otherwise: only
`interaction_failed` may be either, and takes the fault of the backend error behind it."""


class ProtocolError(ClientError):
    """A client message was rejected; becomes one `error` message with `code` (its fault: client)."""

    def __init__(self, code: ErrorCode, message: str, *, event_id: str | None = None) -> None:
        super().__init__(f"{code.value}: {message}")
        self.code = code
        self.message = message
        self.event_id = event_id


@dataclass(frozen=True)
class ErrorMessage:
    """`error`: something was rejected or failed."""

    code: ErrorCode
    message: str
    event_id: str | None = None
    request_id: str | None = None
    fault: Fault | None = None
    """Whose fault it was, "client" or "server"; None takes the code's (`ERROR_FAULTS`)."""

    def __post_init__(self) -> None:
        if self.fault is None:
            object.__setattr__(self, "fault", ERROR_FAULTS[self.code])
        elif self.fault not in ("client", "server"):
            raise ValueError(f"fault={self.fault!r} must be 'client' or 'server'")

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"type": "error", "code": self.code.value, "fault": self.fault,
                                "message": self.message}
        if self.event_id is not None:
            wire["event_id"] = self.event_id
        if self.request_id is not None:
            wire["request_id"] = self.request_id
        return wire
