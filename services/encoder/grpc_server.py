"""gRPC mapping of the encoder stage: EncodeRequest ⇄ EncoderService.encode. Nothing else lives here.

Transport: `EncodeRequest.consumer` carries the DiT's `TransportHello` (the gateway asks the DiT's
`Transport/Hello`). When the encoder runs on CUDA and the handshake picks CUDA IPC, the embedding goes as one
`TensorPart(cuda=...)` leased from the one pool this process exports (created on the first such request); the slot
comes back through the `Release` RPC (the DiT emits `StreamResponse.prompt_release` once it has copied the embedding
out and the gateway passes it on, or the gateway gives back what a session that ended never had copied). A stale or
unknown release is INVALID_ARGUMENT. Otherwise, and for an embedding that does not fit, host-byte parts. A gateway
that exits cannot pass its releases on: each lease remembers the caller (`EncodeRequest.caller`), and when the pool
runs out the leases of callers on this machine that are gone are taken back first (`CallerLeases`).

Observability: each call logs with `session_id` and the caller's span from `EncodeRequest.trace` (a new trace
when absent), and records its seconds as stage `text`. Prompts are logged by length and hash only.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
from typing import Callable

import grpc

from services.common import tracing
from services.common.config import EncoderConfig
from services.tensors.cuda_ipc import IpcError, IpcProducer
from services.common.errors import abort_with
from services.common.host_identity import pids_comparable, process_alive
from services.common.logging_setup import log_context
from services.common.metrics import IPC_LEASED_SLOTS, STAGE_LATENCY, record_gpu_memory
from services.common.threads import run_on
from services.tensors.stage_transport import IpcExporter, register_transport, sender
from services.encoder.service import EncoderService
from vitascope.common.v1 import tensor_pb2
from vitascope.encoder.v1 import encoder_pb2, encoder_pb2_grpc

log = logging.getLogger(__name__)

CONSUMER = "dit"
"""The peer label of the embeddings' consumer in the transport metrics."""


def prompt_fields(prompt: str) -> dict[str, object]:
    """What may be logged about a prompt: its length and a short hash, never the text."""
    return {"prompt_chars": len(prompt), "prompt_sha256": hashlib.sha256(prompt.encode()).hexdigest()[:12]}


def embedding_exporter(cfg: EncoderConfig) -> IpcExporter:
    """The process's CUDA IPC exporter of embeddings to the DiT, from the profile (a pool on `encoder.device`)."""
    return IpcExporter(cfg.device, cfg.ipc_slot_mib << 20, cfg.ipc_slots, CONSUMER, enabled=cfg.cuda_ipc)


class CallerLeases:
    """Which caller each embedding slot out by CUDA IPC was sent to, so the slots of a caller that exited without
    passing their releases on come back (only callers on this machine's boot: their pids can be asked)."""

    def __init__(self, local: tensor_pb2.TransportHello, alive: Callable[[int], bool] = process_alive):
        self.local, self._alive = local, alive
        self._caller: dict[tuple[int, int], int] = {}  # (slot, generation) -> caller pid

    def sent(self, part: tensor_pb2.TensorPart, caller: tensor_pb2.TransportHello) -> None:
        """Remember the caller of an IPC part (a host part, or a caller whose pid means nothing here: of another
        machine or PID namespace, or unnamed: nothing)."""
        if part.WhichOneof("where") == "cuda" and caller.pid > 0 and pids_comparable(self.local, caller):
            self._caller[(part.cuda.slot, part.cuda.generation)] = caller.pid

    def released(self, message: tensor_pb2.Release) -> None:
        self._caller.pop((message.slot, message.generation), None)

    def take_back_exited(self, producer: IpcProducer) -> int:
        """When every slot is out: free the leases of callers that have exited; returns how many came back.

        Only a full pool is searched, and a freed slot is reused last (the ledger's free list is FIFO), so an
        embedding still in flight to a DiT when its gateway died is not overwritten under it."""
        if producer.leased < producer.ledger.num_slots:
            return 0
        taken = 0
        for key, pid in list(self._caller.items()):
            if not self._alive(pid):
                taken += producer.ledger.reclaim(*key)
                del self._caller[key]
        if taken:
            log.warning("took back %d embedding slot(s) of exited caller(s): their releases never came", taken)
        return taken


