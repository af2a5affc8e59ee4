"""gRPC mapping of the encoder stage: EncodeRequest ⇄ EncoderService.encode. Nothing else lives here."""
from __future__ import annotations

import asyncio

import grpc

from services.common.errors import abort_with
from services.common.transport import tensor_to_parts
from services.encoder.service import EncoderService
from vitascope.encoder.v1 import encoder_pb2, encoder_pb2_grpc


class EncoderServicer(encoder_pb2_grpc.EncoderServicer):
    def __init__(self, service: EncoderService):
        self.service = service

    async def Encode(self, request: encoder_pb2.EncodeRequest, context: grpc.aio.ServicerContext):
        try:
            encoded = await asyncio.to_thread(self.service.encode, request.prompt)
        except Exception as exc:  # the one boundary where every failure becomes a status
            await abort_with(context, exc)
            return
        num_tokens = encoded.embedding.shape[0]
        for part in tensor_to_parts(encoded.embedding):
            yield encoder_pb2.EncodeResponse(embedding=part, num_tokens=num_tokens, encode_seconds=encoded.seconds)
