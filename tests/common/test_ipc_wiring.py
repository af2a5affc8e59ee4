"""CUDA IPC wiring of the stage services on the CPU: the Hello RPC, the gateway's handshake and release relay, the
DiT's per-session slot leases (fallback, stale releases, slots taken back at session end), the VAE's handling
of CUDA parts, and the encoder → DiT leg (embedding slots given back through the DiT's `prompt_release`, or by the
gateway for embeddings the DiT never took).

The real `DiTServicer`, `VAEServicer`, `EncoderServicer`, `TransportServicer` and the gateway's `GrpcPipeline` talk
over an in-process grpc.aio server. Without a GPU the pool is a `LedgerPool`: the real `SlotLedger` bookkeeping
and real `CudaIpcRef` parts, with the tensors kept in a dict instead of device memory, read back by a
`LedgerConsumer` in place of `IpcConsumer`.
"""
import asyncio
import os
import subprocess
import sys
import time
import types

import grpc
import pytest
import torch

from services.common import metrics
from services.common.config import DiTConfig
from services.common.cuda_ipc import IpcError, SlotLedger, gpu_uuids, read_boot_id
from services.common.errors import NoCapacity
from services.common.stage_transport import (IpcExporter, SessionLeases, TensorReceiver, TransportServicer,
                                             register_transport)
from services.common.transport import tensor_to_parts
from services.dit.api import HoldConfig, PhaseMeta, PhaseOutput, PhaseTimings
from services.dit.grpc_server import DiTServicer
from services.encoder.grpc_server import EncoderServicer
from services.encoder.service import Encoded
from services.gateway.grpc_pipeline import GrpcPipeline
from services.gateway.pipeline import SessionRequest
from services.vae.grpc_server import VAEServicer, chunk_messages
from services.vae.service import Chunk
from vitascope.common.v1 import tensor_pb2 as pb
from vitascope.common.v1 import transport_pb2, transport_pb2_grpc
from vitascope.dit.v1 import dit_pb2, dit_pb2_grpc
from vitascope.encoder.v1 import encoder_pb2, encoder_pb2_grpc
from vitascope.vae.v1 import vae_pb2, vae_pb2_grpc

pytestmark = pytest.mark.cpu

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


class LedgerConsumer:
    """Reads LedgerPool parts back, as `IpcConsumer.open` does."""

    def __init__(self):
        self.opened = 0

    def open(self, part: pb.TensorPart, device=None):
        self.opened += 1
        ref = part.cuda
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

    def encode(self, prompt: str) -> Encoded:
        return Encoded(embedding=torch.full((3, 8), float(len(prompt))), seconds=0.001)


class FakeVAE:
    """Each chunk's bytes name the phase the video latents came from, so a wrong slot would show."""

    def __init__(self) -> None:
        self.phases: list[tuple[float, float]] = []

    def open(self, width, height, fps, sample_rate):
        def phase(video, audio) -> Chunk:
            self.phases.append((float(video[0, 0, 0, 0]), float(audio[0, 0, 0])))
            return Chunk(data=b"phase-%d" % int(video[0, 0, 0, 0]), num_frames=4, num_audio_samples=640,
                         video_decode_seconds=0.003, audio_decode_seconds=0.002, mux_seconds=0.001)

        def close() -> Chunk:
            return Chunk(data=b"", num_frames=0, num_audio_samples=0, video_decode_seconds=0.0,
                         audio_decode_seconds=0.0, mux_seconds=0.0)

        return types.SimpleNamespace(phase=phase, close=close)


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


def _count(metric, **labels) -> float:
    return metric.labels(**labels)._value.get()


async def _open_raw(channel, consumer: pb.TransportHello) -> grpc.aio.StreamStreamCall:
    call = dit_pb2_grpc.DiTStub(channel).Stream()
    await call.write(dit_pb2.StreamRequest(start=dit_pb2.SessionStart(session_id="raw", seed=1, width=64, height=64,
                                                                       consumer=consumer)))
    for part in tensor_to_parts(torch.ones(3, 8)):
        await call.write(dit_pb2.StreamRequest(prompt=dit_pb2.PromptPart(embedding=part)))
    assert (await call.read()).WhichOneof("kind") == "started"
    return call


