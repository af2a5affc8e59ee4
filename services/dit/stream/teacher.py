"""Audio teacher: the base model (LoRA suspended) writes each request's audio from text alone.

Once per request, 9 audio-only Euler forwards on a 10-state shift-3 grid over the document
[text | audio-L: tail, noise | audio-R: tail, noise] with full attention; the text rows take the video clock (the
10-state shift-12 grid), as text rows do in every forward. The tail is the previous request's last
1 s (40 latents per channel) of clean teacher audio, frozen at t = 1; request 0 has none. The document's positions
are the base model's own, not the session's timeline (`Timeline.teacher`). States 3, 6 and 9 are
returned: they overwrite the student's audio rows after its steps 1, 2 and 3, so the published audio is exactly
the teacher's clean latent.

On CUDA the 9 forwards are small (~700-900 rows) and bound by the host's kernel dispatch, so `capture_graphs`
records each step as a CUDA graph at start-up, per prompt-length bucket and audio shape. The prompt is then padded
to its bucket and the padding rows are masked out as attention keys (`PackedLayout.text_valid`), so the real rows
compute what the unpadded prompt gives. Under Ulysses the steps run whole on each rank (`placement`); with
`dit.teacher_staged`, each rank runs one contiguous stage of the blocks (`TeacherStages`) and a step's hidden rows
go from rank to rank through host memory the ranks share (signalled on a gloo group of the teacher's own),
outside the graphs; or, with `dit.teacher_sharded`, graphed and sharded over the ranks like any forward (the
all-to-alls captured with them).

`start` begins a request's teacher and returns a `TeacherRun` whose states the students wait for one by one. With
`overlap` (`dit.teacher_overlap`) and every step captured, a worker thread replays the graphs on the teacher's own
high-priority CUDA stream while the caller goes on with the previous phase's commit and the first student step,
which needs no teacher state; otherwise the steps run at once, on the caller's stream.
Knows nothing about video, the KV cache or sessions.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Callable, ContextManager, Sequence

import torch
import torch.distributed as dist

from services.common.startup import Steps
from services.tensors.cuda_graphs import CudaGraphBank, GraphKey, PromptBuckets
from services.dit.stream.geometry import TEACHER_TAIL_LATENTS, RequestPlan, plan_request, plans_of_every_shape
from services.dit.model.layout import PackedLayout, pack_layout, pad_prompt
from services.dit.model.lora import LoRAAdapter
from services.dit.model.network import DiT, FullAttention
from services.dit.stream.schedule import TEACHER_MILESTONES, TEACHER_SIGMAS, TEACHER_TEXT_SIGMAS, euler_step, model_t
from services.dit.stream.session import CancelToken
from services.dit.stream.shared_host import SharedHostRegion
from services.dit.stream.timeline import Timeline

log = logging.getLogger(__name__)

STEPS = len(TEACHER_SIGMAS) - 1


def request_audio_shapes() -> list[tuple[int, int]]:
    """Every (tail latents, new latents) per channel a teacher document takes: request 0, then the 198/199 cycle."""
    later = sorted({plan.num_audio_latents for plan in plans_of_every_shape()[1:]})
    return [(0, plan_request(0).num_audio_latents)] + [(TEACHER_TAIL_LATENTS, n) for n in later]


def step_layout(step: int, text_len: int, n_tail: int, num: int, pos_text: torch.Tensor, pos_audio: torch.Tensor,
                device: torch.device) -> PackedLayout:
    """Layout of teacher step `step`: the text at the step's video t (`TEACHER_TEXT_SIGMAS`), the tail rows at
    t = 1, the new rows at the step's audio t."""
    t, text_t = model_t(TEACHER_SIGMAS[step]), model_t(TEACHER_TEXT_SIGMAS[step])
    row_t = ([1.0] * n_tail + [t] * num) * 2
    return pack_layout(text_len=text_len, audio_len_per_channel=n_tail + num, video_rows=0,
                       positions_text=pos_text, positions_audio=pos_audio, positions_video=torch.zeros(0, 3),
                       video_t=text_t, text_t=text_t, audio_timesteps=row_t).to(device)


