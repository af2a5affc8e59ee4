"""How a stage sends and receives tensors: CUDA IPC through its process's pool when allowed, else host bytes.

A producer stage keeps one `IpcExporter` per process (it negotiates with each session's consumer hello and creates
the pool lazily on the first IPC session) and one `SessionLeases` per consumer session (it tracks the slots leased to
that session, checks each release against them and takes back what the session still holds when it ends). A
consumer stage keeps one `IpcConsumer` per process and one `TensorReceiver` per stream and tensor kind.
`TransportServicer` answers the `vitascope.common.v1.Transport/Hello` RPC with this process's hello. Every tensor
sent is counted per mode in `TRANSPORT_TENSORS`, every fallback in `TRANSPORT_FALLBACKS`. Knows nothing about which
stage it runs in; the pool mechanism itself is services/tensors/cuda_ipc.py.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from functools import partial

import grpc
import torch

from services.common import metrics
from services.tensors.cuda_ipc import (MODE_HOST, MODE_IPC, IpcConsumer, IpcError, IpcProducer, PoolExhausted,
                                      count_fallback, local_hello, negotiate)
from services.tensors.transport import TensorAssembler, tensor_to_parts
from vitascope.common.v1 import tensor_pb2 as pb
from vitascope.common.v1 import transport_pb2, transport_pb2_grpc

log = logging.getLogger(__name__)


def send_tensor(tensor: torch.Tensor, producer: IpcProducer | None, peer: str) -> list[pb.TensorPart]:
    """IPC part through `producer` when given, the tensor fits a slot and a slot is free; else host parts (a
    counted fallback when a producer was given). Every tensor is counted in TRANSPORT_TENSORS by mode."""
    if producer is not None:
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > producer.slot_bytes:
            count_fallback(peer, f"tensor of {nbytes} bytes does not fit the {producer.slot_bytes}-byte slots")
        else:
            try:
                part = producer.export(tensor)
            except PoolExhausted as exc:
                count_fallback(peer, str(exc))
            else:
                metrics.TRANSPORT_TENSORS.labels(peer=peer, mode=MODE_IPC).inc()
                return [part]
    metrics.TRANSPORT_TENSORS.labels(peer=peer, mode=MODE_HOST).inc()
    return tensor_to_parts(tensor)


def sender(leases: SessionLeases | None, peer: str) -> Callable[[torch.Tensor], list[pb.TensorPart]]:
    """How one session sends a tensor to `peer`: through its CUDA IPC leases, or as host bytes."""
    return leases.send if leases is not None else partial(send_tensor, producer=None, peer=peer)


class ProcessConsumer:
    """The process's one `IpcConsumer`, made on first call (a CUDA IPC part) so a host-only process never needs CUDA;
    it opens each producer's pool once for all streams."""

    def __init__(self, make: Callable[[], IpcConsumer] = IpcConsumer):
        self._make, self._consumer = make, None
        self._lock = threading.Lock()

    def __call__(self) -> IpcConsumer:
        with self._lock:
            if self._consumer is None:
                self._consumer = self._make()
            return self._consumer


class SessionLeases:
    """The slots of one producer leased to one consumer session: `send` leases, `release` checks a release against
    this session's leases, `close` takes back what the session still holds (thread-safe). A session's sends may run
    on in a worker thread after its call ended: once closed, whatever they lease is taken back at once."""

    def __init__(self, producer: IpcProducer, peer: str):
        self.producer, self.peer = producer, peer
        self._held: set[tuple[int, int]] = set()  # (slot, generation) leased to this session
        self._closed = False
        self._lock = threading.Lock()

    @property
    def held(self) -> int:
        return len(self._held)

    def send(self, tensor: torch.Tensor) -> list[pb.TensorPart]:
        """One IPC part for `tensor` (or host parts when it cannot go by IPC; see `send_tensor`); an IpcError once
        the session is closed."""
        if self._closed:
            raise IpcError("the session ended: nothing more is sent to it")
        parts = send_tensor(tensor, self.producer, self.peer)
        if parts[0].WhichOneof("where") == "cuda":
            key = (parts[0].cuda.slot, parts[0].cuda.generation)
            with self._lock:
                closed = self._closed
                if not closed:
                    self._held.add(key)
            if closed:  # closed while the export ran: nobody will release this slot
                self.producer.ledger.reclaim(*key)
                metrics.IPC_LEASED_SLOTS.labels(peer=self.peer).set(self.producer.leased)
                raise IpcError("the session ended while a tensor was exported to it: its slot was taken back")
        metrics.IPC_LEASED_SLOTS.labels(peer=self.peer).set(self.producer.leased)
        return parts

    def release(self, message: pb.Release) -> None:
        """Give back one slot this session holds; a release of anything else is an IpcError naming it."""
        key = (message.slot, message.generation)
        with self._lock:
            if message.pool_id != self.producer.pool_id or key not in self._held:
                where = "this producer's pool" if message.pool_id == self.producer.pool_id else "another pool"
                raise IpcError(f"release of slot {message.slot} generation {message.generation} of {where}: this "
                               f"session holds no such lease (stale, doubled or unknown; it holds "
                               f"{sorted(self._held)})")
            self.producer.release(message)
            self._held.discard(key)
        metrics.IPC_LEASED_SLOTS.labels(peer=self.peer).set(self.producer.leased)

    def close(self) -> int:
        """The session ended: take back every slot it still holds; returns how many."""
        with self._lock:
            held, self._held, self._closed = self._held, set(), True
        taken = sum(self.producer.ledger.reclaim(slot, gen) for slot, gen in held)
        metrics.IPC_LEASED_SLOTS.labels(peer=self.peer).set(self.producer.leased)
        return taken