class EncoderServicer(encoder_pb2_grpc.EncoderServicer):
    """`exporter`: how embeddings reach the DiT; None builds it from the service profile's encoder section (the
    EncoderConfig defaults for a service without a profile)."""

    def __init__(self, service: EncoderService, exporter: IpcExporter | None = None):
        self.service = service
        profile = getattr(service, "profile", None)
        cfg = profile.encoder if profile is not None else EncoderConfig()
        self.exporter = embedding_exporter(cfg) if exporter is None else exporter
        self.callers = CallerLeases(self.exporter.local_hello())

    async def Encode(self, request: encoder_pb2.EncodeRequest, context: grpc.aio.ServicerContext):
        span = tracing.continue_trace(request.trace.traceparent)
        with log_context(session_id=request.session_id or None, **span.log_fields()):
            try:
                worker = self.service.worker  # the encoder's one thread (services.common.threads)
                encoded = await run_on(worker, self.service.encode, request.prompt)
                leases = await run_on(worker, self.exporter.session, request.consumer)
                if leases is not None:
                    self.callers.take_back_exited(leases.producer)
                export = asyncio.ensure_future(run_on(worker, sender(leases, CONSUMER), encoded.embedding))
                try:
                    parts = await asyncio.shield(export)
                except asyncio.CancelledError:  # the caller left while the export ran on: its slot comes back
                    export.add_done_callback(self._take_back_exported)
                    raise
                self.callers.sent(parts[0], request.caller)
            except Exception as exc:  # the one boundary where every failure becomes a status
                await abort_with(context, exc)
                return
            STAGE_LATENCY.labels(stage="text").observe(encoded.seconds)
            record_gpu_memory()
            num_tokens = encoded.embedding.shape[0]
            log.info("prompt encoded: %d tokens in %.3f s", num_tokens, encoded.seconds,
                     extra={**prompt_fields(request.prompt), "num_tokens": num_tokens,
                            "encode_s": round(encoded.seconds, 4)})
            sent = False
            try:
                for part in parts:
                    await context.write(encoder_pb2.EncodeResponse(embedding=part, num_tokens=num_tokens,
                                                                   encode_seconds=encoded.seconds))
                sent = True
            finally:
                if not sent:  # cancelled before the last part went out: the caller will not release the slot
                    self._take_back(parts)

    def _take_back(self, parts: list[tensor_pb2.TensorPart]) -> None:
        """Free the slot of an embedding that never reached its caller (host parts hold none)."""
        producer = self.exporter.producer
        if producer is None or not parts or parts[0].WhichOneof("where") != "cuda":
            return
        ref = parts[0].cuda
        if producer.ledger.reclaim(ref.slot, ref.generation):
            log.info("an embedding's caller left before it was sent: slot %d taken back", ref.slot)
        self.callers.released(tensor_pb2.Release(slot=ref.slot, generation=ref.generation))
        IPC_LEASED_SLOTS.labels(peer=CONSUMER).set(producer.leased)

    def _take_back_exported(self, export: asyncio.Future) -> None:
        """Done-callback of an export whose call was cancelled."""
        if not export.cancelled() and export.exception() is None:
            self._take_back(export.result())

    async def Release(self, request: tensor_pb2.Release, context: grpc.aio.ServicerContext):
        producer = self.exporter.producer
        try:
            if producer is None:
                raise IpcError(f"release of slot {request.slot}: this encoder has exported no CUDA IPC pool")
            producer.release(request)
            self.callers.released(request)
        except Exception as exc:  # the boundary: every failure becomes a status
            await abort_with(context, exc)
            return
        IPC_LEASED_SLOTS.labels(peer=CONSUMER).set(producer.leased)
        return encoder_pb2.ReleaseReply()


def register(server: grpc.aio.Server, service: EncoderService) -> None:
    """Add the encoder servicer (and the Transport/Hello servicer) to a server."""
    encoder_pb2_grpc.add_EncoderServicer_to_server(EncoderServicer(service), server)
    register_transport(server)
