"""W3C trace context (`traceparent`) for correlating one session's chunks across the stages.

Knows nothing about gRPC messages or any tracing backend: it makes and parses `traceparent` strings
(https://www.w3.org/TR/trace-context/, version 00) and nothing is exported anywhere. The ids end up in the
structured logs (`trace_id`, `span_id`) and in the per-chunk `TraceContext` proto fields, so one session can
be followed across the four processes' logs; a tracing SDK could later adopt the same ids.

Layout of a version-00 header: `00-<trace-id: 32 hex>-<parent-id: 16 hex>-<flags: 2 hex>`, lowercase, with
neither id all zeros. Flag bit 0x01 means "sampled"; ours are always sampled (`01`).
"""
from __future__ import annotations

import logging
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass

from services.common.errors import InvalidInput

log = logging.getLogger(__name__)

TRACEPARENT_METADATA_KEY = "traceparent"
"""gRPC metadata key (lowercase, as gRPC requires) carrying the session span's traceparent on a stream call."""

_SUPPORTED_VERSION = "00"
_HEADER = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")
_TRACE_ID = re.compile(r"[0-9a-f]{32}")
_SPAN_ID = re.compile(r"[0-9a-f]{16}")


class TraceContextError(InvalidInput):
    """A traceparent string or id does not follow the W3C trace-context format (named in the message); the
    sender's fault, though callers log it and carry on rather than fail a request."""


@dataclass(frozen=True)
class SpanContext:
    """The identity of one span: the trace it belongs to and its own id."""

    trace_id: str
    """32 lowercase hex digits (16 bytes), not all zeros; one per session."""

    span_id: str
    """16 lowercase hex digits (8 bytes), not all zeros; one per session, prompt encode or DiT phase."""

    sampled: bool = True
    """Flag bit 0x01 of the header."""

    def __post_init__(self) -> None:
        if not _TRACE_ID.fullmatch(self.trace_id) or self.trace_id == "0" * 32:
            raise TraceContextError(
                f"trace_id {self.trace_id!r} must be 32 lowercase hex digits, not all zeros")
        if not _SPAN_ID.fullmatch(self.span_id) or self.span_id == "0" * 16:
            raise TraceContextError(
                f"span_id {self.span_id!r} must be 16 lowercase hex digits, not all zeros")

    @classmethod
    def new_root(cls) -> SpanContext:
        """Start a new trace (fresh random trace id) with a fresh root span."""
        return cls(trace_id=_random_hex(16), span_id=_random_hex(8))

    def child(self) -> SpanContext:
        """A new span in the same trace (its parent is this span)."""
        return SpanContext(trace_id=self.trace_id, span_id=_random_hex(8), sampled=self.sampled)

    @property
    def traceparent(self) -> str:
        """This span as a version-00 `traceparent` header value."""
        return f"{_SUPPORTED_VERSION}-{self.trace_id}-{self.span_id}-{'01' if self.sampled else '00'}"

    def log_fields(self) -> dict[str, str]:
        """The fields that link a log line to this span."""
        return {"trace_id": self.trace_id, "span_id": self.span_id}


def parse_traceparent(value: str) -> SpanContext:
    """Parse a `traceparent` header value; raise TraceContextError when it is malformed.

    Follows the spec's forward compatibility: a higher version is read by its first four fields (and may
    carry more after a dash); version 00 must be exactly 55 characters; version ff is invalid.
    """
    match = _HEADER.fullmatch(value)
    if match is None:
        raise TraceContextError(
            f"traceparent {value!r} is not '<version:2 hex>-<trace-id:32 hex>-<parent-id:16 hex>-<flags:2 hex>' "
            "in lowercase")
    version, trace_id, span_id, flags, rest = match.groups()
    if version == "ff":
        raise TraceContextError(f"traceparent {value!r} has the forbidden version ff")
    if version == _SUPPORTED_VERSION and rest is not None:
        raise TraceContextError(f"traceparent {value!r}: version 00 allows nothing after the flags")
    return SpanContext(trace_id=trace_id, span_id=span_id, sampled=bool(int(flags, 16) & 0x01))


def parse_optional(value: str) -> SpanContext | None:
    """Parse a traceparent that may be absent ("" → None); raise TraceContextError when malformed."""
    return parse_traceparent(value) if value else None


def continue_trace(traceparent: str) -> SpanContext:
    """The span a received traceparent names, or a new root span when it is empty or malformed.

    As the W3C spec asks of receivers, a malformed value does not fail the request: it is logged and
    replaced by a new trace.
    """
    if traceparent:
        try:
            return parse_traceparent(traceparent)
        except TraceContextError as exc:
            log.warning("ignoring received trace context: %s", exc)
    return SpanContext.new_root()


def metadata_traceparent(metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
    """The `traceparent` value in gRPC invocation metadata ("" when the caller sent none)."""
    for key, value in metadata or ():
        if key == TRACEPARENT_METADATA_KEY:
            return value.decode("ascii", "replace") if isinstance(value, bytes) else value
    return ""


def to_metadata(span: SpanContext) -> tuple[tuple[str, str], ...]:
    """gRPC call metadata carrying `span`."""
    return ((TRACEPARENT_METADATA_KEY, span.traceparent),)


def _random_hex(num_bytes: int) -> str:
    while True:  # an all-zero id is invalid; with 8+ random bytes the loop runs once in practice
        value = secrets.token_hex(num_bytes)
        if value.strip("0"):
            return value