class IpcExporter:
    """A producer stage's side of the transport: offers CUDA IPC from `device`, negotiates with each session's
    consumer hello, creates its one pool lazily on the first IPC session and hands out `SessionLeases`.

    `hello` and `make_producer(device, pool_bytes, num_slots)` default to this process and `IpcProducer`."""

    def __init__(self, device: str, slot_bytes: int, num_slots: int, peer: str, *, enabled: bool = True,
                 hello: Callable[[], pb.TransportHello] = local_hello,
                 make_producer: Callable[[str, int, int], IpcProducer] = IpcProducer):
        if not isinstance(slot_bytes, int) or slot_bytes < 1 or not isinstance(num_slots, int) or num_slots < 1:
            raise IpcError(f"slot_bytes={slot_bytes!r} and num_slots={num_slots!r} must be positive ints")
        self.device, self.slot_bytes, self.num_slots, self.peer = device, slot_bytes, num_slots, peer
        self.offered = enabled and torch.device(device).type == "cuda"
        """CUDA IPC is offered at all (enabled and the producer works on a CUDA device); if not, host bytes
        are the plan, not a fallback, and are not counted as one."""
        self._hello, self._make_producer = hello, make_producer
        self._producer: IpcProducer | None = None
        self._broken = ""  # why the pool could not be created (then every session falls back)
        self._lock = threading.Lock()

    @property
    def producer(self) -> IpcProducer | None:
        return self._producer

    def local_hello(self) -> pb.TransportHello:
        """This process's hello, as offered to consumers."""
        return self._hello()

    def session(self, consumer: pb.TransportHello) -> SessionLeases | None:
        """The leases of a new session to `consumer`, or None when its tensors go as host bytes."""
        if not self.offered:
            return None
        decision = negotiate(self._hello(), consumer, self.peer)
        if decision.mode != MODE_IPC:
            return None
        producer = self._pool()
        if producer is None:
            count_fallback(self.peer, f"the CUDA IPC pool could not be created: {self._broken}")
            return None
        if producer.device_uuid not in consumer.gpu_uuids:
            count_fallback(self.peer, f"the pool's GPU {producer.device_uuid} is not visible to the consumer")
            return None
        log.debug("CUDA IPC to %s: %s", self.peer, decision.reason)
        return SessionLeases(producer, self.peer)

    def _pool(self) -> IpcProducer | None:
        with self._lock:
            if self._producer is None and not self._broken:
                try:
                    self._producer = self._make_producer(self.device, self.slot_bytes * self.num_slots,
                                                         self.num_slots)
                except (IpcError, RuntimeError) as exc:  # e.g. out of memory: sessions use host bytes
                    self._broken = str(exc)
                    log.warning("CUDA IPC pool on %s not created, host bytes from now on: %s", self.device, exc)
            return self._producer


class TensorReceiver:
    """One stream's tensors of one kind: host parts are assembled, a CUDA IPC part is copied out of its producer's
    pool (onto `device`, default the pool's GPU) by the process-wide consumer that `consumer()` returns."""

    def __init__(self, name: str, consumer: Callable[[], IpcConsumer], device: str | None = None):
        self.name = name
        self._assembler = TensorAssembler(name)
        self._consumer, self._device = consumer, device
        self._partial = False

    def add(self, part: pb.TensorPart) -> tuple[torch.Tensor | None, pb.Release | None]:
        """Take one part; returns (tensor, release) once the tensor is complete (release: None for host parts).

        Blocking for CUDA IPC parts (a device copy): call it from a worker thread."""
        if part.WhichOneof("where") != "cuda":
            tensor = self._assembler.add(part)
            self._partial = tensor is None
            return tensor, None
        if self._partial:
            raise IpcError(f"{self.name}: a CUDA IPC part arrived in the middle of a host-part tensor")
        try:
            return self._consumer().open(part, self._device)
        except torch.OutOfMemoryError:  # this process is short of memory: not the part's fault
            raise
        except (IpcError, RuntimeError) as exc:  # RuntimeError: torch refused a handle (e.g. a bad event handle)
            raise IpcError(f"{self.name}: {exc}") from None

    async def receive(self, part: pb.TensorPart) -> tuple[torch.Tensor | None, pb.Release | None]:
        """`add` for an event loop: a CUDA IPC part's device copy runs in a worker thread."""
        if part.WhichOneof("where") == "cuda":
            return await asyncio.to_thread(self.add, part)
        return self.add(part)


class TransportServicer(transport_pb2_grpc.TransportServicer):
    """Answers `Hello` with this process's `TransportHello` (computed once)."""

    def __init__(self, hello: Callable[[], pb.TransportHello] = local_hello):
        self._make, self._hello = hello, None

    async def Hello(self, request: transport_pb2.HelloRequest, context: grpc.aio.ServicerContext):
        if self._hello is None:
            self._hello = self._make()
        return self._hello


def register_transport(server: grpc.aio.Server) -> None:
    """Add the `vitascope.common.v1.Transport` servicer (the Hello RPC) to a stage's server."""
    transport_pb2_grpc.add_TransportServicer_to_server(TransportServicer(), server)
