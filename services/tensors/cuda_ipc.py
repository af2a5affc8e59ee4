"""CUDA IPC tensor transport between stage processes on one node: a persistent device pool per producer.

Producer: one device buffer (2 MiB aligned, `pool_bytes` rounded up to 2 MiB) allocated at start-up and exported
ONCE through torch's CUDA storage sharing (`UntypedStorage._share_cuda_`). It is cut into fixed slots (multiples of
2 MiB). `export(tensor)` leases a free slot under a new generation number, copies the tensor in on the current
stream, records the slot's interprocess CUDA event and returns a single `TensorPart(cuda=CudaIpcRef)`. The slot stays
leased until the consumer sends `Release(pool_id, slot, generation)`; stale or doubled releases are rejected.

Consumer: `open(part)` opens the pool on first sight (cached by pool id, so once per producer; opening a new one
first forgets the pools of producers that have exited, so a restarted producer's old pool is unmapped), makes its
current stream wait on the slot's event (producer -> consumer ordering), copies the bytes out, waits for that copy
to finish and returns the tensor together with the `Release` to send back. `view(part)` + `release_for(part)` is the
zero-copy variant for a consumer that finishes with the data before releasing.

The proto has no separate "pool announcement" message, so `CudaIpcRef.pool_id` is self-describing: it carries the
pool's export record (IPC memory handle, sizes, torch's ref-counter handle) as versioned JSON of plain
ints/strings/base64 bytes (never pickle). A consumer decodes it the first time it sees a pool id.

Handshake: `decide_transport(local, peer)` on `TransportHello`s picks CUDA IPC only for the same boot id, a
different pid (a process cannot open its own IPC handles) and at least one shared GPU UUID; otherwise host bytes,
counted in `TRANSPORT_FALLBACKS`.

How stages use it (per-session leases, the exporter, receivers, the Hello RPC): services/tensors/stage_transport.py.
Knows nothing about gRPC calls or which stage it runs in.
"""

from __future__ import annotations

import base64
import collections
import json
import logging
import os
import threading
from dataclasses import dataclass
from typing import Callable

import torch

from services.common import metrics
from services.common.host_identity import process_alive, read_boot_id, read_pid_namespace
from services.tensors.transport import DTYPE_TO_PROTO, PROTO_TO_DTYPE, TransportError, tensor_nbytes
from vitascope.common.v1 import tensor_pb2 as pb

log = logging.getLogger(__name__)

ALIGN = 2 << 20  # 2 MiB
POOL_ID_PREFIX = "cudaipc1:"
MODE_IPC, MODE_HOST = "cuda_ipc", "host"


class IpcError(TransportError):
    """A CUDA IPC reference or release is malformed, stale, or cannot be served."""


class PoolExhausted(IpcError):
    """Every slot of the producer's pool is leased; the consumer is not releasing (or the pool is too small)."""


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


# ----------------------------------------------------------------------------------------------------------------
# Handshake


def gpu_uuids() -> list[str]:
    """UUIDs of the visible CUDA devices, in local index order (empty without CUDA)."""
    if not torch.cuda.is_available():
        return []
    return [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]


def local_hello() -> pb.TransportHello:
    """The `TransportHello` of this process."""
    return pb.TransportHello(boot_id=read_boot_id(), gpu_uuids=gpu_uuids(), pid=os.getpid(),
                             pid_namespace=read_pid_namespace())


@dataclass(frozen=True)
class TransportDecision:
    """What two processes use between them, and why."""

    mode: str
    """MODE_IPC or MODE_HOST."""
    reason: str
    shared_gpus: tuple[str, ...] = ()


def decide_transport(local: pb.TransportHello, peer: pb.TransportHello) -> TransportDecision:
    """CUDA IPC when both run on the same boot of one machine, in one PID namespace, in different processes, sharing a
    GPU."""
    if not local.boot_id or not peer.boot_id:
        return TransportDecision(MODE_HOST, "a boot id is missing")
    if local.boot_id != peer.boot_id:
        return TransportDecision(MODE_HOST, f"different boot id ({peer.boot_id[:8]}… vs {local.boot_id[:8]}…): "
                                            "not the same machine")
    if local.pid_namespace != peer.pid_namespace:
        return TransportDecision(MODE_HOST, f"different PID namespaces ({peer.pid_namespace or 'unknown'} vs "
                                            f"{local.pid_namespace or 'unknown'}): a peer's pid cannot be checked, "
                                            "so its slots could not be taken back; run the stages in one")
    if local.pid == peer.pid:
        return TransportDecision(MODE_HOST, f"same pid {peer.pid}: a process cannot open its own CUDA IPC handles")
    shared = tuple(u for u in local.gpu_uuids if u in set(peer.gpu_uuids))
    if not shared:
        return TransportDecision(MODE_HOST, "no GPU UUID in common")
    return TransportDecision(MODE_IPC, f"same boot, {len(shared)} shared GPU(s)", shared)


