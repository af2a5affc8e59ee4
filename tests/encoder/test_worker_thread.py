"""The encoder servicer runs every encode, and what is sent of it, on its service's one worker thread."""
import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from services.encoder.grpc_server import EncoderServicer
from services.encoder.service import Encoded
from vitascope.encoder.v1 import encoder_pb2, encoder_pb2_grpc

pytestmark = pytest.mark.cpu


class RecordingEncoder:
    """Notes the thread of every encode."""

    def __init__(self) -> None:
        self.worker = ThreadPoolExecutor(1, "encoder")
        self.threads: set[str] = set()

    def encode(self, prompt: str) -> Encoded:
        self.threads.add(threading.current_thread().name)
        return Encoded(embedding=torch.ones(3, 8), seconds=0.001)


async def test_every_encode_runs_on_the_services_worker_thread():
    # on the event loop's default executor the encodes ran on whichever of its lazily started threads was free: a
    # thread added late in a soak ran torch and grew an OpenMP team of its own (the encoder 16 -> 18 threads)
    service = RecordingEncoder()
    server = grpc.aio.server()
    encoder_pb2_grpc.add_EncoderServicer_to_server(EncoderServicer(service), server)
    addr = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    try:
        async with grpc.aio.insecure_channel(addr) as channel:
            stub = encoder_pb2_grpc.EncoderStub(channel)

            async def encode(k: int) -> int:
                replies = [r async for r in stub.Encode(encoder_pb2.EncodeRequest(session_id=f"s{k}", prompt="p"))]
                return replies[-1].num_tokens

            assert await asyncio.gather(*(encode(k) for k in range(8))) == [3] * 8
    finally:
        await server.stop(0)
    assert service.threads == {"encoder_0"}
