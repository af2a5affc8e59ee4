"""The gateway's backend over gRPC: encoder → DiT → VAE, orchestrated per session.

Tensors cross this module as opaque `TensorPart` messages: they are read from one stage's stream and
written to the next unchanged, so the gateway never imports torch. Knows nothing about websockets.

Per session:
- `Encode` turns the first prompt (and the hold fallback prompt, if any) into embedding parts;
- one `DiT.Stream` call receives the start, the prompts and later prompt updates and sends back, per phase,
  a meta record, the video and audio latent parts and a phase end;
- one `VAE.Decode` call receives those latents phase by phase and returns one fMP4 chunk per phase.
A pump task forwards DiT output to the VAE while `chunks()` reads the VAE, so the DiT works on phase k+1
while the VAE decodes phase k. Flow control: `chunks()` acks each phase to the DiT (`PhaseAck`) once the VAE
has returned its chunk, and the DiT stays at most `dit.max_phases_ahead` unacked phases ahead.

Stop: `cancel()` cancels the DiT call, lets the pump finish and closes the VAE's request stream; the VAE then
returns the chunks of the phases it already has and the muxer's closing bytes, which `chunks()` yields as a
`kind="trailer"` chunk before it ends. A VAE that does not finish within `drain_timeout_s` is cancelled.

Transport handshake: the gateway asks the VAE once for its `TransportHello` (`vitascope.common.v1.Transport/Hello`,
cached; asked again after the VAE was seen down) and puts it in `SessionStart.consumer`, so the DiT can choose CUDA
IPC or host bytes for the latents. The VAE gives each CUDA IPC slot back in `DecodeResponse.release_video` /
`release_audio`; `chunks()` relays them into the DiT stream as `StreamRequest.release`, before that phase's ack.
A VAE without the Hello RPC, or `cuda_ipc=False`, gets an empty hello: host bytes.
Likewise the DiT's hello goes to the encoder in `EncodeRequest.consumer`; an embedding sent as a CUDA IPC part
holds a slot of the encoder's pool until the DiT reports it copied out (`StreamResponse.prompt_release`), which the
pump passes on to the encoder's `Release`; the slots of embeddings the DiT never took (a session that failed to
open, an update that could not be written, a DiT stream that ended) are given back by the gateway itself.

Trace context: `start()` opens a new trace per session (services/common/tracing.py). Its root span goes to
the DiT and VAE calls as `traceparent` metadata, each prompt encode sends a child span in
`EncodeRequest.trace`, and each phase's span, made by the DiT in `PhaseMeta.trace`, is forwarded to the VAE in
`PhaseEnd.trace` and logged with the chunk (`trace_id`, `span_id`).
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import AsyncIterator

import grpc

from services.common import tracing
from services.common.grpc_server import CHANNEL_OPTIONS, HEALTH_NAMES
from services.common.host_identity import process_hello
from services.common.media import AUDIO_SAMPLE_RATE, PHASES_PER_REQUEST
from services.gateway.pipeline import (
    BackendBusy,
    BackendFailed,
    BackendUnavailable,
    InvalidRequest,
    MediaChunk,
    Pipeline,
    PipelineError,
    PipelineSession,
    SessionRequest,
    StageTimings,
)
from services.gateway.stage_health import StageHealth
from vitascope.common.v1 import tensor_pb2, transport_pb2, transport_pb2_grpc
from vitascope.dit.v1 import dit_pb2, dit_pb2_grpc
from vitascope.encoder.v1 import encoder_pb2, encoder_pb2_grpc
from vitascope.vae.v1 import vae_pb2, vae_pb2_grpc

log = logging.getLogger(__name__)


def release_of(part: tensor_pb2.TensorPart) -> tensor_pb2.Release:
    """The `Release` that gives a CUDA IPC part's slot back to its producer."""
    ref = part.cuda
    return tensor_pb2.Release(pool_id=ref.pool_id, slot=ref.slot, generation=ref.generation)


def decode_seconds(reply: vae_pb2.DecodeResponse) -> float:
    """The VAE's time on a phase: its audio decodes beside its video, so the larger of the two."""
    return max(reply.video_decode_seconds, reply.audio_decode_seconds)


