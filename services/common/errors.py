"""Domain exceptions shared by the stage services and the one table that maps them to gRPC status.

Knows nothing about any particular model; services raise these, grpc servers translate them here only.
"""
from __future__ import annotations

import logging

import grpc

log = logging.getLogger(__name__)


class VitascopeError(Exception):
    """Base of every error the services raise on purpose."""


class InvalidInput(VitascopeError, ValueError):
    """A request carries a value the service cannot accept (named in the message)."""


class NoCapacity(VitascopeError):
    """Every slot is busy (one active session per DiT group)."""


class SessionNotFound(VitascopeError):
    """The session id is unknown or already closed."""


class SequenceMismatch(VitascopeError):
    """Messages of a stream arrived in an order the protocol does not allow."""


class NotReady(VitascopeError):
    """The service is still loading or warming up."""


class StageFailed(VitascopeError):
    """The stage broke (e.g. a rank of the DiT group died) and reports NOT_SERVING until restarted."""


class Cancelled(VitascopeError):
    """The session was cancelled (by its client or by shutdown) and has released its resources."""


_STATUS = (
    (InvalidInput, grpc.StatusCode.INVALID_ARGUMENT),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
    (NoCapacity, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (SessionNotFound, grpc.StatusCode.NOT_FOUND),
    (SequenceMismatch, grpc.StatusCode.FAILED_PRECONDITION),
    (NotReady, grpc.StatusCode.UNAVAILABLE),
    (StageFailed, grpc.StatusCode.UNAVAILABLE),
    (Cancelled, grpc.StatusCode.CANCELLED),
)


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status for an exception; anything unexpected is INTERNAL and logged."""
    for cls, code in _STATUS:
        if isinstance(exc, cls):
            return code
    log.error("unexpected error: %r", exc, exc_info=exc)
    return grpc.StatusCode.INTERNAL


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """Abort an RPC with the status that the table gives for exc."""
    await context.abort(status_for(exc), f"{type(exc).__name__}: {exc}")
