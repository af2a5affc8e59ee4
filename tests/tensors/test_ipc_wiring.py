"""CUDA IPC wiring of the stage services on the CPU: the Hello RPC, the gateway's handshake and release relay, the
DiT's per-session slot leases (fallback, stale releases, slots taken back at session end) and the VAE's handling
of CUDA parts. The encoder → DiT leg: tests/tensors/test_ipc_embeddings.py; the fakes: tests/tensors/ipc_fakes.py.
"""
import asyncio
import dataclasses
import os

import grpc
import pytest
import torch

from services.common import metrics
from services.common.config import DiTConfig
from services.tensors.cuda_ipc import IpcError, SlotLedger, gpu_uuids, read_boot_id
from services.tensors.stage_transport import IpcExporter, SessionLeases, TensorReceiver, register_transport
from services.tensors.transport import tensor_to_parts
from services.dit.grpc_server import DiTServicer
from services.gateway.grpc_pipeline import GrpcPipeline
from services.gateway.pipeline import SessionRequest
from services.vae.grpc_server import VAEServicer, chunk_messages
from services.vae.service import Chunk
from tests.tensors.ipc_fakes import (DIT_HELLO, VAE_HELLO, VAE_NO_GPU, FakeDiT, FakeVAE, HeldExport, LedgerPool,
                                    Stages, ack_request, metric_value, open_raw, read_phase, release_request,
                                    wait_for)
from vitascope.common.v1 import tensor_pb2 as pb
from vitascope.common.v1 import transport_pb2, transport_pb2_grpc
from vitascope.dit.v1 import dit_pb2
from vitascope.vae.v1 import vae_pb2, vae_pb2_grpc

pytestmark = pytest.mark.cpu


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
    ipc_before = metric_value(metrics.TRANSPORT_TENSORS, peer="vae", mode="cuda_ipc")
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
        pool = stages.pool
        # released by the VAE, or taken back by the DiT when its stream ends (after the cancel, on a loaded machine
        # later than at once)
        await wait_for(lambda: pool.leased == 0)
    assert stages.exporter.consumers[0] == VAE_HELLO
    assert [c.data for c in chunks] == [b"phase-%d" % i for i in range(12)]
    assert {c.timings.vae for c in chunks} == {0.003}  # audio decodes beside the video: the larger of the two
    assert stages.vae.phases[:12] == [(float(i), -float(i)) for i in range(12)]
    assert stages.consumer.opened >= 24
    assert metric_value(metrics.TRANSPORT_TENSORS, peer="vae", mode="cuda_ipc") >= ipc_before + 24


def test_vae_puts_the_releases_on_the_first_message_of_the_chunk():
    chunk = Chunk(data=b"x" * (3 << 20), num_frames=4, num_audio_samples=640, video_decode_seconds=0.0,
                  audio_decode_seconds=0.0, mux_seconds=0.0)
    rv, ra = pb.Release(pool_id="p", slot=1, generation=5), pb.Release(pool_id="p", slot=2, generation=6)
    messages = chunk_messages(0, chunk, release_video=rv, release_audio=ra)
    assert len(messages) == 3
    assert messages[0].release_video == rv and messages[0].release_audio == ra
    assert not any(m.HasField("release_video") or m.HasField("release_audio") for m in messages[1:])
    assert not chunk_messages(0, chunk)[0].HasField("release_video")


def test_vae_marks_only_the_final_message_of_a_chunk_with_its_end():
    chunk = Chunk(data=b"x" * (3 << 20), num_frames=4, num_audio_samples=640, video_decode_seconds=0.0,
                  audio_decode_seconds=0.0, mux_seconds=0.0)
    ends = lambda messages: [m.WhichOneof("end") for m in messages]  # noqa: E731
    assert ends(chunk_messages(0, chunk)) == [None, None, "phase_done"]
    assert ends(chunk_messages(0, dataclasses.replace(chunk, phase_continues=True))) == [None, None, "phase_continues"]
    assert ends(chunk_messages(0, dataclasses.replace(chunk, data=b""), trailer=True)) == ["trailer"]


# ---------------------------------------------------------------- the DiT's side


async def test_dit_falls_back_to_host_parts_and_counts_it_without_a_shared_gpu():
    fallbacks = metric_value(metrics.TRANSPORT_FALLBACKS, peer="vae")
    host = metric_value(metrics.TRANSPORT_TENSORS, peer="vae", mode="host")
    async with Stages() as stages, grpc.aio.insecure_channel(stages.addr) as channel:
        call = await open_raw(channel, VAE_NO_GPU)
        _, parts = await read_phase(call)
        call.cancel()
    assert [p.WhichOneof("where") for p in parts] == ["host", "host"]
    assert metric_value(metrics.TRANSPORT_FALLBACKS, peer="vae") == fallbacks + 1
    assert metric_value(metrics.TRANSPORT_TENSORS, peer="vae", mode="host") >= host + 2
    assert stages.exporter.pools == []  # no pool is created for a host session


async def test_dit_without_cuda_never_offers_ipc_and_counts_no_fallback():
    fallbacks = metric_value(metrics.TRANSPORT_FALLBACKS, peer="vae")
    exporter = DiTServicer(FakeDiT()).exporter  # DiTConfig() runs on the CPU
    assert not exporter.offered and exporter.session(VAE_HELLO) is None
    assert metric_value(metrics.TRANSPORT_FALLBACKS, peer="vae") == fallbacks


