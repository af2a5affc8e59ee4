"""The three stage servicers on one in-process grpc.aio server, with CUDA IPC pools that need no GPU: the shared
fixtures of tests/tensors/test_ipc_wiring.py and tests/tensors/test_ipc_embeddings.py.

The real `DiTServicer`, `VAEServicer`, `EncoderServicer`, `TransportServicer` and the gateway's `GrpcPipeline` talk
over the server. Without a GPU the pool is a `LedgerPool`: the real `SlotLedger` bookkeeping and real `CudaIpcRef`
parts, with the tensors kept in a dict instead of device memory, read back by a `LedgerConsumer` in place of
`IpcConsumer`.
"""
import asyncio
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import grpc
import torch

from services.tensors.cuda_ipc import IpcError, SlotLedger
from services.common.errors import NoCapacity
from services.tensors.stage_transport import IpcExporter, TransportServicer
from services.tensors.transport import tensor_to_parts
from services.dit.api import HoldConfig, PhaseMeta, PhaseOutput, PhaseTimings
from services.dit.grpc_server import DiTServicer
from services.encoder.grpc_server import EncoderServicer
from services.encoder.service import Encoded
from services.vae.grpc_server import VAEServicer
from services.vae.service import Chunk
from vitascope.common.v1 import tensor_pb2 as pb
from vitascope.common.v1 import transport_pb2_grpc
from vitascope.dit.v1 import dit_pb2, dit_pb2_grpc
from vitascope.encoder.v1 import encoder_pb2_grpc
from vitascope.vae.v1 import vae_pb2_grpc

BOOT = "3b1f0c9e-0000-4000-8000-00000000beef"
DIT_HELLO = pb.TransportHello(boot_id=BOOT, gpu_uuids=["GPU-shared"], pid=1111)
ENCODER_HELLO = pb.TransportHello(boot_id=BOOT, gpu_uuids=["GPU-shared"], pid=3333)
VAE_HELLO = pb.TransportHello(boot_id=BOOT, gpu_uuids=["GPU-shared"], pid=2222)
VAE_NO_GPU = pb.TransportHello(boot_id=BOOT, gpu_uuids=["GPU-other"], pid=2222)


POOLS: dict[str, "LedgerPool"] = {}  # pool id -> pool, as a consumer's opened pools


class LedgerPool:
    """The bookkeeping of an `IpcProducer` (its real SlotLedger and real CudaIpcRef parts) without device memory."""

    device_uuid = "GPU-shared"

    def __init__(self, device: str, pool_bytes: int, num_slots: int, name: str = "ledger-pool"):
        self.pool_id = f"{name}-{len(POOLS)}"
        POOLS[self.pool_id] = self
        self.ledger = SlotLedger(num_slots)
        self.slot_bytes = pool_bytes // num_slots
        self.stored: dict[tuple[int, int], torch.Tensor] = {}

    @property
    def leased(self) -> int:
        return self.ledger.leased

    def export(self, tensor: torch.Tensor) -> pb.TensorPart:
        slot, gen = self.ledger.lease()
        self.stored[(slot, gen)] = tensor.clone()
        nbytes = tensor.numel() * tensor.element_size()
        return pb.TensorPart(meta=pb.TensorMeta(dtype=pb.FLOAT32, shape=list(tensor.shape)), cuda=pb.CudaIpcRef(
            pool_id=self.pool_id, slot=slot, generation=gen, offset_bytes=slot * self.slot_bytes, nbytes=nbytes,
            device_uuid=self.device_uuid))

    def release(self, message: pb.Release) -> None:
        if message.pool_id != self.pool_id:
            raise IpcError(f"release for another pool (slot {message.slot}, generation {message.generation})")
        self.ledger.release(message.slot, message.generation)


