"""Domain exceptions shared by the stage services and the one table that maps them to gRPC status.

Every exception a service raises on purpose derives from `VitascopeError`, through one of two branches:
`ClientError` (the caller's fault: a bad value, a message out of order, an unknown session, no free slot, a
cancel) and `ServerError` (the server's fault: a stage not ready or broken, or an internal fault such as a graph,
FP8, AdaLN-cache, checkpoint or configuration error). A stage keeps its own exceptions in its module, derived from
one of the classes here. `status_for` maps by explicit class only; anything else is INTERNAL with a logged
traceback, so a server fault never reaches a client as its own invalid request.

Knows nothing about any particular model; services raise these, grpc servers translate them here only.
"""
from __future__ import annotations

import logging
from typing import Literal

import grpc

log = logging.getLogger(__name__)

Fault = Literal["client", "server"]
"""Whose fault an error is: the caller's (fix the request, or retry later) or the server's."""


class VitascopeError(Exception):
    """Base of every error the services raise on purpose; subclass `ClientError` or `ServerError`, not this."""

    fault: Fault = "server"
    """Whose fault it is; set by the branch."""


class ClientError(VitascopeError):
    """The caller's fault: the request, its order or its timing is wrong (gRPC 4xx-like statuses)."""

    fault: Fault = "client"


class ServerError(VitascopeError):
    """The server's fault: the caller's request was fine, the service could not serve it."""

    fault: Fault = "server"


# ---- the caller's fault

class InvalidInput(ClientError, ValueError):
    """A request carries a value the service cannot accept (named in the message).

    Also a ValueError: request dataclasses validate in `__post_init__`, and callers that build them catch
    ValueError as their other config values do.
    """


class SequenceMismatch(ClientError):
    """Messages of a stream arrived in an order the protocol does not allow."""


class SessionNotFound(ClientError):
    """The session id is unknown or already closed."""


class NoCapacity(ClientError):
    """Every slot is busy (one active session per DiT group); retry later."""


class Cancelled(ClientError):
    """The session was cancelled (by its client or by shutdown) and has released its resources."""


# ---- the server's fault

class NotReady(ServerError):
    """The service is still loading or warming up."""


class StageFailed(ServerError):
    """The stage broke (e.g. a rank of the DiT group died) and reports NOT_SERVING until restarted."""


class InternalError(ServerError):
    """A fault inside the service (a kernel, graph, cache, checkpoint or configuration error)."""


_STATUS: tuple[tuple[type[VitascopeError], grpc.StatusCode], ...] = (
    (InvalidInput, grpc.StatusCode.INVALID_ARGUMENT),
    (SequenceMismatch, grpc.StatusCode.FAILED_PRECONDITION),
    (SessionNotFound, grpc.StatusCode.NOT_FOUND),
    (NoCapacity, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (Cancelled, grpc.StatusCode.CANCELLED),
    (NotReady, grpc.StatusCode.UNAVAILABLE),
    (StageFailed, grpc.StatusCode.UNAVAILABLE),
    (InternalError, grpc.StatusCode.INTERNAL),
)
"""The one table: explicit classes (and their subclasses) to a status; the first match wins."""


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status for an exception; a server fault or anything unmapped is INTERNAL and logged."""
    for cls, code in _STATUS:
        if isinstance(exc, cls):
            if code == grpc.StatusCode.INTERNAL:
                log.error("internal error: %r", exc, exc_info=exc)
            return code
    log.error("unexpected error: %r", exc, exc_info=exc)
    return grpc.StatusCode.INTERNAL


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """Abort an RPC with the status that the table gives for exc."""
    await context.abort(status_for(exc), f"{type(exc).__name__}: {exc}")