async def _read_phase(call) -> tuple[dit_pb2.PhaseMeta, list[pb.TensorPart]]:
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


def _release(part: pb.TensorPart, generation: int | None = None) -> dit_pb2.StreamRequest:
    ref = part.cuda
    return dit_pb2.StreamRequest(release=pb.Release(
        pool_id=ref.pool_id, slot=ref.slot, generation=ref.generation if generation is None else generation))


def _ack(meta: dit_pb2.PhaseMeta) -> dit_pb2.StreamRequest:
    return dit_pb2.StreamRequest(ack=dit_pb2.PhaseAck(request_index=meta.request_index,
                                                      phase_index=meta.phase_index))


# ---------------------------------------------------------------- Hello


async def test_hello_rpc_returns_this_process_hello():
    server = grpc.aio.server()
    register_transport(server)
    addr = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    try:
        async with grpc.aio.insecure_channel(addr) as channel:
            hello = await transport_pb2_grpc.TransportStub(channel).Hello(transport_pb2.HelloRequest(), timeout=5)
    finally:
        await server.stop(0)
    assert hello.pid == os.getpid()
    assert hello.boot_id == read_boot_id()
    assert list(hello.gpu_uuids) == gpu_uuids()


async def test_gateway_asks_once_and_gives_an_empty_hello_when_ipc_is_off_or_unanswered():
    async with Stages() as stages:
        pipeline = GrpcPipeline(stages.addr, stages.addr, stages.addr)
        off = GrpcPipeline(stages.addr, stages.addr, stages.addr, cuda_ipc=False)
        try:
            assert await pipeline.transport_hello("vae") == VAE_HELLO
            assert pipeline._hellos == {"vae": VAE_HELLO}  # cached: asked once per backend connection
            assert await off.transport_hello("vae") == pb.TransportHello()
        finally:
            await pipeline.close()
            await off.close()
    unanswered = GrpcPipeline("127.0.0.1:1", "127.0.0.1:1", "127.0.0.1:1")
    try:
        assert await unanswered.transport_hello("vae") == pb.TransportHello()
        assert unanswered._hellos == {}  # not cached: asked again next session
    finally:
        await unanswered.close()


# ---------------------------------------------------------------- the whole path: gateway relays releases


async def test_gateway_hands_the_vae_hello_to_the_dit_and_relays_releases():
    ipc_before = _count(metrics.TRANSPORT_TENSORS, peer="vae", mode="cuda_ipc")
    async with Stages(num_slots=6) as stages:
        pipeline = GrpcPipeline(stages.addr, stages.addr, stages.addr)
        chunks = []
        try:
            session = await pipeline.start(SessionRequest(request_id="ipc-1", prompt="p", seed=1, width=64,
                                                          height=64, fps=24))
            stream = session.chunks()
            async for chunk in stream:
                chunks.append(chunk)
                # 12 phases through a 6-slot pool: only possible if every release got back to the DiT
                if len(chunks) == 12:
                    break
            await stream.aclose()
            await session.cancel()
        finally:
            await pipeline.close()
        await asyncio.sleep(0.1)
        pool = stages.pool
    assert stages.exporter.consumers[0] == VAE_HELLO
    assert [c.data for c in chunks] == [b"phase-%d" % i for i in range(12)]
    assert {c.timings.vae for c in chunks} == {0.003}  # audio decodes beside the video: the larger of the two
    assert stages.vae.phases[:12] == [(float(i), -float(i)) for i in range(12)]
    assert stages.consumer.opened >= 24
    assert _count(metrics.TRANSPORT_TENSORS, peer="vae", mode="cuda_ipc") >= ipc_before + 24
    assert pool.leased == 0  # released by the VAE or taken back when the session ended


def test_vae_puts_the_releases_on_the_first_message_of_the_chunk():
    chunk = Chunk(data=b"x" * (3 << 20), num_frames=4, num_audio_samples=640, video_decode_seconds=0.0,
                  audio_decode_seconds=0.0, mux_seconds=0.0)
    rv, ra = pb.Release(pool_id="p", slot=1, generation=5), pb.Release(pool_id="p", slot=2, generation=6)
    messages = chunk_messages(0, chunk, release_video=rv, release_audio=ra)
    assert len(messages) == 3
    assert messages[0].release_video == rv and messages[0].release_audio == ra
    assert not any(m.HasField("release_video") or m.HasField("release_audio") for m in messages[1:])
    assert not chunk_messages(0, chunk)[0].HasField("release_video")