class HeldExport:
    """Makes an exporter's pool a `LedgerPool` whose exports wait for `go_on` (a device copy behind a busy GPU: the
    export outlives the call that asked for it); `exporting` and `exported` say where it is."""

    def __init__(self, exporter, name: str):
        self.exporting, self.go_on, self.exported = threading.Event(), threading.Event(), threading.Event()
        held = self

        class HeldPool(LedgerPool):
            def export(self, tensor):
                held.exporting.set()
                held.go_on.wait(10)
                try:
                    return super().export(tensor)
                finally:
                    held.exported.set()

        exporter._make_producer = lambda device, pool_bytes, slots: (
            exporter.pools.append(HeldPool(device, pool_bytes, slots, name=name)) or exporter.pools[-1])


class LedgerConsumer:
    """Reads LedgerPool parts back, as `IpcConsumer.open` does."""

    def __init__(self):
        self.opened = 0

    def open(self, part: pb.TensorPart, device=None):
        self.opened += 1
        ref = part.cuda
        if ref.pool_id not in POOLS:  # as IpcConsumer refuses a pool it cannot open
            raise IpcError(f"CUDA IPC pool {ref.pool_id!r} is not one this consumer can open")
        return (POOLS[ref.pool_id].stored[(ref.slot, ref.generation)].clone(),
                pb.Release(pool_id=ref.pool_id, slot=ref.slot, generation=ref.generation))


class RecordingExporter(IpcExporter):
    """An exporter on a LedgerPool whose own hello is `hello`; records the consumer hello of each session."""

    def __init__(self, num_slots: int = 6, peer: str = "vae", hello: pb.TransportHello = DIT_HELLO):
        self.consumers: list[pb.TransportHello] = []
        self.pools: list[LedgerPool] = []

        def make(device, pool_bytes, slots):
            self.pools.append(LedgerPool(device, pool_bytes, slots, name=peer))
            return self.pools[-1]

        super().__init__("cuda:0", 1 << 20, num_slots, peer, hello=lambda: hello, make_producer=make)

    def session(self, consumer):
        self.consumers.append(pb.TransportHello.FromString(consumer.SerializeToString()))
        return super().session(consumer)


class FakeDiTSession:
    canvas = types.SimpleNamespace(width=64, height=64)
    kv = None

    def __init__(self, prompts: list) -> None:
        self.prompts = prompts  # the embeddings' first values, in the order the session got them
        self.count = 0
        self.cancel_token = types.SimpleNamespace(cancelled=False)

    def next_phase(self) -> PhaseOutput:
        time.sleep(0.002)
        i, self.count = self.count, self.count + 1
        meta = PhaseMeta(request_index=i // 4, phase_index=i % 4, num_frames=4, num_audio_samples=640,
                         num_video_latents=1, num_audio_latents=1, started_event_ids=(), active_event_id="",
                         completed_event_ids=(), superseded_event_ids=(), timings=PhaseTimings(student_s=0.001))
        return PhaseOutput(video=torch.full((1, 24, 4, 4), float(i)), audio=torch.full((2, 1, 32), -float(i)),
                           meta=meta)

    def submit_prompt(self, update) -> None:
        self.prompts.append(float(update.embedding[0, 0]))

    def cancel(self) -> None:
        self.cancel_token.cancelled = True


class FakeDiT:
    def __init__(self) -> None:
        self.prompts: list[float] = []
        self.refuse = False

    def open(self, config, prompt, fallback) -> FakeDiTSession:
        if self.refuse:
            raise NoCapacity("the fake DiT is busy")
        self.prompts.append(float(prompt.embedding[0, 0]))
        return FakeDiTSession(self.prompts)

    def hold_config(self, enabled: bool, max_seconds: float) -> HoldConfig:
        return HoldConfig(enabled=enabled, max_seconds=max_seconds or None)


class FakeEncoder:
    """The embedding's values are the prompt's length, so the DiT's copy shows which prompt it got."""

    def __init__(self) -> None:
        self.worker = ThreadPoolExecutor(1, "encoder")

    def encode(self, prompt: str) -> Encoded:
        return Encoded(embedding=torch.full((3, 8), float(len(prompt))), seconds=0.001)


