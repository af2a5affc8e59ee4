"""Protocol-neutral types of the DiT streaming runtime: configs, prompt updates, phase outputs, request events,
domain errors, and the contract of a backend and its session (`DiTBackend`, `DiTSession`).

Frozen dataclasses validated in `__post_init__`; knows nothing about the model, the KV cache, gRPC or threads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:  # the contract's attribute types only
    from services.dit.model.network import DiT
    from services.dit.stream.geometry import Canvas
    from services.dit.stream.kv_cache import CleanAVKVCache
    from services.dit.stream.session import CancelToken

from services.common.config import RENORMALISE_ANCHORS, bucket_sizes_error
from services.common.errors import Cancelled, InternalError, InvalidInput

CANVAS_SHORT_EDGES = {"full": (480, 768, 1088), "tiny": (64, 128, 192, 256)}
"""Default allowed canvas short edges per model preset (sides must also be multiples of 32)."""


class InvalidCanvas(InvalidInput):
    """The requested canvas is not one the deployment serves (the message names it and the allowed ones)."""


class InvalidPrompt(InvalidInput):
    """A prompt embedding has the wrong shape, dtype or non-finite values."""


class LoRAError(InternalError):
    """A LoRA adapter directory is malformed (the message names the file, target and problem); the adapter is
    the deployment's, loaded at start-up, so a server fault."""


class SessionCancelled(Cancelled):
    """The session was cancelled; its KV cache has been released."""


class SessionClosed(InternalError):
    """The session was already cancelled, closed or failed and cannot produce more phases (the server's own
    loop asked it for one: INTERNAL)."""


class KVCacheError(InternalError):
    """A KV-cache transaction was misused (commit without stage, overflow of the preallocated capacity)."""


@dataclass(frozen=True)
class RuntimeConfig:
    """Deployment-wide settings of one DiT group's streaming runtime."""

    canvases: tuple[int, ...] = CANVAS_SHORT_EDGES["full"]
    """Allowed canvas short edges (pixels); sides must be multiples of 32."""
    max_text_tokens: int = 512
    """Longest prompt embedding accepted (rows reserved in the KV work area)."""
    ulysses_degree: int = 1
    """Sequence-parallel ranks; the KV cache keeps num_heads / ulysses_degree heads per rank."""
    audio_reset_requests: int = 12
    """Drop all cached audio history every this many requests."""
    reuse_text_kv: bool = True
    """Compute a request's text rows once per text timestep and reuse their K/V in its later phases (they attend
    to the text only, so their K/V do not depend on the phase); False runs them in every forward."""
    renormalise_anchor: str = "session"
    """Whose per-feature statistics each phase's clean video rows are renormalised to: "session", the session's
    first phase (the official runtime), or "prompt", the first phase of the request where the active prompt began,
    so that a prompt update may change the colours and brightness the first prompt set."""
    text_buckets: tuple[int, ...] = ()
    """Prompt lengths a forward's text rows are padded up to (the smallest that holds the prompt), the padding
    masked out as keys: the forwards that run the text rows then take a few fixed shapes, which the block graphs
    are captured for (`block_graph_shapes`). Empty: the prompt's exact rows."""

    def __post_init__(self) -> None:
        if not self.canvases or any(not isinstance(c, int) or c <= 0 or c % 32 for c in self.canvases):
            raise ValueError(f"canvases={self.canvases!r} must be a non-empty tuple of positive multiples of 32")
        for name in ("max_text_tokens", "ulysses_degree", "audio_reset_requests"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}={v!r} must be an int >= 1")
        if not isinstance(self.reuse_text_kv, bool):
            raise ValueError(f"reuse_text_kv={self.reuse_text_kv!r} must be true or false")
        if self.renormalise_anchor not in RENORMALISE_ANCHORS:
            raise ValueError(f"renormalise_anchor={self.renormalise_anchor!r} must be one of {RENORMALISE_ANCHORS}")
        object.__setattr__(self, "text_buckets", tuple(self.text_buckets))
        if self.text_buckets:
            if why := bucket_sizes_error(self.text_buckets):
                raise ValueError(f"text_buckets={list(self.text_buckets)}: {why}")
            if self.text_buckets[-1] < self.max_text_tokens:
                raise ValueError(f"text_buckets={list(self.text_buckets)}: the largest must hold a prompt of "
                                 f"max_text_tokens={self.max_text_tokens} rows")

    @classmethod
    def for_preset(cls, preset: str, **overrides) -> "RuntimeConfig":
        """Defaults for a model preset ("full" or "tiny")."""
        if preset not in CANVAS_SHORT_EDGES:
            raise ValueError(f"preset={preset!r} is not one of {sorted(CANVAS_SHORT_EDGES)}")
        return cls(canvases=CANVAS_SHORT_EDGES[preset], **overrides)