def count_fallback(peer: str, reason: str) -> None:
    """Count one fallback to host bytes (a connection decided for host, or one tensor that did not fit IPC)."""
    metrics.TRANSPORT_FALLBACKS.labels(peer=peer).inc()
    log.info("transport to %s falls back to host bytes: %s", peer, reason)


def negotiate(local: pb.TransportHello, peer: pb.TransportHello, peer_name: str) -> TransportDecision:
    """`decide_transport`, counting a fallback (label `peer_name`) when the connection will use host bytes."""
    decision = decide_transport(local, peer)
    if decision.mode == MODE_HOST:
        count_fallback(peer_name, decision.reason)
    return decision


# ----------------------------------------------------------------------------------------------------------------
# Slot bookkeeping (no CUDA)


class SlotLedger:
    """Lease / release bookkeeping of `num_slots` slots with a generation number per lease (thread-safe).

    Free slots are handed out first in, first out, so a slot taken back from a departed consumer is reused last."""

    def __init__(self, num_slots: int):
        if not isinstance(num_slots, int) or num_slots < 1:
            raise IpcError(f"num_slots={num_slots!r} must be a positive int")
        self.num_slots = num_slots
        self._generation = [0] * num_slots  # generation of the current (or last) lease of each slot
        self._leased = [False] * num_slots
        self._next_generation = 1
        self._free = collections.deque(range(num_slots))  # FIFO: slot 0 leased first
        self._lock = threading.Lock()

    @property
    def leased(self) -> int:
        return sum(self._leased)

    def lease(self) -> tuple[int, int]:
        """Take a free slot; returns (slot, generation)."""
        with self._lock:
            if not self._free:
                raise PoolExhausted(f"all {self.num_slots} slots are leased: the consumer has not released them "
                                    "(send Release after each open) or the pool is too small")
            slot = self._free.popleft()
            gen = self._next_generation
            self._next_generation += 1
            self._generation[slot], self._leased[slot] = gen, True
            return slot, gen

    def release(self, slot: int, generation: int) -> None:
        """Give a lease back; rejects unknown slots, stale generations and double releases."""
        with self._lock:
            if not 0 <= slot < self.num_slots:
                raise IpcError(f"release of slot {slot}: the pool has slots 0..{self.num_slots - 1}")
            if generation != self._generation[slot]:
                raise IpcError(f"stale release of slot {slot}: generation {generation}, the slot's current lease is "
                               f"generation {self._generation[slot]}")
            if not self._leased[slot]:
                raise IpcError(f"double release of slot {slot} generation {generation}: already free")
            self._leased[slot] = False
            self._free.append(slot)

    def reclaim(self, slot: int, generation: int) -> bool:
        """Free one lease without its consumer's release (its session ended); False if it was already given back.

        The slot gets a generation no lease carried, so the departed consumer's late release is rejected as stale."""
        with self._lock:
            if not 0 <= slot < self.num_slots or not self._leased[slot] or self._generation[slot] != generation:
                return False
            self._leased[slot] = False
            self._generation[slot] = self._next_generation
            self._next_generation += 1
            self._free.append(slot)
            return True


# ----------------------------------------------------------------------------------------------------------------
# Pool export record <-> pool id