def step_forward(model: DiT, layout: PackedLayout, blocks: range | None = None, first: bool = True,
                 last: bool = True) -> Callable[..., torch.Tensor]:
    """`fn(x, text, positions, text_valid)` of one teacher step on `layout`, or of one stage of it: the blocks
    `blocks` (default all), from the audio rows `x` = `[Ta, 32]` when `first` (else from the hidden rows `[S, C]`
    the stage before returned), to the audio velocity `[Ta, 32]` when `last` (else to the hidden rows).

    Positions and the text mask change with every request, so they are inputs (static buffers of a graph).
    """
    blocks = range(len(model.blocks)) if blocks is None else blocks
    whole = first and last and blocks == range(len(model.blocks))

    def fn(x: torch.Tensor, text: torch.Tensor, positions: torch.Tensor, text_valid: torch.Tensor) -> torch.Tensor:
        # x: [Ta, 32] float32 or [S, C]; text: [Tt, text_dim], positions: [S, 3], text_valid: [Tt] bool
        lay = replace(layout, positions=positions, text_valid=text_valid)
        video = torch.zeros(0, model.args.video_row_dim, device=x.device)
        if whole:  # a whole step is one forward (its hooks see it)
            return model(video, x, text, lay, FullAttention(lay))[1]
        if first:
            x = model.embed(video, x, text, lay)
        x = model.run_blocks(x, lay, FullAttention(lay), blocks)
        return model.head(x, lay)[1] if last else x
    return fn


@dataclass(frozen=True)
class TeacherStages:
    """The teacher's blocks split over the ranks of `group`, one contiguous stage per rank (`dit.teacher_staged`).

    Every rank holds all the weights but runs only its own stage of each step: rank 0 the input projections and the
    first blocks, the last rank the last blocks, the head and the Euler step. Between stages the hidden rows are
    broadcast from the rank that made them, and the new audio state from the last rank; so every rank does 1/N of
    the teacher's work instead of all of it, and holds every state. The hand-overs run eagerly between the graph
    replays, through host memory every rank maps (`shared_host`), with a one-byte broadcast on a gloo `group` of the
    teacher's own to say the data is there: the teacher replays beside the students, whose all-to-alls run on the
    NCCL group, and NCCL forbids operations on two communicators that overlap (a second NCCL group here hung the DiT
    group on 2xH200). A hand-over of the full preset's 896-row document is 9.6 MB, which no longer crosses a socket.
    """

    group: "dist.ProcessGroup"
    rank: int
    world_size: int
    num_layers: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size or self.world_size > self.num_layers:
            raise ValueError(f"teacher stages: rank {self.rank} of {self.world_size} over {self.num_layers} blocks")

    def blocks(self, rank: int) -> range:
        """The blocks of `rank`'s stage: an even split, the first ranks taking one more when it does not divide."""
        per, extra = divmod(self.num_layers, self.world_size)
        start = rank * per + min(rank, extra)
        return range(start, start + per + (rank < extra))

    @property
    def last(self) -> int:
        return self.world_size - 1


class TeacherRun:
    """States 3, 6 and 9 of one request's teacher: `state(i)` waits for state i alone, so a student step runs as
    soon as the teacher state it needs is there."""

    def __init__(self) -> None:
        self._states: list[Future] = [Future() for _ in TEACHER_MILESTONES]
        self._seconds: Future = Future()

    def state(self, index: int) -> torch.Tensor:
        """Teacher state `TEACHER_MILESTONES[index]`, float32 `[2, A, 32]`, usable on the caller's stream."""
        state, ready = self._states[index].result()
        if ready is not None:  # produced on the teacher's stream: order the caller's stream after it
            stream = torch.cuda.current_stream(state.device)
            stream.wait_event(ready)
            state.record_stream(stream)
        return state

    @property
    def seconds(self) -> float:
        """Wall time of the teacher's steps (waits for the last one)."""
        return self._seconds.result()

    @property
    def failed(self) -> bool:
        """True once the steps raised; every `state()` not yet produced raises the same error."""
        return self._seconds.done() and self._seconds.exception() is not None

    def _publish(self, index: int, state: torch.Tensor, ready: "torch.cuda.Event | None") -> None:
        self._states[index].set_result((state, ready))

    def _finish(self, seconds: float) -> None:
        self._seconds.set_result(seconds)

    def _fail(self, exc: BaseException) -> None:
        for f in (self._seconds, *self._states):  # `failed` first: a caller woken by a state's error reads it
            if not f.done():
                f.set_exception(exc)


@dataclass
class _Document:
    """A request's teacher inputs on the device: the prompt (padded to its bucket with graphs), positions, noise."""

    text: torch.Tensor  # [L or bucket, text_dim]
    valid: torch.Tensor | None  # [bucket] bool, None unpadded
    pos_text: torch.Tensor  # [L or bucket, 3]
    pos_audio: torch.Tensor  # [2 * (n_tail + A), 3]
    noise: torch.Tensor  # [2, A, 32] float32
    tail: torch.Tensor | None  # [2, n_tail, 32] float32

    @property
    def n_tail(self) -> int:
        return 0 if self.tail is None else self.tail.shape[1]


