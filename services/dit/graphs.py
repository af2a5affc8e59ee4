"""CUDA graph capture and replay of fixed-shape forwards, keyed by shape signature, captured at start-up.

`CudaGraphBank` holds one CUDA graph per `GraphKey` (a phase name, a free-form tag such as the teacher step, the
prompt-length bucket and the KV history rows, plus the (shape, dtype) signature of the static inputs). Every graph
is captured into ONE shared memory pool (`torch.cuda.graph_pool_handle()`); this is safe because graphs are
replayed one at a time on one stream and each graph's static outputs stay referenced, so no later capture reuses
their memory. `seal()` ends start-up: from then on a key that was not captured runs eagerly (counted in `misses`)
instead of capturing in the hot path. On a CPU bank every call runs eagerly (same API, used by the CPU tests).

Replay semantics: `run(key, fn, inputs)` copies `inputs` into the graph's static input buffers, replays, and returns
the graph's static OUTPUT tensors — valid until the next replay of the same key (clone them to keep them). Python
side effects of `fn` (e.g. KV-cache bookkeeping) happen only at capture time, never at replay.

What is capturable in this runtime:
- Audio teacher: fixed shapes per (prompt length, tail rows); 9 steps, each its own graph because the AdaLN rows
  are chosen by the step's timestep values in Python. The RoPE positions of a request are a static input.
- Text encoder: causal, so right-padding a prompt to a `PromptBuckets` size leaves the real rows' outputs
  mathematically unchanged (each real row attends only to earlier rows); the caller slices the first `n_real` rows.
- DiT forwards take the text rows as ONE unmasked document (token refiner; text-to-text and media-to-text
  attention), so padded text rows WOULD change the result. Prompt-length bucketing for the DiT therefore needs a
  key-padding mask in the refiner and in the attention patterns (padded text rows excluded as keys), which
  model.py / attention.py do not have yet; until then DiT graphs are keyed by the exact text length and a new
  prompt length misses (eager) instead of capturing in the hot path.
- Student forwards read the KV cache through address-stable views `[live history | work area]`; their graph is
  valid for one (phase shape, history rows) pair. In steady state the history takes a few values (sink video rows
  + the 2 most recent commits, and the same after `drop_audio`), so capture per (phase, history rows) at start-up.
  The graph bakes in the cache's buffer addresses: the runtime must keep ONE cache object whose buffers outlive
  sessions, and capture by setting its `live` to each steady-state value (contents are irrelevant at capture).
- Commit forwards additionally call `cache.stage(layer, ...)` (Python bookkeeping; the copy is a no-op because the
  rows are written in place). A replay must be followed by re-staging every layer from the work-area views;
  `commit_replay_views` does that.
Knows nothing about model weights, prompts or sessions.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Callable, Hashable, Sequence

import torch

log = logging.getLogger(__name__)

DEFAULT_BUCKETS = (128, 256, 384, 512)
Signature = tuple[tuple[tuple[int, ...], str], ...]


class GraphError(ValueError):
    """A graph was asked for the wrong shapes, captured after sealing, or a bucket does not exist."""


@dataclass(frozen=True)
class PromptBuckets:
    """Prompt lengths are padded up to the smallest bucket that holds them."""

    sizes: tuple[int, ...] = DEFAULT_BUCKETS

    def __post_init__(self) -> None:
        s = self.sizes
        if not s or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in s):
            raise GraphError(f"bucket sizes {s!r} must be a non-empty tuple of positive ints")
        if list(s) != sorted(set(s)):
            raise GraphError(f"bucket sizes {s!r} must be strictly increasing")

    def bucket(self, length: int) -> int:
        """The bucket a prompt of `length` rows is padded to."""
        if not isinstance(length, int) or isinstance(length, bool) or length < 1:
            raise GraphError(f"prompt length {length!r} must be a positive int")
        for size in self.sizes:
            if length <= size:
                return size
        raise GraphError(f"prompt of {length} rows exceeds the largest bucket {self.sizes[-1]}")

    def pad(self, rows: torch.Tensor, fill: float = 0.0) -> tuple[torch.Tensor, int]:
        """Pad `rows` at the end to its bucket; returns (padded rows, number of real rows)."""
        # rows: [L, ...] -> [bucket(L), ...]
        n = rows.shape[0]
        b = self.bucket(n)
        if b == n:
            return rows, n
        pad = rows.new_full((b - n, *rows.shape[1:]), fill)
        return torch.cat([rows, pad], dim=0), n


def signature_of(inputs: Sequence[torch.Tensor]) -> Signature:
    """The (shape, dtype) signature of a list of tensors."""
    sig = []
    for i, x in enumerate(inputs):
        if not isinstance(x, torch.Tensor):
            raise GraphError(f"graph input {i} is a {type(x).__name__}, expected a tensor")
        sig.append((tuple(x.shape), str(x.dtype).removeprefix("torch.")))
    return tuple(sig)


@dataclass(frozen=True)
class GraphKey:
    """Identity of one captured graph."""

    phase: str
    """"teacher", "text_encoder", "student", "commit", ..."""
    signature: Signature
    tag: tuple[Hashable, ...] = ()
    """Whatever else fixes the computation: teacher step, timestep values, prompt bucket."""
    history_rows: int = 0
    """KV history rows the forward attends to (0 when it reads no cache)."""

    @classmethod
    def for_inputs(cls, phase: str, inputs: Sequence[torch.Tensor], tag: tuple[Hashable, ...] = (),
                   history_rows: int = 0) -> "GraphKey":
        if not phase:
            raise GraphError("graph phase name must be non-empty")
        if not isinstance(history_rows, int) or history_rows < 0:
            raise GraphError(f"history_rows={history_rows!r} must be a non-negative int")
        return cls(phase, signature_of(inputs), tuple(tag), history_rows)


@dataclass
class _Entry:
    fn: Callable[..., object]
    static_inputs: list[torch.Tensor]
    static_outputs: object = None
    graph: "torch.cuda.CUDAGraph | None" = None


@dataclass
class GraphStats:
    captured: int = 0
    replays: int = 0
    misses: int = 0
    missed_keys: list[GraphKey] = field(default_factory=list)


class CudaGraphBank:
    """Graphs of fixed-shape callables on one device, one shared memory pool; eager on CPU."""

    def __init__(self, device: torch.device | str, warmup: int = 2, max_logged_misses: int = 8):
        self.device = torch.device(device)
        self.enabled = self.device.type == "cuda"
        if self.enabled and not torch.cuda.is_available():
            raise GraphError(f"graph bank on {self.device} but CUDA is not available")
        if not isinstance(warmup, int) or warmup < 1:
            raise GraphError(f"warmup={warmup!r} must be a positive int (cuBLAS/cuDNN must initialise before capture)")
        self.warmup = warmup
        self.pool = torch.cuda.graph_pool_handle() if self.enabled else None
        self.sealed = False
        self.stats = GraphStats()
        self._entries: dict[GraphKey, _Entry] = {}
        self._max_logged_misses = max_logged_misses

    def __contains__(self, key: GraphKey) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[GraphKey]:
        return list(self._entries)

    def capture(self, key: GraphKey, fn: Callable[..., object], example_inputs: Sequence[torch.Tensor]) -> object:
        """Capture `fn(*inputs)` under `key` (start-up only); returns the outputs of the capture run.

        `example_inputs` are copied into freshly allocated static buffers, so the caller's tensors stay free.
        """
        if self.sealed:
            raise GraphError(f"capture of {key.phase} {key.tag} after seal(): captures belong to start-up")
        if key in self._entries:
            raise GraphError(f"graph {key} is already captured")
        if signature_of(example_inputs) != key.signature:
            raise GraphError(f"example inputs {signature_of(example_inputs)} do not match the key's signature "
                             f"{key.signature}")
        static = [x.detach().to(self.device).clone() for x in example_inputs]
        entry = _Entry(fn, static)
        if not self.enabled:
            entry.static_outputs = fn(*static)
        else:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side), torch.no_grad():
                for _ in range(self.warmup):
                    fn(*static)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.no_grad(), torch.cuda.graph(graph, pool=self.pool):
                entry.static_outputs = fn(*static)
            entry.graph = graph
        self._entries[key] = entry
        self.stats.captured += 1
        return entry.static_outputs

    def seal(self) -> None:
        """End of start-up: later unknown keys run eagerly instead of capturing."""
        self.sealed = True
        log.info("graph bank sealed with %d graphs on %s", len(self._entries), self.device)

    def run(self, key: GraphKey, fn: Callable[..., object], inputs: Sequence[torch.Tensor]) -> object:
        """Replay the graph of `key` on `inputs` (copied into its static buffers), or run `fn` eagerly."""
        entry = self._entries.get(key)
        if entry is None:
            self.stats.misses += 1
            if len(self.stats.missed_keys) < self._max_logged_misses:
                self.stats.missed_keys.append(key)
                log.warning("no graph for %s %s (history %d): running eagerly", key.phase, key.tag, key.history_rows)
            with torch.no_grad():
                return fn(*inputs)
        if signature_of(inputs) != key.signature:
            raise GraphError(f"inputs {signature_of(inputs)} do not match graph {key.phase} {key.tag} signature "
                             f"{key.signature}")
        if entry.graph is None:  # CPU bank: same bookkeeping, eager execution
            with torch.no_grad():
                return entry.fn(*inputs)
        for dst, src in zip(entry.static_inputs, inputs):
            if dst.data_ptr() != src.data_ptr():
                dst.copy_(src)
        entry.graph.replay()
        self.stats.replays += 1
        return entry.static_outputs

    def static_inputs(self, key: GraphKey) -> list[torch.Tensor]:
        """The static input buffers of `key` (write into them directly to skip the copy in `run`)."""
        entry = self._entries.get(key)
        if entry is None:
            raise GraphError(f"no graph for {key.phase} {key.tag}")
        return entry.static_inputs


def commit_replay_views(cache, media_rows: int, text_rows: int) -> None:
    """After replaying a commit-mode forward, stage every layer's in-place media K/V rows into the open commit."""
    # the replayed graph wrote the rows into cache.k/v[layer][live:live + media_rows] (address-stable buffers)
    for layer in range(cache.num_layers):
        k, v = cache.work(layer, media_rows, text_rows)
        hist = cache.live
        cache.stage(layer, k[hist:hist + media_rows], v[hist:hist + media_rows])


def layout_tag(layout, *extra: Hashable) -> tuple[Hashable, ...]:
    """Graph tag of a packed layout: its row counts and timestep values (they pick the AdaLN rows), plus `extra`."""
    return (layout.text_len, layout.audio_len, layout.video_len, layout.seq_len, layout.timestep_values, *extra)


def packed_forward(model, layout, attention: Callable) -> Callable[..., object]:
    """`fn(video, audio, text, positions)` running `model` on `layout` with the RoPE positions as a graph input.

    Everything else in the layout (row indices, tags, timestep slots) is fixed by the graph key; a request's
    positions change (timeline offsets), so they travel as a static input buffer. `attention` is built by the
    caller BEFORE capture (pattern constructors may check layouts on the host, which a capture forbids).
    """
    def fn(video: torch.Tensor, audio: torch.Tensor, text: torch.Tensor, positions: torch.Tensor):
        # video: [Tv, 96], audio: [Ta, 32], text: [Tt, text_dim], positions: [S, 3]
        return model(video, audio, text, replace(layout, positions=positions), attention)
    return fn
