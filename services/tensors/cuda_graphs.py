"""CUDA graph capture and replay of fixed-shape callables, keyed by shape signature, captured at start-up.

`CudaGraphBank` holds one CUDA graph per `GraphKey` (a name, a free-form tag such as a step index, plus the
(shape, dtype) signature of the static inputs). Every graph is captured into ONE shared memory pool
(`torch.cuda.graph_pool_handle()`); this is safe because graphs are replayed one at a time (the caller orders them:
the audio teacher replays on its own stream, never while another of its replays runs) and each graph's static
outputs stay referenced, so no later capture reuses their memory. Each bank also captures on a stream of its own:
a captured GEMM keeps the cuBLAS workspace of the stream it was captured on, and two banks whose graphs replay at
the same time (the teacher's beside the DiT's block pieces) must not share one (with one capture stream for both,
the two DiT ranks hung in the first all-to-all after such a pair). `seal()` ends start-up: from then on a key
that was not captured runs eagerly (counted in `misses`) instead of capturing in the hot path. On a CPU bank every
call runs eagerly (same API, used by the CPU tests).

Replay semantics: `run(key, fn, inputs)` copies `inputs` into the graph's static input buffers, replays, and returns
the graph's static OUTPUT tensors — valid until the next replay of the same key (clone them to keep them). Python
side effects of `fn` happen only at capture time, never at replay.

`PromptBuckets` pads variable-length prompts to a few sizes so that one graph per size covers every prompt; the
caller makes the padding rows inert (a causal text encoder ignores trailing rows; the DiT's audio teacher masks them
out as attention keys). Users: services/encoder/model.py (text encoder) and services/dit/stream/teacher.py (audio teacher).
Knows nothing about models, prompts or sessions.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Hashable, Sequence

import torch

from services.common.config import PROMPT_BUCKETS, bucket_sizes_error
from services.common.errors import InternalError

log = logging.getLogger(__name__)

Signature = tuple[tuple[tuple[int, ...], str], ...]


class GraphError(InternalError):
    """A graph was asked for the wrong shapes, captured after sealing, or a bucket does not exist (a server fault:
    the service picks the shapes; a caller's bad input is rejected before any graph runs)."""


@dataclass(frozen=True)
class PromptBuckets:
    """Prompt lengths are padded up to the smallest bucket that holds them."""

    sizes: tuple[int, ...] = PROMPT_BUCKETS

    def __post_init__(self) -> None:
        if why := bucket_sizes_error(self.sizes):
            raise GraphError(f"bucket sizes {self.sizes!r}: {why}")

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
    """What the graph runs: "teacher", "text_encoder"."""
    signature: Signature
    tag: tuple[Hashable, ...] = ()
    """Whatever else fixes the computation beyond the input shapes, e.g. the teacher's step."""

    @classmethod
    def for_inputs(cls, phase: str, inputs: Sequence[torch.Tensor], tag: tuple[Hashable, ...] = ()) -> "GraphKey":
        if not phase:
            raise GraphError("graph phase name must be non-empty")
        return cls(phase, signature_of(inputs), tuple(tag))


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
        self.stream = torch.cuda.Stream(self.device) if self.enabled else None
        """Warm-up and capture stream of this bank's graphs (their cuBLAS workspace), not shared with other banks."""
        self.sealed = False
        self.stats = GraphStats()
        self._entries: dict[GraphKey, _Entry] = {}
        self._max_logged_misses = max_logged_misses

    def __contains__(self, key: GraphKey) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def capture(self, key: GraphKey, fn: Callable[..., object], example_inputs: Sequence[torch.Tensor]) -> object:
        """Capture `fn(*inputs)` under `key` (start-up only); returns the outputs of the capture run.

        `example_inputs` are copied into freshly allocated static buffers, so the caller's tensors stay free. The
        buffers are plain tensors even when this runs in inference mode, so a replay may copy into them from any
        thread and mode (inference mode is thread-local: the teacher's worker replays outside it).
        """
        if self.sealed:
            raise GraphError(f"capture of {key.phase} {key.tag} after seal(): captures belong to start-up")
        if key in self._entries:
            raise GraphError(f"graph {key} is already captured")
        if signature_of(example_inputs) != key.signature:
            raise GraphError(f"example inputs {signature_of(example_inputs)} do not match the key's signature "
                             f"{key.signature}")
        with torch.inference_mode(False):
            static = [x.detach().to(self.device).clone() for x in example_inputs]
        entry = _Entry(fn, static)
        if not self.enabled:
            entry.static_outputs = fn(*static)
        else:  # on the bank's device whatever the caller's current one (the VAE's audio decoder is on cuda:1)
            with torch.cuda.device(self.device):
                self.stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self.stream), torch.no_grad():
                    for _ in range(self.warmup):
                        fn(*static)
                torch.cuda.current_stream(self.device).wait_stream(self.stream)
                graph = torch.cuda.CUDAGraph()
                with torch.no_grad(), torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
                    entry.static_outputs = fn(*static)
            entry.graph = graph
        self._entries[key] = entry
        self.stats.captured += 1
        return entry.static_outputs

    def close(self) -> None:
        """Free every graph and its static buffers (the bank is empty and sealed afterwards).

        Graphs that captured NCCL collectives hold their communicator: free them before leaving the process group,
        or destroying it waits on them.
        """
        if self.enabled:
            torch.cuda.synchronize(self.device)
        for entry in self._entries.values():
            if entry.graph is not None:
                entry.graph.reset()
        self._entries.clear()
        self.sealed = True

    def seal(self) -> None:
        """End of start-up: later unknown keys run eagerly instead of capturing."""
        self.sealed = True
        log.info("graph bank sealed with %d graphs on %s", len(self._entries), self.device)

    def run(self, key: GraphKey, fn: Callable[..., object], inputs: Sequence[torch.Tensor]) -> object:
        """Replay the graph of `key` on `inputs` (copied into its static buffers), or run `fn` eagerly."""
        if key not in self._entries:
            self.stats.misses += 1
            if len(self.stats.missed_keys) < self._max_logged_misses:
                self.stats.missed_keys.append(key)
                log.warning("no graph for %s %s: running eagerly", key.phase, key.tag)
            with torch.no_grad():
                return fn(*inputs)
        return self.replay(key, inputs)

    def replay(self, key: GraphKey, inputs: Sequence[torch.Tensor]) -> object:
        """Replay the graph of `key` on `inputs` on the current stream; a key that was not captured is an error."""
        entry = self._entries.get(key)
        if entry is None:
            raise GraphError(f"no graph for {key.phase} {key.tag} with inputs {key.signature}")
        if signature_of(inputs) != key.signature:
            raise GraphError(f"inputs {signature_of(inputs)} do not match graph {key.phase} {key.tag} signature "
                             f"{key.signature}")
        self.stats.replays += 1
        if entry.graph is None:  # CPU bank: same bookkeeping, eager execution
            with torch.no_grad():
                return entry.fn(*inputs)
        with torch.cuda.device(self.device):
            for dst, src in zip(entry.static_inputs, inputs):
                if dst.data_ptr() != src.data_ptr():
                    dst.copy_(src)
            entry.graph.replay()
        return entry.static_outputs
