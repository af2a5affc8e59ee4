"""Control records of a Ulysses DiT group: what rank 0 tells the other ranks before each step, and what they report.

Small frozen dataclasses, pickled over the group's gloo control channel (tensors never travel inside them).
Knows nothing about collectives, processes or the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from services.dit.api import SessionConfig
from services.dit.stream.runtime import DiTRuntime, StreamingSession


@dataclass(frozen=True)
class PromptSpec:
    """Metadata of a prompt embedding whose float32 values follow over the device group."""

    event_id: str
    rows: int
    width: int


@dataclass(frozen=True)
class OpenSession:
    """Open the group's session (hold already disabled: rank 0 holds); the prompt tensors follow."""

    config: SessionConfig
    prompt: PromptSpec
    fallback: PromptSpec | None


@dataclass(frozen=True)
class SubmitPrompt:
    """Queue a prompt update before the next phase; its tensor follows."""

    prompt: PromptSpec


@dataclass(frozen=True)
class NextPhase:
    """Generate the next phase; `use_fallback` first queues the session's fallback (an expired hold)."""

    use_fallback: bool = False


@dataclass(frozen=True)
class CancelSession:
    """Cancel the idle session and release its KV."""


@dataclass(frozen=True)
class CloseSession:
    """Close the session normally."""


@dataclass(frozen=True)
class QueryStatus:
    """Every rank reports its `RankStatus` (gathered over the control group)."""


@dataclass(frozen=True)
class Heartbeat:
    """Keeps idle ranks' control receive inside its timeout and probes their liveness."""


@dataclass(frozen=True)
class Shutdown:
    """Leave `worker_loop` and exit."""


@dataclass(frozen=True)
class RunOnRanks:
    """Every rank calls `fn(runtime)` with its own runtime; only between sessions. `fn` travels pickled, so it is a
    module-level function or a `functools.partial` of one (a tool's probe: the product defines none)."""

    fn: Callable[[DiTRuntime], object]


ControlRecord = (OpenSession | SubmitPrompt | NextPhase | CancelSession | CloseSession | QueryStatus | Heartbeat
                 | Shutdown | RunOnRanks)


@dataclass(frozen=True)
class RankStatus:
    """One rank's view of the group's session."""

    rank: int
    session_open: bool
    request_index: int
    phase_index: int
    kv_local_heads: int
    """Heads per rank of the KV buffers (num_heads / N); 0 without a session."""
    kv_head_dim: int
    kv_live_rows: int
    kv_audio_rows: int
    kv_video_rows: int


def rank_status(rank: int, session: StreamingSession | None) -> RankStatus:
    """Describe `session` as seen on this rank."""
    kv = None if session is None else session.kv
    if kv is None:
        return RankStatus(rank, False, 0, 0, 0, 0, 0, 0, 0)
    return RankStatus(rank, True, session.request_index, session.phase_index, kv.local_heads, kv.head_dim, kv.live,
                      kv.audio_rows, kv.video_rows)