def pipeline_error(stage: str, exc: grpc.RpcError, during_session: bool = False) -> PipelineError:
    """Map a stage's gRPC status to the gateway's error kinds (the one mapping point). `during_session`: the call
    broke while the session ran, so a stage that became unreachable failed it (`backend_failed`, naming the stage)
    rather than being unavailable to a new one."""
    code, detail = exc.code(), exc.details() or ""
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidRequest(f"{stage}: {detail}")
    if during_session:
        return BackendFailed(f"the {stage} stage failed during the session ({code.name}): {detail}")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return BackendBusy(f"{stage}: {detail}")
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return BackendUnavailable(f"{stage} unavailable: {detail}")
    return BackendFailed(f"{stage} failed ({code.name}): {detail}")


class GrpcPipeline(Pipeline):
    """Connects to the three stage services; one channel per stage, shared by all sessions."""

    def __init__(self, encoder_addr: str, dit_addr: str, vae_addr: str, drain_timeout_s: float = 5.0,
                 cuda_ipc: bool = True):
        if drain_timeout_s <= 0:
            raise ValueError(f"drain_timeout_s={drain_timeout_s}: must be > 0")
        self.drain_timeout_s = drain_timeout_s
        """After cancel(): how long the VAE may take to return its last chunks and the trailer."""
        self.cuda_ipc = cuda_ipc
        """Hand the VAE's hello to the DiT and the DiT's to the encoder (CUDA IPC where two stages share a GPU);
        False: empty hellos, always host bytes."""
        self._hellos: dict[str, tensor_pb2.TransportHello] = {}
        self._own_hello = process_hello()  # names this gateway to the encoder as the caller of its embeddings
        self._channels = {
            name: grpc.aio.insecure_channel(addr, options=CHANNEL_OPTIONS)
            for name, addr in (("encoder", encoder_addr), ("dit", dit_addr), ("vae", vae_addr))
        }
        self.encoder = encoder_pb2_grpc.EncoderStub(self._channels["encoder"])
        self.dit = dit_pb2_grpc.DiTStub(self._channels["dit"])
        self.vae = vae_pb2_grpc.VAEStub(self._channels["vae"])
        # a stage that went down may come back as another process: its hello (pid, GPUs) is asked again
        self.stage_health = StageHealth(self._channels, HEALTH_NAMES, on_down=lambda name: self._hellos.pop(name, None))

    async def health(self) -> bool:
        """True when every stage reports its named service SERVING (as the health watches last saw it)."""
        self.stage_health.start()
        return not self.stage_health.down()

    def stages_down(self) -> list[str]:
        """The stages not SERVING now."""
        self.stage_health.start()
        return self.stage_health.down()

    async def wait_ready(self, timeout_s: float) -> list[str]:
        """Wait up to `timeout_s` for every stage to serve; the stages still down."""
        self.stage_health.start()
        return await self.stage_health.wait_ready(timeout_s)

    async def transport_hello(self, name: str) -> tensor_pb2.TransportHello:
        """The `TransportHello` of stage `name` (cached); empty (host bytes) when IPC is off or the stage has no
        Hello RPC or cannot be asked right now."""
        if not self.cuda_ipc:
            return tensor_pb2.TransportHello()
        hello = self._hellos.get(name)
        if hello is None:
            stub = transport_pb2_grpc.TransportStub(self._channels[name])
            try:
                hello = await stub.Hello(transport_pb2.HelloRequest(), timeout=2)
            except grpc.RpcError as exc:
                log.info("%s: no transport hello (%s): host bytes", name, exc.code().name)
                return tensor_pb2.TransportHello()
            log.info("%s transport hello: pid %d, %d GPU(s)", name, hello.pid, len(hello.gpu_uuids))
            self._hellos[name] = hello
        return hello

    async def encode(self, session_id: str, prompt: str,
                     span: tracing.SpanContext | None = None) -> tuple[list, float]:
        """Embedding parts of one prompt and the seconds the encoder took (`span`: this encode's span). A CUDA IPC
        part holds an encoder slot: whoever drops it unsent must `release_embeddings` it."""
        parts, seconds = [], 0.0
        trace = tensor_pb2.TraceContext(traceparent=span.traceparent if span is not None else "")
        request = encoder_pb2.EncodeRequest(session_id=session_id, prompt=prompt, trace=trace,
                                            consumer=await self.transport_hello("dit"), caller=self._own_hello)
        try:
            async for reply in self.encoder.Encode(request):
                parts.append(reply.embedding)
                seconds = reply.encode_seconds or seconds
        except grpc.RpcError as exc:
            await self.release_embeddings(parts)
            raise pipeline_error("encoder", exc) from None
        except BaseException:  # a cancel between two parts: nobody else will give back the ones already here
            await asyncio.shield(self.release_embeddings(parts))
            raise
        return parts, seconds

    async def release_embeddings(self, parts: list) -> None:
        """Give the encoder back the CUDA IPC slots of embedding parts (host parts hold none). A release the encoder
        refuses (stale: it restarted, or the slot was already given back) is logged, not raised."""
        for part in parts:
            if part.WhichOneof("where") == "cuda":
                await self.release_embedding(release_of(part))

    async def release_embedding(self, release: tensor_pb2.Release) -> None:
        """Give one encoder slot back (see `release_embeddings`)."""
        try:
            await self.encoder.Release(release, timeout=2)
        except grpc.RpcError as exc:
            log.info("encoder slot %d not given back: %s", release.slot, exc.details() or exc.code().name)

    async def start(self, request: SessionRequest) -> PipelineSession:
        """Encode the first prompt, open the DiT and VAE streams, and wait for the DiT to accept."""
        trace = tracing.SpanContext.new_root()
        log.info("session %s: trace %s", request.request_id, trace.trace_id, extra=trace.log_fields())
        parts, text_seconds = await self.encode(request.request_id, request.prompt, trace.child())
        fallback = None
        try:
            if request.hold.enabled and request.hold.fallback_prompt:
                fallback, _ = await self.encode(request.request_id, request.hold.fallback_prompt, trace.child())
            session = GrpcSession(self, request, text_seconds, trace, await self.transport_hello("vae"))
            await session.open(parts, fallback)
        except BaseException:  # the DiT gives back no prompt slot of a session that did not start: do it here
            await asyncio.shield(self.release_embeddings(parts + (fallback or [])))
            raise
        return session

    async def close(self) -> None:
        """Stop watching the stages and close every channel."""
        await self.stage_health.close()
        for channel in self._channels.values():
            await channel.close()