async def test_stale_or_unknown_release_fails_that_session_only():
    async with Stages(num_slots=8) as stages, grpc.aio.insecure_channel(stages.addr) as channel:
        bad, good = await open_raw(channel, VAE_HELLO), await open_raw(channel, VAE_HELLO)
        _, bad_parts = await read_phase(bad)
        await bad.write(release_request(bad_parts[0], generation=bad_parts[0].cuda.generation + 1000))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            while True:
                await asyncio.wait_for(bad.read(), 10)
        # the other session goes on, releasing and acking as the gateway does, for more phases than slots
        for _ in range(6):
            meta, parts = await read_phase(good)
            assert [p.WhichOneof("where") for p in parts] == ["cuda", "cuda"]
            for part in parts:
                await good.write(release_request(part))
            await good.write(ack_request(meta))
        await good.write(release_request(parts[0]))  # a doubled release fails this session too
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
        call = await open_raw(channel, VAE_NO_GPU)
        await read_phase(call)
        await call.write(dit_pb2.StreamRequest(release=pb.Release(pool_id="x", slot=0, generation=1)))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            while True:
                await asyncio.wait_for(call.read(), 10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "host bytes" in err.value.details()


async def test_a_session_cancelled_while_its_phase_is_exported_leaves_no_slot_leased():
    async with Stages() as stages, grpc.aio.insecure_channel(stages.addr) as channel:
        held = HeldExport(stages.exporter, "vae")
        call = await open_raw(channel, VAE_HELLO)
        assert await asyncio.to_thread(held.exporting.wait, 10)
        call.cancel()  # the client leaves; the phase's export runs on in the DiT's worker thread
        await asyncio.sleep(0.2)
        held.go_on.set()
        assert await asyncio.to_thread(held.exported.wait, 10)
        await wait_for(lambda: stages.pool.leased == 0)
        assert stages.pool.leased == 0 and stages.pool.ledger.leased == 0


async def test_session_end_takes_back_every_slot_it_holds():
    async with Stages(num_slots=6, max_phases_ahead=3) as stages, grpc.aio.insecure_channel(stages.addr) as channel:
        call = await open_raw(channel, VAE_HELLO)
        phases = [await read_phase(call) for _ in range(3)]  # 6 slots leased, none released
        assert stages.pool.leased == 6
        assert metric_value(metrics.IPC_LEASED_SLOTS, peer="vae") == 6
        call.cancel()
        for _ in range(500):
            if stages.pool.leased == 0:
                break
            await asyncio.sleep(0.02)
        assert stages.pool.leased == 0 and metric_value(metrics.IPC_LEASED_SLOTS, peer="vae") == 0
        # the next session starts with a free pool: all of it goes by IPC again
        call = await open_raw(channel, VAE_HELLO)
        again = [await read_phase(call) for _ in range(3)]
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
    fallbacks = metric_value(metrics.TRANSPORT_FALLBACKS, peer="test-full")
    kinds = [leases.send(torch.ones(4))[0].WhichOneof("where") for _ in range(3)]
    assert kinds == ["cuda", "cuda", "host"]
    assert metric_value(metrics.TRANSPORT_FALLBACKS, peer="test-full") == fallbacks + 1
    assert leases.held == 2 and leases.close() == 2 and pool.leased == 0
    big = SessionLeases(pool, "test-full").send(torch.ones(1 << 19))  # 2 MiB > a 1 MiB slot
    assert big[0].WhichOneof("where") == "host"
    assert metric_value(metrics.TRANSPORT_FALLBACKS, peer="test-full") == fallbacks + 2


def test_exporter_falls_back_when_the_pool_cannot_be_created():
    def broken(device, pool_bytes, slots):
        raise RuntimeError("CUDA out of memory")

    exporter = IpcExporter("cuda:0", 1 << 20, 4, "test-broken", hello=lambda: DIT_HELLO, make_producer=broken)
    fallbacks = metric_value(metrics.TRANSPORT_FALLBACKS, peer="test-broken")
    assert exporter.session(VAE_HELLO) is None and exporter.session(VAE_HELLO) is None
    assert metric_value(metrics.TRANSPORT_FALLBACKS, peer="test-broken") == fallbacks + 2


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


def test_a_send_after_the_session_closed_gives_its_slot_back():
    # a cancelled call's worker thread may still be exporting when the call ends and closes its leases
    pool = LedgerPool("cuda:0", 4 << 20, 4)
    leases = SessionLeases(pool, "test-closed")
    closing_during_export = pool.export

    def export(tensor):
        part = closing_during_export(tensor)
        leases.close()  # the call ended while this export ran
        return part

    pool.export = export
    with pytest.raises(IpcError, match="session ended while a tensor was exported"):
        leases.send(torch.ones(4))
    assert pool.leased == 0 and leases.held == 0
    with pytest.raises(IpcError, match="the session ended"):
        leases.send(torch.ones(4))
    assert pool.leased == 0


def test_receiver_leaves_an_out_of_memory_error_alone():
    # the consumer's own shortage is not a bad part: it must not turn into an IpcError (INVALID_ARGUMENT)
    class ShortOfMemory:
        def open(self, part, device):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")

    receiver = TensorReceiver("video latents", ShortOfMemory)
    with pytest.raises(torch.OutOfMemoryError):
        receiver.add(pb.TensorPart(meta=pb.TensorMeta(dtype=pb.FLOAT32, shape=[4]), cuda=pb.CudaIpcRef(pool_id="p")))