class AudioTeacher:
    """Runs the base-model audio trajectory of one request."""

    def __init__(self, model: DiT, adapter: LoRAAdapter | None):
        self.model, self.adapter = model, adapter
        self.placement: Callable[[], ContextManager] = nullcontext
        """Where the teacher's forwards (and captures) run; sequence parallelism sets it (from outside) to run them
        whole on each rank."""
        self.stages: TeacherStages | None = None
        """With `dit.teacher_staged` (set from outside, before `capture_graphs`): this rank runs only its stage of
        every step; None runs whole steps."""
        self.graphs: CudaGraphBank | None = None
        """The captured steps (`capture_graphs`); None runs each step eagerly on the prompt's exact rows."""
        self.buckets: PromptBuckets | None = None
        """Prompt lengths the graphs were captured for (set with `graphs`)."""
        self.overlap = False
        """Replay the captured steps beside the caller (`start`); set from `dit.teacher_overlap`. Only for steps
        without collectives: a sharded teacher's all-to-alls must not interleave with the students'."""
        self._shared: dict[str, SharedHostRegion] = {}  # "hidden" / "state" -> the staged hand-overs' host memory
        self._signal = torch.zeros(1, dtype=torch.uint8)  # "it is in the shared region", from a hand-over's source
        self._stream: "torch.cuda.Stream | None" = None
        self._worker: ThreadPoolExecutor | None = None
        self._last: Future | None = None  # the latest run's end: runs never overlap each other (one graph pool)

    def _suspended(self) -> ContextManager:
        return self.adapter.suspended() if self.adapter is not None else nullcontext()

    def capture_graphs(self, buckets: PromptBuckets, audio_shapes: Sequence[tuple[int, int]] | None = None) -> None:
        """Record every step for every bucket and (tail, new) audio shape (default: every shape a session takes) as
        a CUDA graph (CPU: an eager bank), in `placement`. Sharded over a Ulysses group, every rank must call
        this at the same point: the captures run the all-to-alls."""
        audio_shapes = request_audio_shapes() if audio_shapes is None else audio_shapes
        dev = self.model.condition_proj.weight.device
        bank = CudaGraphBank(dev)
        a = self.model.args
        captured = Steps(log, f"teacher CUDA graphs ({STEPS} steps each)", len(buckets.sizes) * len(audio_shapes))
        with self._suspended(), self.placement(), torch.no_grad():
            for size in buckets.sizes:
                text = torch.zeros(size, a.text_dim, device=dev, dtype=self.model.dtype)
                valid = torch.ones(size, dtype=torch.bool, device=dev)
                for n_tail, num in audio_shapes:
                    doc = torch.zeros(2 * (n_tail + num), a.audio_channels, device=dev)
                    for step in range(STEPS):
                        layout = step_layout(step, size, n_tail, num, torch.zeros(size, 3),
                                             torch.zeros(2 * (n_tail + num), 3), dev)
                        inputs = self._stage_inputs(layout, [doc, text, layout.positions, valid])
                        bank.capture(_key(inputs, step, n_tail, num), self._step_fn(layout), inputs)
                    captured.tick(f"{size} text tokens, audio tail {n_tail} + {num}")
        bank.seal()
        self.graphs, self.buckets = bank, buckets

    def release_graphs(self) -> None:
        """Free the captured steps (before the process group is destroyed: sharded graphs hold its communicator);
        later requests run eagerly."""
        if self._last is not None:
            self._last.result()
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
        if self.graphs is not None:
            self.graphs.close()
        self.graphs = self.buckets = None

    def start(self, text: torch.Tensor, request: RequestPlan, timeline: Timeline, noise: torch.Tensor,
              tail: torch.Tensor | None, cancel: CancelToken) -> TeacherRun:
        """Begin the request's teacher (states 3, 6, 9 as float32 `[2, A, 32]` for the whole request).

        Beside the caller when `overlap` is set and every step of this document is captured: the graphs replay in a
        worker thread on the teacher's stream, without cancellation checks (under Ulysses those are collectives,
        which only the caller's thread may run; the steps are at most ~0.5 s). Otherwise the steps run now.
        """
        if self._last is not None:  # the previous run's steps may still be replaying (an abandoned request)
            self._last.result()
        run = TeacherRun()
        doc = self._document(text, request, timeline, noise, tail) if self.overlap else None
        if doc is None or not self._captured(doc):
            started = time.perf_counter()
            if self._stream is not None:  # graph replays on the teacher's stream happened before this one
                torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)
            states = self.run(text, request, timeline, noise, tail, cancel)
            _sync(states[-1].device)
            for i, state in enumerate(states):
                run._publish(i, state, None)
            run._finish(time.perf_counter() - started)
            return run
        dev = doc.noise.device
        if self._stream is None:
            self._stream = torch.cuda.Stream(dev, priority=-1)  # its steps first whenever both streams have work
            self._worker = ThreadPoolExecutor(1, "dit-teacher")
        self._stream.wait_stream(torch.cuda.current_stream(dev))  # the prompt and the tail were made on it
        self._last = self._worker.submit(self._beside, doc, run)
        return run

    def _beside(self, doc: _Document, run: TeacherRun) -> None:
        """Worker thread: replay the request's steps on the teacher's stream, publishing each state with an event."""
        started = time.perf_counter()
        try:
            with torch.cuda.device(self._stream.device), torch.cuda.stream(self._stream), torch.no_grad():
                def publish(index: int, state: torch.Tensor) -> None:
                    ready = torch.cuda.Event()
                    ready.record(self._stream)
                    run._publish(index, state, ready)
                self._steps(doc, None, publish, replay_only=True)
                self._stream.synchronize()
            run._finish(time.perf_counter() - started)
        except BaseException as exc:  # surfaces in the caller's state(); the worker thread goes on
            log.exception("teacher steps beside the students failed")
            run._fail(exc)

    def run(self, text: torch.Tensor, request: RequestPlan, timeline: Timeline, noise: torch.Tensor,
            tail: torch.Tensor | None, cancel: CancelToken) -> list[torch.Tensor]:
        """Return the teacher states 3, 6, 9 as float32 `[2, A, 32]` for the whole request, on this thread."""
        states: list[torch.Tensor] = []
        doc = self._document(text, request, timeline, noise, tail)
        with self._suspended(), self.placement(), torch.no_grad():
            self._steps(doc, cancel, lambda i, state: states.append(state), replay_only=False)
        return states

    def _document(self, text: torch.Tensor, request: RequestPlan, timeline: Timeline, noise: torch.Tensor,
                  tail: torch.Tensor | None) -> _Document:
        # text: [L, text_dim]; noise: [2, A, 32]; tail: [2, 40, 32] clean audio of the previous request or None
        n_tail = 0 if tail is None else tail.shape[1]
        dev = self.model.condition_proj.weight.device
        pos_text, pos_audio = timeline.teacher(request, text.shape[0], n_tail)  # [L, 3], [2 * (n_tail + A), 3]
        valid = None
        if self.graphs is not None:  # pad to the bucket: [L, text_dim] -> [B, text_dim], positions [B, 3]
            text, pos_text, valid = pad_prompt(self.buckets, text, pos_text)
            valid = valid.to(dev)  # [B] bool
        return _Document(text, valid, pos_text, pos_audio, noise.float().to(dev),
                         None if tail is None else tail.float().to(dev))

    def _inputs(self, doc: _Document, step: int, x: torch.Tensor) -> tuple[PackedLayout, list[torch.Tensor]]:
        """Layout and graph inputs of `step` at audio state `x` `[2, A, 32]`."""
        layout = step_layout(step, doc.text.shape[0], doc.n_tail, x.shape[1], doc.pos_text, doc.pos_audio,
                             x.device)
        rows = x if doc.tail is None else torch.cat([doc.tail, x], dim=1)  # [2, n_tail + A, 32]
        return layout, [rows.reshape(-1, x.shape[2]), doc.text, layout.positions, doc.valid]

    def _step_fn(self, layout: PackedLayout) -> Callable[..., torch.Tensor]:
        """This rank's part of a step on `layout`: the whole step, or its stage of it."""
        st = self.stages
        if st is None:
            return step_forward(self.model, layout)
        return step_forward(self.model, layout, st.blocks(st.rank), first=st.rank == 0, last=st.rank == st.last)

    def _stage_inputs(self, layout: PackedLayout, inputs: list[torch.Tensor],
                      hidden: torch.Tensor | None = None) -> list[torch.Tensor]:
        """This rank's step inputs: `inputs` on the first stage; after it, the hidden rows `[S, C]` from the stage
        before (zeros of their shape when `hidden` is None: for a capture or a key) instead of the audio rows."""
        if self.stages is None or self.stages.rank == 0:
            return inputs
        if hidden is None:
            hidden = torch.zeros(layout.seq_len, self.model.args.hidden_size, dtype=self.model.dtype,
                                 device=inputs[1].device)
        return [hidden, *inputs[1:]]

    def _captured(self, doc: _Document) -> bool:
        """Whether every step of this document has a graph (a miss would run eagerly, which needs `run`)."""
        if self.graphs is None or not self.graphs.enabled:
            return False
        layout, inputs = self._inputs(doc, 0, doc.noise)  # every step's inputs have step 0's shapes
        inputs = self._stage_inputs(layout, inputs)
        return all(_key(inputs, step, doc.n_tail, doc.noise.shape[1]) in self.graphs for step in range(STEPS))

    def _steps(self, doc: _Document, cancel: CancelToken | None, publish: Callable[[int, torch.Tensor], None],
               replay_only: bool) -> None:
        """The 9 Euler steps; `publish(i, state)` after each milestone. `replay_only` never runs a step eagerly."""
        x = doc.noise  # [2, A, 32]
        for i in range(STEPS):
            if cancel is not None:
                cancel.check()
            layout, inputs = self._inputs(doc, i, x)
            if self.stages is None:
                x = self._euler(doc, i, x, self._forward(doc, i, layout, inputs, replay_only))
            else:
                x = self._staged_step(doc, i, x, layout, inputs, replay_only)
            if i + 1 in TEACHER_MILESTONES:
                publish(TEACHER_MILESTONES.index(i + 1), x.clone())

    def _forward(self, doc: _Document, step: int, layout: PackedLayout, inputs: list[torch.Tensor],
                 replay_only: bool) -> torch.Tensor:
        """This rank's part of `step` (see `_step_fn`) on `inputs`: its graph replayed, or eagerly."""
        if self.graphs is None:
            return self._step_fn(layout)(*inputs)
        key = _key(inputs, step, doc.n_tail, doc.noise.shape[1])
        if replay_only:
            return self.graphs.replay(key, inputs)
        return self.graphs.run(key, self._step_fn(layout), inputs)

    def _staged_step(self, doc: _Document, step: int, x: torch.Tensor, layout: PackedLayout,
                     inputs: list[torch.Tensor], replay_only: bool) -> torch.Tensor:
        """One step over the stages: each rank runs its stage when the hidden rows reach it; the last rank's new
        state `[2, A, 32]` goes to every rank."""
        st = self.stages
        out = hidden = None
        for r in range(st.world_size):
            if r == st.rank:
                out = self._forward(doc, step, layout, self._stage_inputs(layout, inputs, hidden), replay_only)
            if r < st.last:  # stage r's hidden rows [S, C] to every rank (the next stage takes them)
                hidden = self._hand_over("hidden", out, (layout.seq_len, self.model.args.hidden_size),
                                         self.model.dtype, x.device, src=r, keep=r + 1 == st.rank)
        new = self._euler(doc, step, x, out) if st.rank == st.last else None
        return self._hand_over("state", new, tuple(x.shape), x.dtype, x.device, src=st.last, keep=True)

    def _hand_over(self, kind: str, t: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype,
                   device: torch.device, src: int, keep: bool) -> torch.Tensor | None:
        """Hand `t` (given on rank `src` only) to every rank of the stages' group: `src` writes it into the `kind`
        region of host memory all the ranks map, then a one-byte broadcast on the group says it is there; returns
        it on `device` where `keep` (None elsewhere).

        The write waits for `t`'s stage. A rank reads (a blocking copy) before it takes part in the next hand-over,
        and every write of a region follows, through the chain of hand-overs, the reads of what it held before; so
        one region per kind is never overwritten while a rank still needs it."""
        st = self.stages
        region = self._shared.get(kind)
        if region is None:
            region = self._shared[kind] = SharedHostRegion(st.group, st.rank, device, f"teacher-{kind}")
        host = region.view(shape, dtype)
        if st.rank == src:
            host.copy_(t)
        dist.broadcast(self._signal, group=st.group, group_src=src)
        if st.rank == src:
            return t
        return host.to(device, copy=True) if keep else None

    @staticmethod
    def _euler(doc: _Document, step: int, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The state after `step` from the step's output `out` `[2 * (n_tail + A), 32]` (tail rows dropped)."""
        v = out.reshape(2, doc.n_tail + x.shape[1], x.shape[2])[:, doc.n_tail:]  # [2, A, 32]
        return euler_step(x, v, TEACHER_SIGMAS[step], TEACHER_SIGMAS[step + 1])


def _key(inputs: Sequence[torch.Tensor], step: int, n_tail: int, num: int) -> GraphKey:
    """The graph of teacher step `step` for these inputs, tail and new audio latents per channel (a later stage's
    inputs are padded rows, the same for documents of a few latents more or less)."""
    return GraphKey.for_inputs("teacher", inputs, tag=(step, n_tail, num))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