# ---------------------------------------------------------------- the DiT's side


async def test_dit_falls_back_to_host_parts_and_counts_it_without_a_shared_gpu():
    fallbacks = _count(metrics.TRANSPORT_FALLBACKS, peer="vae")
    host = _count(metrics.TRANSPORT_TENSORS, peer="vae", mode="host")
    async with Stages() as stages, grpc.aio.insecure_channel(stages.addr) as channel:
        call = await _open_raw(channel, VAE_NO_GPU)
        _, parts = await _read_phase(call)
        call.cancel()
    assert [p.WhichOneof("where") for p in parts] == ["host", "host"]
    assert _count(metrics.TRANSPORT_FALLBACKS, peer="vae") == fallbacks + 1
    assert _count(metrics.TRANSPORT_TENSORS, peer="vae", mode="host") >= host + 2
    assert stages.exporter.pools == []  # no pool is created for a host session


async def test_dit_without_cuda_never_offers_ipc_and_counts_no_fallback():
    fallbacks = _count(metrics.TRANSPORT_FALLBACKS, peer="vae")
    exporter = DiTServicer(FakeDiT()).exporter  # DiTConfig() runs on the CPU
    assert not exporter.offered and exporter.session(VAE_HELLO) is None
    assert _count(metrics.TRANSPORT_FALLBACKS, peer="vae") == fallbacks