class GrpcSession(PipelineSession):
    """One session's DiT and VAE calls and the pump between them."""

    def __init__(self, pipeline: GrpcPipeline, request: SessionRequest, text_seconds: float,
                 trace: tracing.SpanContext, vae_hello: tensor_pb2.TransportHello | None = None):
        self.pipeline = pipeline
        self.request = request
        self.vae_hello = vae_hello or tensor_pb2.TransportHello()  # goes to the DiT in SessionStart.consumer
        self.trace = trace  # the session's root span; the DiT's phase spans are its children
        self._text_seconds = {"": text_seconds}
        """Encode seconds by event id ("": the first prompt), reported on the chunk whose request installs it."""
        self._metas: collections.deque = collections.deque()
        self._dit_call = None
        self._vae_call = None
        self._pump: asyncio.Task | None = None
        self._dit_lock = asyncio.Lock()
        self._cancelled = False
        self._drain_timer: asyncio.TimerHandle | None = None
        self._last_meta: dit_pb2.PhaseMeta | None = None
        self._prompt_slots: dict[tuple[str, int, int], tensor_pb2.Release] = {}  # sent to the DiT, not yet copied

    async def open(self, parts: list, fallback: list | None) -> None:
        """Send start and prompts to the DiT and wait for its `started` reply; open the VAE stream."""
        req = self.request
        self._dit_call = self.pipeline.dit.Stream(metadata=tracing.to_metadata(self.trace))
        try:
            await self._open_calls(parts, fallback)
        except BaseException:  # an error or a cancel (client gone, start timeout): end both calls now
            self._abort()
            raise
        self._pump = asyncio.create_task(self._pump_dit_to_vae(), name=f"pump-{req.request_id}")

    async def _open_calls(self, parts: list, fallback: list | None) -> None:
        """The DiT handshake, then the VAE start (the caller cancels both calls if this fails)."""
        req = self.request
        hold = dit_pb2.Hold(enabled=req.hold.enabled, max_seconds=req.hold.max_seconds,
                            has_fallback_prompt=fallback is not None)
        try:
            await self._dit_call.write(dit_pb2.StreamRequest(start=dit_pb2.SessionStart(
                session_id=req.request_id, seed=req.seed, width=req.width, height=req.height, hold=hold,
                consumer=self.vae_hello, max_requests=req.max_requests)))
            await self._write_prompt("", parts, dit_pb2.PROMPT_ROLE_ACTIVE)
            if fallback is not None:
                await self._write_prompt("", fallback, dit_pb2.PROMPT_ROLE_FALLBACK)
            first = await self._dit_call.read()
        except grpc.RpcError as exc:
            raise pipeline_error("dit", exc) from None
        if first is grpc.aio.EOF or first.WhichOneof("kind") != "started":
            raise BackendFailed("dit: stream closed before the session started")
        self._vae_call = self.pipeline.vae.Decode(metadata=tracing.to_metadata(self.trace))
        try:
            await self._vae_call.write(vae_pb2.DecodeRequest(start=vae_pb2.DecodeStart(
                session_id=req.request_id, width=req.width, height=req.height, fps=req.fps,
                sample_rate=AUDIO_SAMPLE_RATE)))
        except grpc.RpcError as exc:
            raise pipeline_error("vae", exc) from None

    async def _write_prompt(self, event_id: str, parts: list, role: int) -> None:
        async with self._dit_lock:
            for part in parts:
                await self._dit_call.write(dit_pb2.StreamRequest(
                    prompt=dit_pb2.PromptPart(event_id=event_id, role=role, embedding=part)))
                if part.WhichOneof("where") == "cuda":
                    ref = part.cuda
                    self._prompt_slots[(ref.pool_id, ref.slot, ref.generation)] = release_of(part)
        if self._pump is not None and self._pump.done():  # the DiT stream ended meanwhile: it will not copy it
            await self._release_prompt_slots()

    async def _prompt_copied(self, release: tensor_pb2.Release) -> None:
        """The DiT copied an embedding out of the encoder's pool: give the slot back to the encoder."""
        self._prompt_slots.pop((release.pool_id, release.slot, release.generation), None)
        await self.pipeline.release_embedding(release)

    async def _release_prompt_slots(self) -> None:
        """Give the encoder back every slot of an embedding the DiT has not reported copied (its stream ended)."""
        releases, self._prompt_slots = list(self._prompt_slots.values()), {}
        for release in releases:
            await self.pipeline.release_embedding(release)

    async def _pump_dit_to_vae(self) -> None:
        """Forward each phase's latents from the DiT stream to the VAE stream."""
        try:
            while (reply := await self._dit_call.read()) is not grpc.aio.EOF:
                kind = reply.WhichOneof("kind")
                if kind == "meta":
                    self._metas.append(reply.meta)
                elif kind == "video":
                    await self._vae_call.write(vae_pb2.DecodeRequest(video=reply.video))
                elif kind == "audio":
                    await self._vae_call.write(vae_pb2.DecodeRequest(audio=reply.audio))
                elif kind == "phase_end":
                    meta = self._metas[-1]
                    await self._vae_call.write(vae_pb2.DecodeRequest(phase_end=vae_pb2.PhaseEnd(
                        request_index=meta.request_index, phase_index=meta.phase_index, trace=meta.trace)))
                    if self._ends_budget(meta):  # nothing past the budget reaches the VAE, whatever the DiT sends
                        return
                elif kind == "prompt_release":
                    await self._prompt_copied(reply.prompt_release)
        finally:
            with contextlib.suppress(grpc.RpcError, asyncio.InvalidStateError):
                await self._vae_call.done_writing()
            await asyncio.shield(self._release_prompt_slots())

    async def chunks(self) -> AsyncIterator[MediaChunk]:
        """Yield the phases' MediaChunks in order (one per phase, three for the first: the VAE sends its first 5
        frames and the rest of its first clip apart) until the session ends; after cancel(), the chunks the VAE
        still returns and then its trailer (kind="trailer"). A phase is acked to the DiT when its last chunk is in."""
        data, phase_begun = bytearray(), False  # phase_begun: an earlier chunk held part of this phase
        try:
            while (reply := await self._vae_call.read()) is not grpc.aio.EOF:
                for field in ("release_video", "release_audio"):
                    if reply.HasField(field):
                        await self._relay_release(getattr(reply, field))
                data += reply.data
                end = reply.WhichOneof("end")
                if end is None:  # more parts of this chunk follow
                    continue
                if end == "trailer":  # the last message the VAE sends
                    yield self._trailer(bytes(data), reply)
                    data = bytearray()
                    continue
                meta = self._metas[0]
                first_part = not phase_begun  # a phase's event ids, text and DiT seconds ride on its first chunk
                phase_continues = end == "phase_continues"
                if not phase_continues:  # the phase is delivered: the DiT may run one more ahead
                    self._last_meta = self._metas.popleft()
                    await self._ack(meta)
                text_seconds = 0.0
                if first_part and meta.first_of_request:
                    installed = [""] if meta.request_index == 0 else []
                    text_seconds = sum(self._text_seconds.pop(e, 0.0)
                                       for e in installed + list(meta.completed_event_ids))
                self._log_chunk(meta, reply, len(data))
                yield MediaChunk(
                    data=bytes(data), request_index=meta.request_index, phase_index=meta.phase_index,
                    num_frames=reply.num_frames, num_audio_samples=reply.num_audio_samples,
                    audio_sample_rate=meta.audio_sample_rate or AUDIO_SAMPLE_RATE,
                    started_event_ids=tuple(meta.started_event_ids) if first_part else (),
                    active_event_ids=tuple(meta.active_event_ids),
                    completed_event_ids=tuple(meta.completed_event_ids) if first_part else (),
                    timings=StageTimings(text=text_seconds,
                                         dit=sum(meta.stage_seconds.values()) if first_part else 0.0,
                                         vae=decode_seconds(reply),
                                         mux=reply.mux_seconds),
                    phase_continues=phase_continues)
                data, phase_begun = bytearray(), phase_continues
        except asyncio.CancelledError:
            # Our own cancel of the VAE call (the drain timed out) surfaces here as CancelledError: end the
            # stream normally, unless this task itself is being cancelled.
            if self._cancelled and asyncio.current_task().cancelling() == 0:
                return
            raise
        except grpc.RpcError as exc:
            if self._cancelled and exc.code() == grpc.StatusCode.CANCELLED:
                return
            raise pipeline_error("vae", exc, during_session=True) from None
        finally:
            self._abort_vae()  # whoever stops reading ends the VAE call (a no-op once it has finished)
        if self._pump is not None and self._pump.done() and not self._cancelled:
            exc = self._pump.exception()
            if isinstance(exc, grpc.RpcError):
                raise pipeline_error("dit", exc, during_session=True)
            if exc is not None:
                raise BackendFailed(f"dit → vae forwarding failed: {exc}")

    def _ends_budget(self, meta: dit_pb2.PhaseMeta) -> bool:
        """True when `meta` is the last phase of the session's frame budget."""
        budget = self.request.max_requests
        return bool(budget) and meta.request_index >= budget - 1 and meta.phase_index == PHASES_PER_REQUEST - 1

    def _trailer(self, data: bytes, reply: vae_pb2.DecodeResponse) -> MediaChunk:
        """The stream's closing bytes (the decoder's held-back last frames and audio, the muxer's closing
        fragment), labelled with the last phase delivered before them and the VAE's frame and sample counts."""
        meta = self._last_meta
        log.info("trailer received (%d bytes, %d frames, %d audio samples)", len(data), reply.num_frames,
                 reply.num_audio_samples)
        return MediaChunk(data=data, request_index=meta.request_index if meta else 0,
                          phase_index=meta.phase_index if meta else 0, num_frames=reply.num_frames,
                          num_audio_samples=reply.num_audio_samples,
                          audio_sample_rate=(meta.audio_sample_rate if meta else 0) or AUDIO_SAMPLE_RATE,
                          kind="trailer")

    async def _relay_release(self, release: tensor_pb2.Release) -> None:
        """Give a CUDA IPC slot the VAE has finished with back to the DiT. A DiT call that already ended took its
        slots back itself, so a release that cannot be sent is not an error."""
        await self._write_dit(dit_pb2.StreamRequest(release=release), f"release of slot {release.slot}")

    async def _ack(self, meta: dit_pb2.PhaseMeta) -> None:
        """Tell the DiT this phase is decoded (flow control). A DiT call that already ended is not an error
        here: the pump reports how the DiT stream ended."""
        ack = dit_pb2.StreamRequest(ack=dit_pb2.PhaseAck(request_index=meta.request_index,
                                                        phase_index=meta.phase_index))
        await self._write_dit(ack, f"ack {meta.request_index}.{meta.phase_index}")

    async def _write_dit(self, message: dit_pb2.StreamRequest, what: str) -> None:
        """Write one flow-control message to the DiT unless the session was cancelled or the call has ended."""
        if self._cancelled:
            return
        try:
            async with self._dit_lock:
                if not self._cancelled:
                    await self._dit_call.write(message)
        except (grpc.RpcError, asyncio.InvalidStateError) as exc:
            log.debug("%s not sent: %s", what, exc)
        except asyncio.CancelledError:
            # Writing to a call cancelled meanwhile raises CancelledError; only our own task's cancel propagates.
            if asyncio.current_task().cancelling():
                raise

    def _log_chunk(self, meta: dit_pb2.PhaseMeta, reply: vae_pb2.DecodeResponse, byte_length: int) -> None:
        """One line per chunk with the DiT phase's span (or the session's when the DiT sent none)."""
        try:
            span = tracing.parse_optional(meta.trace.traceparent) or self.trace
        except tracing.TraceContextError as exc:  # logging must never fail the session
            log.warning("chunk %d: DiT sent a bad trace context: %s", reply.chunk_index, exc)
            span = self.trace
        log.info("chunk %d received (%d.%d, %d bytes)", reply.chunk_index, meta.request_index,
                 meta.phase_index, byte_length,
                 extra={"chunk_index": reply.chunk_index, "request_index": meta.request_index,
                        "phase_index": meta.phase_index, **span.log_fields(),
                        "dit_s": round(sum(meta.stage_seconds.values()), 4),
                        "vae_s": round(decode_seconds(reply), 4),
                        "mux_s": round(reply.mux_seconds, 4)})

    async def update_prompt(self, event_id: str, prompt: str) -> None:
        """Encode the new prompt and send it to the DiT, which installs it at the next request."""
        if self._cancelled:
            raise InvalidRequest("the session has ended")
        started = time.perf_counter()
        parts, _ = await self.pipeline.encode(self.request.request_id, prompt, self.trace.child())
        self._text_seconds[event_id] = time.perf_counter() - started
        try:
            await self._write_prompt(event_id, parts, dit_pb2.PROMPT_ROLE_ACTIVE)
        except grpc.RpcError as exc:  # the parts never reached the DiT: their encoder slots go back from here
            self._text_seconds.pop(event_id, None)  # never installed: no chunk reports its encode
            await self.pipeline.release_embeddings(parts)
            raise pipeline_error("dit", exc) from None
        except asyncio.InvalidStateError:  # grpc.aio: writing to a call that has finished or half-closed
            self._text_seconds.pop(event_id, None)
            await self.pipeline.release_embeddings(parts)
            raise BackendFailed("dit: the session's stream has already ended") from None
        except BaseException:  # cancelled mid-write: the parts not yet written go back from here
            self._text_seconds.pop(event_id, None)
            unsent = [p for p in parts if p.WhichOneof("where") == "cuda" and (
                p.cuda.pool_id, p.cuda.slot, p.cuda.generation) not in self._prompt_slots]
            await asyncio.shield(self.pipeline.release_embeddings(unsent))
            raise

    async def cancel(self) -> None:
        """Stop generating and let the VAE finish: cancel the DiT call, wait for the pump to forward what it has
        and close the VAE's request stream. `chunks()` then yields the chunks the VAE still returns and the
        muxer's trailer, and ends; the VAE call is cancelled if that takes longer than the drain timeout.
        A second call cancels the VAE call at once. The stages release the session's KV cache and muxer."""
        if self._cancelled:
            self._abort_vae()
            return
        self._cancelled = True
        if self._dit_call is not None:
            self._dit_call.cancel()
        timeout = self.pipeline.drain_timeout_s
        if self._pump is None:  # never started streaming: nothing to drain
            self._abort_vae()
            return
        self._drain_timer = asyncio.get_running_loop().call_later(timeout, self._drain_timed_out)
        done, _ = await asyncio.wait({self._pump}, timeout=timeout)
        if not done:  # stuck writing to the VAE
            self._pump.cancel()
        with contextlib.suppress(asyncio.CancelledError, grpc.RpcError, asyncio.InvalidStateError):
            await self._pump

    def _drain_timed_out(self) -> None:
        if self._vae_call is not None and not self._vae_call.done():
            log.warning("session %s: the VAE did not finish within %.1f s of cancel; cancelling it",
                        self.request.request_id, self.pipeline.drain_timeout_s)
            self._vae_call.cancel()

    def _abort_vae(self) -> None:
        if self._drain_timer is not None:
            self._drain_timer.cancel()
        if self._vae_call is not None:
            self._vae_call.cancel()  # a no-op on a finished call

    def _abort(self) -> None:
        """Cancel both calls at once (a session that failed to open)."""
        self._cancelled = True
        for call in (self._dit_call, self._vae_call):
            if call is not None:
                call.cancel()
