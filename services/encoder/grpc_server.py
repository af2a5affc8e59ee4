"""gRPC mapping of the encoder stage: EncodeRequest ⇄ EncoderService.encode. Nothing else lives here.

Observability: each call logs with `session_id` and the caller's span from `EncodeRequest.trace` (a new trace
when absent), and records its seconds as stage `text`. Prompts are logged by length and hash only.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging

import grpc

from services.common import tracing
from services.common.errors import abort_with
from services.common.logging_setup import log_context
from services.common.metrics import STAGE_LATENCY, record_gpu_memory
from services.common.transport import tensor_to_parts
from services.encoder.service import EncoderService
from vitascope.encoder.v1 import encoder_pb2, encoder_pb2_grpc

log = logging.getLogger(__name__)


def prompt_fields(prompt: str) -> dict[str, object]:
    """What may be logged about a prompt: its length and a short hash, never the text."""
    return {"prompt_chars": len(prompt), "prompt_sha256": hashlib.sha256(prompt.encode()).hexdigest()[:12]}


class EncoderServicer(encoder_pb2_grpc.EncoderServicer):
    def __init__(self, service: EncoderService):
        self.service = service

    async def Encode(self, request: encoder_pb2.EncodeRequest, context: grpc.aio.ServicerContext):
        span = tracing.continue_trace(request.trace.traceparent)
        with log_context(session_id=request.session_id or None, **span.log_fields()):
            try:
                encoded = await asyncio.to_thread(self.service.encode, request.prompt)
            except Exception as exc:  # the one boundary where every failure becomes a status
                await abort_with(context, exc)
                return
            STAGE_LATENCY.labels(stage="text").observe(encoded.seconds)
            record_gpu_memory()
            num_tokens = encoded.embedding.shape[0]
            log.info("prompt encoded: %d tokens in %.3f s", num_tokens, encoded.seconds,
                     extra={**prompt_fields(request.prompt), "num_tokens": num_tokens,
                            "encode_s": round(encoded.seconds, 4)})
            for part in tensor_to_parts(encoded.embedding):
                yield encoder_pb2.EncodeResponse(embedding=part, num_tokens=num_tokens,
                                                 encode_seconds=encoded.seconds)


def register(server: grpc.aio.Server, service: EncoderService) -> None:
    """Add the encoder servicer to a server."""
    encoder_pb2_grpc.add_EncoderServicer_to_server(EncoderServicer(service), server)
