"""Structured logs: one JSON object per line, carrying the session's ids from a context variable.

Knows nothing about sessions, gRPC or websockets: a service binds fields (`session_id`, `trace_id`, ...)
with `log_context(...)` around the work of one session, and every record logged inside that context, in
this task, in tasks it creates, and in threads started with `asyncio.to_thread` (which copies the
context), gets those fields. `configure_logging(service)` is called once from each service's `main()`.

Line format (docs/observability.md): `ts` (RFC 3339, UTC, milliseconds), `level`, `logger`, `msg`,
`service`, then the bound context fields, then any `extra={...}` fields of the call (which win over bound
fields of the same name), and `exc` with the formatted traceback when there is one.
"""
from __future__ import annotations

import contextlib
import contextvars
import datetime
import json
import logging
import sys
from collections.abc import Iterator, Mapping
from typing import TextIO

_CONTEXT: contextvars.ContextVar[Mapping[str, object]] = contextvars.ContextVar("vitascope_log_context",
                                                                                default={})

# Attributes every LogRecord has; anything else on a record came from `extra=` and is emitted as a field.
_STANDARD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}
_CORE_FIELDS = ("ts", "level", "logger", "msg", "service")
_HUMAN_OMITS = frozenset({"startup"})
"""Extra fields a readable line leaves out: its message already says them (`startup.report`)."""


def current_context() -> dict[str, object]:
    """The fields bound in the current context."""
    return dict(_CONTEXT.get())


@contextlib.contextmanager
def log_context(**fields: object) -> Iterator[None]:
    """Bind fields (e.g. session_id=..., trace_id=...) to every record logged inside the block.

    Nested blocks add to (and may override) the outer fields; a field set to None is removed.
    """
    for name in fields:
        if name in _CORE_FIELDS:
            raise ValueError(f"log_context field {name!r} would overwrite a core log field; pick another name")
    merged = {**_CONTEXT.get(), **fields}
    token = _CONTEXT.set({k: v for k, v in merged.items() if v is not None})
    try:
        yield
    finally:
        try:
            _CONTEXT.reset(token)
        except ValueError:
            # The block is being closed from another context (an async generator finalized by a different
            # task); that context never saw our fields, so there is nothing to undo there.
            pass


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON object (no newlines inside)."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.datetime.fromtimestamp(record.created, tz=datetime.timezone.utc)
        entry: dict[str, object] = {
            "ts": ts.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
            "service": self.service,
        }
        entry.update(_CONTEXT.get())
        for key, value in vars(record).items():
            if key not in _STANDARD_ATTRS and key not in _CORE_FIELDS:
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["exc"] = record.exc_text
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, default=str, ensure_ascii=False)


class HumanFormatter(logging.Formatter):
    """One readable line per record, for a terminal: time, service, level, message, then the context fields."""

    def __init__(self, service: str) -> None:
        super().__init__(f"%(asctime)s {service:7s} %(levelname)-7s %(message)s", datefmt="%H:%M:%S")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        context = {**_CONTEXT.get(), **{k: v for k, v in vars(record).items()
                                         if k not in _STANDARD_ATTRS and k not in _CORE_FIELDS
                                         and k not in _HUMAN_OMITS}}
        return line + ("  [" + " ".join(f"{k}={v}" for k, v in context.items()) + "]" if context else "")


def configure_logging(service: str, level: int | str = logging.INFO, stream: TextIO | None = None,
                      human: bool | None = None) -> None:
    """Send every logger's records to `stream` (stderr by default), replacing root handlers: readable lines when
    `human` (default: when the stream is a terminal), JSON lines otherwise (files, collectors, Kubernetes)."""
    if not service:
        raise ValueError("configure_logging: service name is empty; pass e.g. 'dit'")
    stream = stream if stream is not None else sys.stderr
    if human is None:
        human = hasattr(stream, "isatty") and stream.isatty()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(HumanFormatter(service) if human else JsonFormatter(service))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