@dataclass(frozen=True)
class HoldConfig:
    """Optional hold at request boundaries: wait for a newer prompt before starting request k >= 1."""

    enabled: bool = False
    """Hold at every request boundary after request 0 until a newer prompt version arrives."""
    max_seconds: float | None = None
    """Finite hold: after this many seconds use the fallback (or the previous prompt); None holds forever."""
    poll_seconds: float = 0.02
    """How often a held session wakes up to check for a prompt or a cancel."""

    def __post_init__(self) -> None:
        if self.max_seconds is not None and not (math.isfinite(self.max_seconds) and self.max_seconds > 0):
            raise InvalidInput(f"hold max_seconds={self.max_seconds!r} must be a positive finite number, or None "
                               f"for an infinite hold")
        if not (math.isfinite(self.poll_seconds) and self.poll_seconds > 0):
            raise InvalidInput(f"hold poll_seconds={self.poll_seconds!r} must be a positive finite number")


@dataclass(frozen=True)
class SessionConfig:
    """One streaming session's fixed parameters."""

    seed: int
    """Noise seed; request k draws audio from seed + k and video from (seed + k * 1,000,003) mod 2**63."""
    width: int
    """Canvas width in pixels (multiple of 32)."""
    height: int
    """Canvas height in pixels (multiple of 32)."""
    hold: HoldConfig = field(default_factory=HoldConfig)
    """Hold behaviour at request boundaries."""

    def __post_init__(self) -> None:
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise InvalidInput(f"seed={self.seed!r} must be a non-negative int")


@dataclass(frozen=True, eq=False)
class PromptUpdate:
    """A prompt version: its text embedding and the client's event id."""

    embedding: torch.Tensor
    """[L, text_dim] text-encoder hidden states."""
    event_id: str = ""
    """Client event id acknowledged in the phase metadata ("" for an anonymous first prompt)."""

    def __post_init__(self) -> None:
        e = self.embedding
        if not isinstance(e, torch.Tensor) or e.dim() != 2 or e.shape[0] < 1 or not e.is_floating_point():
            shape = tuple(e.shape) if isinstance(e, torch.Tensor) else type(e).__name__
            raise InvalidPrompt(f"prompt {self.event_id!r}: embedding must be a float tensor [L >= 1, text_dim], "
                                f"got {shape}")
        if not bool(torch.isfinite(e).all()):
            raise InvalidPrompt(f"prompt {self.event_id!r}: embedding contains NaN or Inf")
        if not isinstance(self.event_id, str):
            raise InvalidPrompt(f"event_id must be a str, got {type(self.event_id).__name__}")


@dataclass(frozen=True)
class PhaseTimings:
    """Wall seconds spent per stage of one phase."""

    hold_s: float = 0.0
    """Waiting for a newer prompt at the request boundary."""
    teacher_s: float = 0.0
    """The audio teacher's 9 forwards (first phase of a request only)."""
    student_s: float = 0.0
    """The three LoRA-student forwards and Euler updates."""
    commit_s: float = 0.0
    """The previous phase's clean-commit forward and KV transaction, run at the start of this phase (0 for the
    first phase of a session)."""
    total_s: float = 0.0
    """The whole phase."""


