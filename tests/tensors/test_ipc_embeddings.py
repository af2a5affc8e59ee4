"""CUDA IPC of prompt embeddings, encoder → DiT, on the CPU: embedding slots given back through the DiT's
`prompt_release`, by the gateway for embeddings the DiT never took, or by the encoder itself for a gateway that
exited. The fakes: tests/tensors/ipc_fakes.py.
"""
import asyncio
import os
import subprocess
import sys

import grpc
import pytest

from services.common import metrics
from services.tensors.cuda_ipc import read_boot_id
from services.gateway.grpc_pipeline import GrpcPipeline
from services.gateway.pipeline import SessionRequest
from tests.tensors.ipc_fakes import BOOT, VAE_HELLO, HeldExport, Stages, metric_value, wait_for
from vitascope.common.v1 import tensor_pb2 as pb
from vitascope.dit.v1 import dit_pb2, dit_pb2_grpc
from vitascope.encoder.v1 import encoder_pb2, encoder_pb2_grpc

pytestmark = pytest.mark.cpu


async def test_embeddings_go_by_ipc_and_the_dit_gives_each_slot_back_through_the_gateway():
    ipc_before = metric_value(metrics.TRANSPORT_TENSORS, peer="dit", mode="cuda_ipc")
    fallbacks_before = metric_value(metrics.TRANSPORT_FALLBACKS, peer="dit")
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
            await wait_for(lambda: pool.leased == 0)  # while the session still runs
            await stream.aclose()
            await session.cancel()
        finally:
            await pipeline.close()
    assert stages.encoder_exporter.consumers[0] == VAE_HELLO  # the DiT's hello (this server answers one)
    assert stages.dit.prompts == [float(len(p)) for p in prompts for _ in range(1 if p == prompts[0] else 2)]
    assert stages.dit_consumer.opened == 7
    assert metric_value(metrics.TRANSPORT_TENSORS, peer="dit", mode="cuda_ipc") == ipc_before + 7
    assert metric_value(metrics.TRANSPORT_FALLBACKS, peer="dit") == fallbacks_before


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


async def test_an_encode_cancelled_while_its_embedding_is_exported_gives_the_slot_back():
    async with Stages() as stages, grpc.aio.insecure_channel(stages.addr) as channel:
        exporter = stages.encoder_exporter
        held = HeldExport(exporter, "dit")  # the copy into the pool outlives the call
        caller = pb.TransportHello(boot_id=BOOT, pid=os.getpid())  # a live gateway: never taken back as exited
        call = encoder_pb2_grpc.EncoderStub(channel).Encode(encoder_pb2.EncodeRequest(
            session_id="s", prompt="hello", consumer=VAE_HELLO, caller=caller))
        assert await asyncio.to_thread(held.exporting.wait, 10)
        call.cancel()
        await asyncio.sleep(0.2)
        held.go_on.set()
        assert await asyncio.to_thread(held.exported.wait, 10)
        (pool,) = exporter.pools
        await wait_for(lambda: pool.leased == 0)


async def test_slots_of_an_exited_gateway_come_back_when_the_pool_runs_out():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = pb.TransportHello(boot_id=BOOT, pid=gone.pid)  # a gateway that died before passing its releases on
    alive = pb.TransportHello(boot_id=BOOT, pid=os.getpid())
    elsewhere = pb.TransportHello(boot_id="another-boot", pid=gone.pid)  # its pid means nothing here
    apart = pb.TransportHello(boot_id=BOOT, pid=gone.pid, pid_namespace="pid:[4026532999]")  # nor in another container
    async with Stages() as stages, grpc.aio.insecure_channel(stages.addr) as channel:
        stub = encoder_pb2_grpc.EncoderStub(channel)

        async def encode(caller: pb.TransportHello) -> pb.TensorPart:
            request = encoder_pb2.EncodeRequest(prompt="abc", consumer=VAE_HELLO, caller=caller)
            (reply,) = [r async for r in stub.Encode(request)]
            return reply.embedding

        lost = [await encode(dead) for _ in range(2)] + [await encode(apart), await encode(elsewhere)]
        (pool,) = stages.encoder_exporter.pools
        assert [p.WhichOneof("where") for p in lost] == ["cuda"] * 4 and pool.leased == 4
        fallbacks = metric_value(metrics.TRANSPORT_FALLBACKS, peer="dit")
        first = await encode(alive)  # the pool is full: the dead caller's two come back, not the other pid worlds'
        assert first.WhichOneof("where") == "cuda" and pool.leased == 3
        assert metric_value(metrics.TRANSPORT_FALLBACKS, peer="dit") == fallbacks
        ref = lost[0].cuda
        with pytest.raises(grpc.aio.AioRpcError) as late:  # a taken-back lease's release is stale
            await stub.Release(pb.Release(pool_id=ref.pool_id, slot=ref.slot, generation=ref.generation))
        held = [await encode(alive)]
        assert pool.leased == 4 and all(p.WhichOneof("where") == "cuda" for p in held)
        extra = await encode(alive)  # full again, every caller alive or unknown: nothing is taken
        assert extra.WhichOneof("where") == "host" and pool.leased == 4
        assert metric_value(metrics.TRANSPORT_FALLBACKS, peer="dit") == fallbacks + 1
        for part in [first, *held]:  # a live caller's releases still work
            await stub.Release(pb.Release(pool_id=part.cuda.pool_id, slot=part.cuda.slot,
                                          generation=part.cuda.generation))
        assert pool.leased == 2  # the other boot's and the other PID namespace's leases
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


async def test_the_gateway_gives_back_an_embedding_it_holds_when_cancelled_before_the_stream_ends():
    class EncoderStub:  # one CUDA IPC part, then a stream end that does not come before the cancel
        def __init__(self):
            self.released = []

        def Encode(self, request):
            async def replies():
                yield encoder_pb2.EncodeResponse(embedding=pb.TensorPart(
                    meta=pb.TensorMeta(dtype=pb.FLOAT32, shape=[3, 8]),
                    cuda=pb.CudaIpcRef(pool_id="p", slot=2, generation=7, nbytes=96)))
                await asyncio.sleep(30)
            return replies()

        async def Release(self, release, timeout=None):
            self.released.append((release.slot, release.generation))

    pipeline = GrpcPipeline("127.0.0.1:1", "127.0.0.1:1", "127.0.0.1:1", cuda_ipc=False)
    pipeline.encoder = stub = EncoderStub()
    try:
        start = asyncio.create_task(pipeline.start(SessionRequest(request_id="r", prompt="p", seed=1, width=64,
                                                                  height=64, fps=24)))
        await asyncio.sleep(0.2)
        start.cancel()
        with pytest.raises(asyncio.CancelledError):
            await start
    finally:
        await pipeline.close()
    assert stub.released == [(2, 7)]