@dataclass(frozen=True)
class PoolRecord:
    """What a consumer needs to open a producer's pool: torch's `_share_cuda_` tuple plus identity."""

    device_uuid: str
    handle: bytes
    storage_bytes: int
    storage_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool
    pid: int
    nonce: str

    def to_pool_id(self) -> str:
        b64 = lambda b: None if b is None else base64.b64encode(b).decode()  # noqa: E731
        body = {"uuid": self.device_uuid, "h": b64(self.handle), "n": self.storage_bytes, "o": self.storage_offset,
                "rc": b64(self.ref_counter_handle), "rco": self.ref_counter_offset, "ev": b64(self.event_handle),
                "evs": self.event_sync_required, "pid": self.pid, "nonce": self.nonce}
        return POOL_ID_PREFIX + base64.urlsafe_b64encode(json.dumps(body, sort_keys=True).encode()).decode()

    @classmethod
    def from_pool_id(cls, pool_id: str) -> "PoolRecord":
        if not pool_id.startswith(POOL_ID_PREFIX):
            raise IpcError(f"pool id {pool_id[:24]!r}… is not a {POOL_ID_PREFIX!r} export record")
        try:
            body = json.loads(base64.urlsafe_b64decode(pool_id[len(POOL_ID_PREFIX):].encode()))
            unb = lambda s: None if s is None else base64.b64decode(s)  # noqa: E731
            rec = cls(device_uuid=str(body["uuid"]), handle=unb(body["h"]), storage_bytes=int(body["n"]),
                      storage_offset=int(body["o"]), ref_counter_handle=unb(body["rc"]),
                      ref_counter_offset=int(body["rco"]), event_handle=unb(body["ev"]),
                      event_sync_required=bool(body["evs"]), pid=int(body["pid"]), nonce=str(body["nonce"]))
        except (ValueError, KeyError, TypeError) as e:
            raise IpcError(f"pool id does not decode to an export record ({e})") from e
        if not rec.handle or rec.storage_bytes <= 0 or rec.storage_offset < 0:
            raise IpcError(f"pool export record has an empty handle or bad sizes ({rec.storage_bytes} bytes at "
                           f"{rec.storage_offset})")
        return rec


def _check_ref(ref: pb.CudaIpcRef, meta: pb.TensorMeta, pool_bytes: int) -> tuple[torch.dtype, list[int]]:
    """Validate a reference against its meta and its pool size; returns (dtype, shape)."""
    try:
        want = tensor_nbytes(meta, f"slot {ref.slot}")
    except TransportError as exc:
        raise IpcError(str(exc)) from None
    dtype, shape = PROTO_TO_DTYPE[meta.dtype], [int(s) for s in meta.shape]
    if want != ref.nbytes:
        raise IpcError(f"slot {ref.slot}: {ref.nbytes} bytes for shape {shape} {dtype}, expected {want}")
    if ref.offset_bytes + ref.nbytes > pool_bytes:
        raise IpcError(f"slot {ref.slot}: bytes [{ref.offset_bytes}, {ref.offset_bytes + ref.nbytes}) lie outside "
                       f"the {pool_bytes}-byte pool")
    return dtype, shape


# ----------------------------------------------------------------------------------------------------------------
# Producer / consumer (CUDA)