@dataclass(frozen=True)
class PhaseMeta:
    """Metadata of one phase output."""

    request_index: int
    phase_index: int
    num_frames: int
    """Pixel frames the phase's video latents decode to."""
    num_audio_samples: int
    """Audio samples per channel the phase's audio latents decode to."""
    num_video_latents: int
    num_audio_latents: int
    """Audio latents per channel."""
    started_event_ids: tuple[str, ...]
    """Prompt events whose prompt is used for the first time in this phase."""
    active_event_id: str
    """The prompt event this phase was generated with."""
    completed_event_ids: tuple[str, ...]
    """Prompt events installed at this phase's request boundary: the started ones and the superseded ones."""
    superseded_event_ids: tuple[str, ...]
    """Prompt events replaced by a newer one before they reached a request boundary (never used)."""
    timings: PhaseTimings


@dataclass(frozen=True, eq=False)
class PhaseOutput:
    """One phase of generated latents, on the device of the DiT's rank 0."""

    video: torch.Tensor
    """[F, 24, h, w] float32 clean video latents (h, w = canvas / 16)."""
    audio: torch.Tensor
    """[2, A, 32] float32 clean audio latents (left, right)."""
    meta: PhaseMeta


@dataclass(frozen=True)
class PhaseAck:
    """The consumer decoded this phase (acks come in phase order)."""

    request_index: int
    phase_index: int


@dataclass(frozen=True, eq=False)
class PromptArrival:
    """A whole prompt from the request stream and its role."""

    update: PromptUpdate
    fallback: bool = False
    """The hold's fallback prompt (only right after the first prompt); False: the active prompt or an update."""


RequestEvent = PhaseAck | PromptArrival
"""What a session's request stream carries after its start, as the service core reads it."""


@runtime_checkable
class DiTSession(Protocol):
    """One endless stream of phases: `DiTRuntime`'s `StreamingSession`, or a Ulysses group's `GroupSession`."""

    canvas: Canvas
    """The session's canvas."""
    kv: CleanAVKVCache | None
    """Rank 0's KV cache (None once released)."""
    cancel_token: CancelToken
    """Set by `cancel()`; generation checks it between forwards."""
    closed: bool
    """True once the session has ended and released its KV."""
    request_index: int
    """The request the next phase belongs to."""
    phase_index: int
    """The next phase's index within its request."""

    def submit_prompt(self, update: PromptUpdate) -> None:
        """Queue a prompt update; it takes effect at the next request boundary."""

    def close_prompts(self) -> None:
        """Say that no prompt will come any more: a hold at a request boundary ends at once."""

    def cancel(self) -> None:
        """Cancel: an idle session releases its KV now, a running phase at its next check."""

    def close(self) -> None:
        """End the session normally and release its KV."""

    def next_phase(self) -> PhaseOutput:
        """Generate the next phase; raises SessionCancelled or SessionClosed."""


@runtime_checkable
class DiTBackend(Protocol):
    """Where sessions run: one process's `DiTRuntime`, or rank 0 of a Ulysses group (`DiTGroup`)."""

    model: DiT
    """Rank 0's network."""
    config: RuntimeConfig
    """The runtime's fixed settings."""
    failed: bool
    """True once the backend can serve no more sessions (a rank died or diverged)."""
    active_session: DiTSession | None
    """The one open session, if any."""

    def check_prompt(self, prompt: PromptUpdate) -> None:
        """Reject an embedding of the wrong width or longer than max_text_tokens."""

    def open_session(self, config: SessionConfig, prompt: PromptUpdate,
                     fallback: PromptUpdate | None = None) -> DiTSession:
        """Validate and start the one session; raises InvalidCanvas, InvalidPrompt or NoCapacity."""

    def shutdown(self) -> None:
        """Stop what the backend runs beside this process (a group's worker ranks)."""
