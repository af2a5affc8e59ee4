"""The gateway sees a stage go down the moment its process stops serving, and up again when a new process serves on
the same address; each loss advances the stage's epoch. Real gRPC health servers on loopback."""
import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.common.grpc_server import CHANNEL_OPTIONS
from services.gateway.stage_health import StageHealth
from tools.ports import free_ports

pytestmark = pytest.mark.cpu
NAME = "vitascope.dit.v1.DiT"


async def _serve(port: int, status) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await servicer.set(NAME, status)
    await server.start()
    return server, servicer


async def _until(predicate, timeout: float = 10.0) -> float:
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < timeout, "not reached in time"
        await asyncio.sleep(0.02)
    return time.monotonic() - started


async def test_a_stage_is_down_until_serving_and_down_again_when_its_process_goes():
    port = free_ports(1)[0]
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS)
    downs = []
    watcher = StageHealth({"dit": channel}, {"dit": NAME}, retry_s=0.1, on_down=downs.append)
    watcher.start()
    try:
        assert watcher.down() == ["dit"]  # nothing answers yet
        server, servicer = await _serve(port, health_pb2.HealthCheckResponse.NOT_SERVING)
        await asyncio.sleep(0.3)
        assert watcher.down() == ["dit"]  # alive but still loading
        await servicer.set(NAME, health_pb2.HealthCheckResponse.SERVING)
        await _until(lambda: not watcher.down())
        epoch = watcher.epoch("dit")
        await server.stop(None)  # the process dies
        assert await _until(lambda: watcher.down() == ["dit"]) < 2.0
        assert watcher.epoch("dit") == epoch + 1 and downs == ["dit"]
        server, _ = await _serve(port, health_pb2.HealthCheckResponse.SERVING)  # restarted on the same port
        await _until(lambda: not watcher.down())
        assert watcher.report()["dit"]["serving"] is True
        await server.stop(None)
    finally:
        await watcher.close()
        await channel.close()


async def test_wait_ready_names_the_stages_still_down_at_the_deadline():
    up_port, down_port = free_ports(2)
    server, _ = await _serve(up_port, health_pb2.HealthCheckResponse.SERVING)
    channels = {name: grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS)
                for name, port in (("encoder", up_port), ("vae", down_port))}
    watcher = StageHealth(channels, {"encoder": NAME, "vae": NAME}, retry_s=0.1)
    watcher.start()
    try:
        started = time.monotonic()
        assert await watcher.wait_ready(0.5) == ["vae"]
        assert 0.45 <= time.monotonic() - started < 2.0
        late, _ = await _serve(down_port, health_pb2.HealthCheckResponse.SERVING)
        assert await watcher.wait_ready(10) == []
        await late.stop(None)
    finally:
        await watcher.close()
        for channel in channels.values():
            await channel.close()
        await server.stop(None)