class FakeVAE:
    """Each chunk's bytes name the phase the video latents came from, so a wrong slot would show."""

    def __init__(self) -> None:
        self.phases: list[tuple[float, float]] = []
        self.decode_worker = ThreadPoolExecutor(1, "vae-decode")

    def open(self, width, height, fps, sample_rate):
        def phase(video, audio) -> Iterator[Chunk]:
            self.phases.append((float(video[0, 0, 0, 0]), float(audio[0, 0, 0])))
            yield Chunk(data=b"phase-%d" % int(video[0, 0, 0, 0]), num_frames=4, num_audio_samples=640,
                         video_decode_seconds=0.003, audio_decode_seconds=0.002, mux_seconds=0.001)

        def close() -> Chunk:
            return Chunk(data=b"", num_frames=0, num_audio_samples=0, video_decode_seconds=0.0,
                         audio_decode_seconds=0.0, mux_seconds=0.0)

        return types.SimpleNamespace(phase=phase, close=close, discard=lambda: None)


class Stages:
    """The three servicers plus a Transport servicer answering VAE_HELLO (or `vae_hello`) on one server."""

    def __init__(self, vae_hello: pb.TransportHello = VAE_HELLO, num_slots: int = 6, max_phases_ahead: int = 2):
        self.exporter = RecordingExporter(num_slots)
        self.encoder_exporter = RecordingExporter(4, peer="dit", hello=ENCODER_HELLO)
        self.vae, self.dit = FakeVAE(), FakeDiT()
        self.consumer = LedgerConsumer()  # the VAE's
        self.dit_consumer = LedgerConsumer()
        self.server = grpc.aio.server()
        encoder_pb2_grpc.add_EncoderServicer_to_server(EncoderServicer(FakeEncoder(), self.encoder_exporter),
                                                       self.server)
        dit_pb2_grpc.add_DiTServicer_to_server(DiTServicer(self.dit, max_phases_ahead, self.exporter,
                                                           lambda: self.dit_consumer), self.server)
        vae_pb2_grpc.add_VAEServicer_to_server(VAEServicer(self.vae, consumer=lambda: self.consumer), self.server)
        # one server plays every stage: the DiT and the VAE answer the same hello
        transport_pb2_grpc.add_TransportServicer_to_server(TransportServicer(lambda: vae_hello), self.server)
        self.addr = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"

    @property
    def pool(self) -> LedgerPool:
        (pool,) = self.exporter.pools  # one pool per process, however many sessions
        return pool

    async def __aenter__(self) -> "Stages":
        await self.server.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.server.stop(0)


def metric_value(metric, **labels) -> float:
    return metric.labels(**labels)._value.get()


async def open_raw(channel, consumer: pb.TransportHello) -> grpc.aio.StreamStreamCall:
    call = dit_pb2_grpc.DiTStub(channel).Stream()
    await call.write(dit_pb2.StreamRequest(start=dit_pb2.SessionStart(session_id="raw", seed=1, width=64, height=64,
                                                                       consumer=consumer)))
    for part in tensor_to_parts(torch.ones(3, 8)):
        await call.write(dit_pb2.StreamRequest(prompt=dit_pb2.PromptPart(embedding=part)))
    assert (await call.read()).WhichOneof("kind") == "started"
    return call


async def read_phase(call) -> tuple[dit_pb2.PhaseMeta, list[pb.TensorPart]]:
    meta, parts = None, []
    while True:
        reply = await asyncio.wait_for(call.read(), 10)
        assert reply is not grpc.aio.EOF
        kind = reply.WhichOneof("kind")
        if kind == "meta":
            meta = reply.meta
        elif kind in ("video", "audio"):
            parts.append(getattr(reply, kind))
        elif kind == "phase_end":
            return meta, parts


def release_request(part: pb.TensorPart, generation: int | None = None) -> dit_pb2.StreamRequest:
    ref = part.cuda
    return dit_pb2.StreamRequest(release=pb.Release(
        pool_id=ref.pool_id, slot=ref.slot, generation=ref.generation if generation is None else generation))


def ack_request(meta: dit_pb2.PhaseMeta) -> dit_pb2.StreamRequest:
    return dit_pb2.StreamRequest(ack=dit_pb2.PhaseAck(request_index=meta.request_index,
                                                      phase_index=meta.phase_index))


async def wait_for(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)