class IpcProducer:
    """One exported device pool of `num_slots` slots; `export` leases, `release` takes a slot back."""

    def __init__(self, device: torch.device | str | int, pool_bytes: int, num_slots: int = 8):
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if dev.type != "cuda" or not torch.cuda.is_available():
            raise IpcError(f"CUDA IPC needs a CUDA device, got {dev} (cuda available: {torch.cuda.is_available()})")
        if not isinstance(pool_bytes, int) or pool_bytes < 1:
            raise IpcError(f"pool_bytes={pool_bytes!r} must be a positive int")
        dev = torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())
        if "expandable_segments:true" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").replace(" ", "").lower():
            log.warning("PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True: the IPC pool is VMM memory, shared "
                        "through pidfd_getfd, which needs CAP_SYS_PTRACE in containers")
        self.ledger = SlotLedger(num_slots)
        self.slot_bytes = _round_up(-(-pool_bytes // num_slots), ALIGN)
        self.pool_bytes = self.slot_bytes * num_slots
        self.device = dev
        # Over-allocate by one alignment so the first slot starts on a 2 MiB boundary of the device address space.
        self._buffer = torch.empty(self.pool_bytes + ALIGN, dtype=torch.uint8, device=dev)
        self._base = (-self._buffer.data_ptr()) % ALIGN  # byte offset of slot 0 inside the exported storage
        storage = self._buffer.untyped_storage()
        _, handle, size, offset, rc_handle, rc_offset, ev_handle, ev_sync = storage._share_cuda_()
        with torch.cuda.device(dev):
            self._events = [torch.cuda.Event(interprocess=True) for _ in range(num_slots)]
            self._event_handles = [bytes(e.ipc_handle()) for e in self._events]
        uuid = str(torch.cuda.get_device_properties(dev).uuid)
        self.record = PoolRecord(uuid, bytes(handle), int(size), int(offset), bytes(rc_handle), int(rc_offset),
                                 None if ev_handle is None else bytes(ev_handle), bool(ev_sync), os.getpid(),
                                 os.urandom(8).hex())
        self.pool_id = self.record.to_pool_id()
        log.info("CUDA IPC pool on %s: %d slots x %.1f MiB", dev, num_slots, self.slot_bytes / 2**20)

    def export(self, tensor: torch.Tensor) -> pb.TensorPart:
        """Copy `tensor` into a leased slot; the part is valid until the consumer's `Release` comes back.

        A tensor on another device (e.g. the CPU) is copied straight into the slot (one transfer)."""
        if tensor.dtype not in DTYPE_TO_PROTO:
            raise IpcError(f"dtype {tensor.dtype} cannot travel; allowed: {sorted(map(str, DTYPE_TO_PROTO))}")
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > self.slot_bytes:
            raise IpcError(f"tensor of {nbytes} bytes does not fit a {self.slot_bytes}-byte slot")
        slot, gen = self.ledger.lease()
        offset = self._base + slot * self.slot_bytes
        try:
            if nbytes:
                src = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
                self._buffer[offset:offset + nbytes].copy_(src)
            self._events[slot].record(torch.cuda.current_stream(self.device))
        except BaseException:  # the copy failed (out of memory for a contiguous copy, a device error): no lease
            self.ledger.reclaim(slot, gen)
            raise
        meta = pb.TensorMeta(dtype=DTYPE_TO_PROTO[tensor.dtype], shape=list(tensor.shape))
        return pb.TensorPart(meta=meta, cuda=pb.CudaIpcRef(
            pool_id=self.pool_id, slot=slot, generation=gen, offset_bytes=offset, nbytes=nbytes,
            event_handle=self._event_handles[slot], device_uuid=self.record.device_uuid))

    def release(self, message: pb.Release) -> None:
        """Take a slot back from the consumer."""
        if message.pool_id != self.pool_id:
            raise IpcError(f"release for another pool (slot {message.slot}, generation {message.generation})")
        self.ledger.release(message.slot, message.generation)

    @property
    def leased(self) -> int:
        return self.ledger.leased

    @property
    def device_uuid(self) -> str:
        return self.record.device_uuid


class OpenPools:
    """The producer pools a consumer has opened, by pool id, with the pid that exported each and its slots' events.

    A producer that exits (a DiT or encoder restart) exports a new pool under a new id; `close_exited` drops the old
    one's mapping and events, so the consumer does not keep the dead producer's memory mapped.
    """

    def __init__(self, alive: Callable[[int], bool] = process_alive):
        self._alive = alive
        self._pools: dict[str, tuple[torch.Tensor, int]] = {}  # pool id -> ([bytes] uint8 view, exporting pid)
        self._events: dict[bytes, tuple[torch.cuda.Event, str]] = {}  # event handle -> (event, its pool id)

    def get(self, pool_id: str) -> torch.Tensor | None:
        entry = self._pools.get(pool_id)
        return None if entry is None else entry[0]

    def add(self, pool_id: str, pool: torch.Tensor, pid: int) -> None:
        self._pools[pool_id] = (pool, pid)

    def event(self, handle: bytes, pool_id: str, make: Callable[[], torch.cuda.Event]) -> torch.cuda.Event:
        """The slot event of `handle`, made on first sight."""
        if handle not in self._events:
            self._events[handle] = (make(), pool_id)
        return self._events[handle][0]

    def close_exited(self) -> list[int]:
        """Forget the pools (and their events) of producers that have exited; returns their pids."""
        gone = {pool_id: pid for pool_id, (_, pid) in self._pools.items() if not self._alive(pid)}
        for pool_id in gone:
            del self._pools[pool_id]
        self._events = {h: entry for h, entry in self._events.items() if entry[1] not in gone}
        return sorted(gone.values())


class IpcConsumer:
    """Opens the pools of the producers it hears from (once each) and reads their slots."""

    def __init__(self):
        if not torch.cuda.is_available():
            raise IpcError("CUDA IPC needs CUDA in the consumer process")
        self._uuid_to_index = {u: i for i, u in enumerate(gpu_uuids())}
        self._pools = OpenPools()
        self._streams: dict[torch.device, torch.cuda.Stream] = {}  # open()'s own copy stream per device
        self._lock = threading.Lock()  # open() may run in several worker threads

    def _pool(self, pool_id: str, device_uuid: str) -> torch.Tensor:
        pool = self._pools.get(pool_id)
        if pool is not None:
            return pool
        for pid in self._pools.close_exited():  # a new pool often means a producer restarted
            log.info("closed the CUDA IPC pool of pid %d, which has exited", pid)
        rec = PoolRecord.from_pool_id(pool_id)
        if rec.device_uuid != device_uuid:
            raise IpcError(f"reference names GPU {device_uuid} but its pool lives on {rec.device_uuid}")
        if rec.pid == os.getpid():
            raise IpcError("pool was exported by this very process: use the tensor directly or host bytes")
        index = self._uuid_to_index.get(rec.device_uuid)
        if index is None:
            raise IpcError(f"pool GPU {rec.device_uuid} is not visible here (visible: {sorted(self._uuid_to_index)})")
        try:
            storage = torch.UntypedStorage._new_shared_cuda(
                index, rec.handle, rec.storage_bytes, rec.storage_offset, rec.ref_counter_handle,
                rec.ref_counter_offset, rec.event_handle, rec.event_sync_required)
        except RuntimeError as e:  # e.g. another PID namespace, GPU not mapped, /dev/shm not shared
            raise IpcError(f"cannot open the CUDA IPC pool of pid {rec.pid} on cuda:{index}: {e}") from e
        pool = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", index))
        pool.set_(storage, 0, (rec.storage_bytes,), (1,))
        self._pools.add(pool_id, pool, rec.pid)
        log.info("opened CUDA IPC pool of pid %d on cuda:%d (%.1f MiB)", rec.pid, index, rec.storage_bytes / 2**20)
        return pool

    def view(self, part: pb.TensorPart) -> torch.Tensor:
        """A tensor viewing the slot, ordered after the producer's write on the current stream (no copy)."""
        if part.WhichOneof("where") != "cuda":
            raise IpcError(f"IpcConsumer reads cuda parts, got {part.WhichOneof('where')}")
        ref = part.cuda
        pool = self._pool(ref.pool_id, ref.device_uuid)
        dtype, shape = _check_ref(ref, part.meta, pool.numel())
        event = self._pools.event(ref.event_handle, ref.pool_id,
                                  lambda: torch.cuda.Event.from_ipc_handle(pool.device, ref.event_handle))
        torch.cuda.current_stream(pool.device).wait_event(event)
        return pool[ref.offset_bytes:ref.offset_bytes + ref.nbytes].view(dtype).reshape(shape)

    def release_for(self, part: pb.TensorPart) -> pb.Release:
        """Finish the current stream's reads of the slot and build the `Release` to send to the producer."""
        ref = part.cuda
        pool = self._pools.get(ref.pool_id)
        if pool is None:
            raise IpcError(f"release for slot {ref.slot} of a pool this consumer never opened")
        torch.cuda.current_stream(pool.device).synchronize()
        return pb.Release(pool_id=ref.pool_id, slot=ref.slot, generation=ref.generation)

    def open(self, part: pb.TensorPart, device: torch.device | str | None = None) -> tuple[torch.Tensor, pb.Release]:
        """Copy the slot out into a tensor of this process on `device` (default: the pool's GPU); returns it and
        the `Release` to send back. The copy runs on streams of its own and has finished when this returns, so it
        never waits for (or delays) other work queued on the devices."""
        if part.WhichOneof("where") != "cuda":
            raise IpcError(f"IpcConsumer reads cuda parts, got {part.WhichOneof('where')}")
        with self._lock:
            pool = self._pool(part.cuda.pool_id, part.cuda.device_uuid)
            target = pool.device if device is None else torch.device(device)
            streams = [self._stream(pool.device)] + ([self._stream(target)] if target.type == "cuda" else [])
            with torch.cuda.stream(streams[0]), torch.cuda.stream(streams[-1]):
                src = self.view(part)
                out = torch.empty(src.shape, dtype=src.dtype, device=target)
                out.copy_(src)
                for stream in streams[1:]:
                    stream.synchronize()
                return out, self.release_for(part)

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]