async def test_stale_or_unknown_release_fails_that_session_only():
    async with Stages(num_slots=8) as stages, grpc.aio.insecure_channel(stages.addr) as channel:
        bad, good = await _open_raw(channel, VAE_HELLO), await _open_raw(channel, VAE_HELLO)
        _, bad_parts = await _read_phase(bad)
        await bad.write(_release(bad_parts[0], generation=bad_parts[0].cuda.generation + 1000))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            while True:
                await asyncio.wait_for(bad.read(), 10)
        # the other session goes on, releasing and acking as the gateway does, for more phases than slots
        for _ in range(6):
            meta, parts = await _read_phase(good)
            assert [p.WhichOneof("where") for p in parts] == ["cuda", "cuda"]
            for part in parts:
                await good.write(_release(part))
            await good.write(_ack(meta))
        await good.write(_release(parts[0]))  # a doubled release fails this session too
        with pytest.raises(grpc.aio.AioRpcError) as doubled:
            while True:
                await asyncio.wait_for(good.read(), 10)
        await asyncio.sleep(0.1)
        assert stages.pool.leased == 0
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "holds no such lease" in err.value.details() and f"slot {bad_parts[0].cuda.slot}" in err.value.details()
    assert doubled.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_release_in_a_host_session_is_a_clear_error():
    async with Stages() as stages, grpc.aio.insecure_channel(stages.addr) as channel:
        call = await _open_raw(channel, VAE_NO_GPU)
        await _read_phase(call)
        await call.write(dit_pb2.StreamRequest(release=pb.Release(pool_id="x", slot=0, generation=1)))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            while True:
                await asyncio.wait_for(call.read(), 10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "host bytes" in err.value.details()


async def test_session_end_takes_back_every_slot_it_holds():
    async with Stages(num_slots=6, max_phases_ahead=3) as stages, grpc.aio.insecure_channel(stages.addr) as channel:
        call = await _open_raw(channel, VAE_HELLO)
        phases = [await _read_phase(call) for _ in range(3)]  # 6 slots leased, none released
        assert stages.pool.leased == 6
        assert _count(metrics.IPC_LEASED_SLOTS, peer="vae") == 6
        call.cancel()
        for _ in range(100):
            if stages.pool.leased == 0:
                break
            await asyncio.sleep(0.02)
        assert stages.pool.leased == 0 and _count(metrics.IPC_LEASED_SLOTS, peer="vae") == 0
        # the next session starts with a free pool: all of it goes by IPC again
        call = await _open_raw(channel, VAE_HELLO)
        again = [await _read_phase(call) for _ in range(3)]
        call.cancel()
    assert all(p.WhichOneof("where") == "cuda" for _, parts in again for p in parts)
    late = phases[0][1][0].cuda
    with pytest.raises(IpcError, match="stale release"):  # the departed consumer's late release
        stages.pool.ledger.release(late.slot, late.generation)


def test_ledger_reclaims_one_lease_and_reuses_freed_slots_last():
    ledger = SlotLedger(3)
    a, b = ledger.lease(), ledger.lease()
    assert ledger.reclaim(*a) and not ledger.reclaim(*a) and ledger.leased == 1
    with pytest.raises(IpcError, match="stale release"):
        ledger.release(*a)
    assert ledger.lease()[0] == 2  # the never-used slot before the one just taken back
    assert ledger.lease()[0] == a[0]
    assert not ledger.reclaim(b[0], b[1] + 1)  # another generation of a leased slot is left alone
    assert ledger.leased == 3


def test_full_pool_falls_back_to_host_bytes_and_counts_it():
    pool = LedgerPool("cuda:0", 2 << 20, 2)
    leases = SessionLeases(pool, "test-full")
    fallbacks = _count(metrics.TRANSPORT_FALLBACKS, peer="test-full")
    kinds = [leases.send(torch.ones(4))[0].WhichOneof("where") for _ in range(3)]
    assert kinds == ["cuda", "cuda", "host"]
    assert _count(metrics.TRANSPORT_FALLBACKS, peer="test-full") == fallbacks + 1
    assert leases.held == 2 and leases.close() == 2 and pool.leased == 0
    big = leases.send(torch.ones(1 << 19))  # 2 MiB > a 1 MiB slot
    assert big[0].WhichOneof("where") == "host"
    assert _count(metrics.TRANSPORT_FALLBACKS, peer="test-full") == fallbacks + 2


def test_exporter_falls_back_when_the_pool_cannot_be_created():
    def broken(device, pool_bytes, slots):
        raise RuntimeError("CUDA out of memory")

    exporter = IpcExporter("cuda:0", 1 << 20, 4, "test-broken", hello=lambda: DIT_HELLO, make_producer=broken)
    fallbacks = _count(metrics.TRANSPORT_FALLBACKS, peer="test-broken")
    assert exporter.session(VAE_HELLO) is None and exporter.session(VAE_HELLO) is None
    assert _count(metrics.TRANSPORT_FALLBACKS, peer="test-broken") == fallbacks + 2


def test_dit_config_sizes_the_pool():
    assert DiTConfig().ipc_pool_slots == 6 and DiTConfig(max_phases_ahead=3).ipc_pool_slots == 8
    assert DiTConfig(ipc_slots=4).ipc_pool_slots == 4
    with pytest.raises(ValueError, match="dit.ipc_slot_mib=3"):
        DiTConfig(ipc_slot_mib=3)
    with pytest.raises(ValueError, match="dit.ipc_slots=1"):
        DiTConfig(ipc_slots=1)


# ---------------------------------------------------------------- the VAE's side


def test_receiver_rejects_a_cuda_part_inside_a_host_tensor():
    receiver = TensorReceiver("video latents", lambda: None)
    parts = tensor_to_parts(torch.zeros(1 << 19))  # 2 host parts
    assert receiver.add(parts[0]) == (None, None)
    with pytest.raises(IpcError, match="video latents: a CUDA IPC part arrived in the middle"):
        receiver.add(pb.TensorPart(meta=parts[0].meta, cuda=pb.CudaIpcRef(pool_id="p")))


async def test_vae_rejects_a_bad_cuda_part_for_that_call_only():
    servicer = VAEServicer(FakeVAE())  # the real IpcConsumer: without CUDA it refuses, with CUDA the ref is bad
    server = grpc.aio.server()
    vae_pb2_grpc.add_VAEServicer_to_server(servicer, server)
    addr = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    bad_ref = pb.TensorPart(meta=pb.TensorMeta(dtype=pb.FLOAT32, shape=[1, 24, 4, 4]),
                            cuda=pb.CudaIpcRef(pool_id="pool-7", slot=0, generation=1, nbytes=1536))
    start = vae_pb2.DecodeRequest(start=vae_pb2.DecodeStart(session_id="s", width=64, height=64))
    try:
        async with grpc.aio.insecure_channel(addr) as channel:
            stub = vae_pb2_grpc.VAEStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.Decode(iter([start, vae_pb2.DecodeRequest(video=bad_ref)])):
                    pass
            good = [start, *(vae_pb2.DecodeRequest(video=p) for p in tensor_to_parts(torch.full((1, 24, 4, 4), 3.0))),
                    *(vae_pb2.DecodeRequest(audio=p) for p in tensor_to_parts(torch.zeros(2, 1, 32))),
                    vae_pb2.DecodeRequest(phase_end=vae_pb2.PhaseEnd())]
            replies = [r async for r in stub.Decode(iter(good))]
    finally:
        await server.stop(0)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "video latents" in err.value.details()
    assert replies[0].data == b"phase-3" and not replies[0].HasField("release_video")


# ---------------------------------------------------------------- encoder → DiT embeddings


async def _wait_for(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def test_embeddings_go_by_ipc_and_the_dit_gives_each_slot_back_through_the_gateway():
    ipc_before = _count(metrics.TRANSPORT_TENSORS, peer="dit", mode="cuda_ipc")
    fallbacks_before = _count(metrics.TRANSPORT_FALLBACKS, peer="dit")
    prompts = ("first", "an update", "the third prompt", "four")
    async with Stages() as stages:
        pipeline = GrpcPipeline(stages.addr, stages.addr, stages.addr)
        try:
            session = await pipeline.start(SessionRequest(request_id="enc-ipc", prompt=prompts[0], seed=1, width=64,
                                                          height=64, fps=24))
            stream = session.chunks()
            count = 0
            async for _ in stream:
                count += 1
                if count <= 3:  # five prompts through a 4-slot pool: only if the slots come back
                    await session.update_prompt(f"e{count}", prompts[count])
                    await session.update_prompt(f"f{count}", prompts[count])
                if count == 8:
                    break
            (pool,) = stages.encoder_exporter.pools
            await _wait_for(lambda: pool.leased == 0)  # while the session still runs
            await stream.aclose()
            await session.cancel()
        finally:
            await pipeline.close()
    assert stages.encoder_exporter.consumers[0] == VAE_HELLO  # the DiT's hello (this server answers one)
    assert stages.dit.prompts == [float(len(p)) for p in prompts for _ in range(1 if p == prompts[0] else 2)]
    assert stages.dit_consumer.opened == 7
    assert _count(metrics.TRANSPORT_TENSORS, peer="dit", mode="cuda_ipc") == ipc_before + 7
    assert _count(metrics.TRANSPORT_FALLBACKS, peer="dit") == fallbacks_before


async def test_gateway_gives_back_the_embedding_slots_of_a_session_that_did_not_start():
    async with Stages() as stages:
        stages.dit.refuse = True
        pipeline = GrpcPipeline(stages.addr, stages.addr, stages.addr)
        try:
            for attempt in range(6):  # more attempts than the encoder pool has slots
                with pytest.raises(Exception, match="busy"):
                    await pipeline.start(SessionRequest(request_id=f"refused-{attempt}", prompt="p", seed=1,
                                                        width=64, height=64, fps=24))
                (pool,) = stages.encoder_exporter.pools
                assert pool.leased == 0
        finally:
            await pipeline.close()
    assert stages.dit_consumer.opened == 6  # the DiT copied each prompt out, then refused: no prompt_release came


async def test_gateway_names_itself_as_the_encoders_caller(monkeypatch):
    from services.encoder.grpc_server import CallerLeases

    seen: list[pb.TransportHello] = []
    monkeypatch.setattr(CallerLeases, "sent", lambda self, part, caller: seen.append(caller))
    async with Stages() as stages:
        stages.dit.refuse = True
        pipeline = GrpcPipeline(stages.addr, stages.addr, stages.addr)
        try:
            with pytest.raises(Exception, match="busy"):
                await pipeline.start(SessionRequest(request_id="named", prompt="p", seed=1, width=64, height=64,
                                                    fps=24))
        finally:
            await pipeline.close()
    assert [(h.boot_id, h.pid, list(h.gpu_uuids)) for h in seen] == [(read_boot_id(), os.getpid(), [])]


async def test_encoder_release_of_an_unknown_slot_is_invalid_argument():
    async with Stages() as stages, grpc.aio.insecure_channel(stages.addr) as channel:
        stub = encoder_pb2_grpc.EncoderStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as none_yet:
            await stub.Release(pb.Release(pool_id="x", slot=0, generation=1))
        request = encoder_pb2.EncodeRequest(session_id="s", prompt="abc", consumer=VAE_HELLO)
        (reply,) = [r async for r in stub.Encode(request)]
        ref = reply.embedding.cuda
        with pytest.raises(grpc.aio.AioRpcError) as stale:
            await stub.Release(pb.Release(pool_id=ref.pool_id, slot=ref.slot, generation=ref.generation + 1))
        await stub.Release(pb.Release(pool_id=ref.pool_id, slot=ref.slot, generation=ref.generation))
        assert stages.encoder_exporter.pools[0].leased == 0
    assert none_yet.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "no CUDA IPC pool" in none_yet.value.details()
    assert stale.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "stale release" in stale.value.details()


async def test_slots_of_an_exited_gateway_come_back_when_the_pool_runs_out():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = pb.TransportHello(boot_id=BOOT, pid=gone.pid)  # a gateway that died before passing its releases on
    alive = pb.TransportHello(boot_id=BOOT, pid=os.getpid())
    elsewhere = pb.TransportHello(boot_id="another-boot", pid=gone.pid)  # its pid means nothing here
    async with Stages() as stages, grpc.aio.insecure_channel(stages.addr) as channel:
        stub = encoder_pb2_grpc.EncoderStub(channel)

        async def encode(caller: pb.TransportHello) -> pb.TensorPart:
            request = encoder_pb2.EncodeRequest(prompt="abc", consumer=VAE_HELLO, caller=caller)
            (reply,) = [r async for r in stub.Encode(request)]
            return reply.embedding

        lost = [await encode(dead) for _ in range(3)] + [await encode(elsewhere)]
        (pool,) = stages.encoder_exporter.pools
        assert [p.WhichOneof("where") for p in lost] == ["cuda"] * 4 and pool.leased == 4
        fallbacks = _count(metrics.TRANSPORT_FALLBACKS, peer="dit")
        first = await encode(alive)  # the pool is full: the dead caller's three come back, not the other boot's
        assert first.WhichOneof("where") == "cuda" and pool.leased == 2
        assert _count(metrics.TRANSPORT_FALLBACKS, peer="dit") == fallbacks
        ref = lost[0].cuda
        with pytest.raises(grpc.aio.AioRpcError) as late:  # a taken-back lease's release is stale
            await stub.Release(pb.Release(pool_id=ref.pool_id, slot=ref.slot, generation=ref.generation))
        held = [await encode(alive) for _ in range(2)]
        assert pool.leased == 4 and all(p.WhichOneof("where") == "cuda" for p in held)
        extra = await encode(alive)  # full again, every caller alive or unknown: nothing is taken
        assert extra.WhichOneof("where") == "host" and pool.leased == 4
        assert _count(metrics.TRANSPORT_FALLBACKS, peer="dit") == fallbacks + 1
        for part in [first, *held]:  # a live caller's releases still work
            await stub.Release(pb.Release(pool_id=part.cuda.pool_id, slot=part.cuda.slot,
                                          generation=part.cuda.generation))
        assert pool.leased == 1  # the other boot's lease
    assert late.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "stale release" in late.value.details()


async def test_dit_prompt_release_follows_started():
    async with Stages() as stages, grpc.aio.insecure_channel(stages.addr) as channel:
        encoder = encoder_pb2_grpc.EncoderStub(channel)
        (reply,) = [r async for r in encoder.Encode(encoder_pb2.EncodeRequest(prompt="abcd", consumer=VAE_HELLO))]
        call = dit_pb2_grpc.DiTStub(channel).Stream()
        await call.write(dit_pb2.StreamRequest(start=dit_pb2.SessionStart(session_id="raw", seed=1, width=64,
                                                                           height=64)))
        await call.write(dit_pb2.StreamRequest(prompt=dit_pb2.PromptPart(embedding=reply.embedding)))
        kinds = [(await call.read()).WhichOneof("kind") for _ in range(2)]
        call.cancel()
    assert kinds == ["started", "prompt_release"]
    assert stages.dit.prompts == [4.0]
