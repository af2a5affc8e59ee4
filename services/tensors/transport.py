"""Tensor transport between the stage services: torch tensors ⇄ `TensorPart` stream messages.

Host path: a tensor's bytes are split into parts of at most 1 MiB, one part per stream message, and
reassembled on the other side. Knows nothing about gRPC calls or which service it runs in.
"""
from __future__ import annotations

import math

import torch

from services.common.errors import InvalidInput
from vitascope.common.v1 import tensor_pb2 as pb

MAX_PART_BYTES = 1 << 20
MAX_TENSOR_BYTES = 1 << 30
"""Largest tensor accepted from a stream (a phase's latents are a few MB; a prompt embedding at most ~5 MB)."""

DTYPE_TO_PROTO = {
    torch.float32: pb.FLOAT32,
    torch.bfloat16: pb.BFLOAT16,
    torch.float16: pb.FLOAT16,
    torch.uint8: pb.UINT8,
    torch.int64: pb.INT64,
}
PROTO_TO_DTYPE = {v: k for k, v in DTYPE_TO_PROTO.items()}


class TransportError(InvalidInput):
    """A tensor message is malformed or arrives out of order (the sender's fault: INVALID_ARGUMENT)."""


def tensor_to_parts(tensor: torch.Tensor) -> list[pb.TensorPart]:
    """Split a tensor into host-byte parts of at most 1 MiB each."""
    if tensor.dtype not in DTYPE_TO_PROTO:
        raise TransportError(f"dtype {tensor.dtype} cannot travel; allowed: {sorted(map(str, DTYPE_TO_PROTO))}")
    meta = pb.TensorMeta(dtype=DTYPE_TO_PROTO[tensor.dtype], shape=list(tensor.shape))
    flat = tensor.detach().contiguous().to("cpu").reshape(-1)
    raw = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    count = max(1, -(-len(raw) // MAX_PART_BYTES))
    return [
        pb.TensorPart(meta=meta, host=pb.HostChunk(
            data=raw[i * MAX_PART_BYTES:(i + 1) * MAX_PART_BYTES], index=i, count=count))
        for i in range(count)
    ]


class TensorAssembler:
    """Collect the parts of one tensor at a time; `add` returns the tensor once it is complete."""

    def __init__(self, name: str):
        self.name = name
        self._chunks: list[bytes] = []
        self._meta: pb.TensorMeta | None = None
        self._count = self._expected = self._received = 0  # the tensor under way: parts and bytes announced, bytes in

    def add(self, part: pb.TensorPart) -> torch.Tensor | None:
        """Append one part; return the finished tensor on the last part, else None."""
        if part.WhichOneof("where") != "host":
            raise TransportError(f"{self.name}: only host parts are supported here, got {part.WhichOneof('where')}")
        chunk = part.host
        if chunk.index != len(self._chunks) or chunk.count < 1 or chunk.index >= chunk.count:
            raise TransportError(
                f"{self.name}: part {chunk.index} of {chunk.count} arrived after {len(self._chunks)} parts")
        if self._meta is not None and (self._meta.dtype, list(self._meta.shape)) != (part.meta.dtype, list(part.meta.shape)):
            raise TransportError(f"{self.name}: parts of one tensor disagree on dtype or shape")
        if chunk.index == 0:
            expected = tensor_nbytes(part.meta, self.name)
            if expected > MAX_TENSOR_BYTES:
                raise TransportError(f"{self.name}: {expected} bytes announced, more than the {MAX_TENSOR_BYTES} "
                                     "accepted")
            if chunk.count != max(1, -(-expected // MAX_PART_BYTES)):
                raise TransportError(f"{self.name}: {chunk.count} parts announced for {expected} bytes "
                                     f"(parts hold {MAX_PART_BYTES} bytes)")
            self._count, self._expected, self._received = chunk.count, expected, 0
        elif chunk.count != self._count:
            raise TransportError(f"{self.name}: part {chunk.index} announces {chunk.count} parts, the first "
                                 f"announced {self._count}")
        last = chunk.index + 1 == chunk.count
        size = self._expected - self._received if last else MAX_PART_BYTES
        if len(chunk.data) != size:  # every part full but the last, which holds the rest: nothing buffers beyond
            raise TransportError(f"{self.name}: part {chunk.index} of {chunk.count} holds {len(chunk.data)} bytes, "
                                 f"expected {size} of the {self._expected} announced")
        self._meta = part.meta
        self._chunks.append(chunk.data)
        self._received += size
        if not last:
            return None
        meta, raw = self._meta, b"".join(self._chunks)
        self._chunks, self._meta = [], None
        return bytes_to_tensor(meta, raw, self.name)


def tensor_nbytes(meta: pb.TensorMeta, name: str) -> int:
    """Bytes of the tensor a meta describes; unknown dtypes and negative dimensions are errors."""
    if meta.dtype not in PROTO_TO_DTYPE:
        raise TransportError(f"{name}: unknown dtype {meta.dtype}")
    shape = [int(s) for s in meta.shape]
    if any(s < 0 for s in shape):
        raise TransportError(f"{name}: negative dimension in shape {shape}")
    return math.prod(shape) * torch.empty((), dtype=PROTO_TO_DTYPE[meta.dtype]).element_size()


def bytes_to_tensor(meta: pb.TensorMeta, raw: bytes, name: str) -> torch.Tensor:
    """Rebuild a tensor from its meta and its raw bytes, checking the byte count."""
    expected = tensor_nbytes(meta, name)
    dtype, shape = PROTO_TO_DTYPE[meta.dtype], [int(s) for s in meta.shape]
    numel = math.prod(shape)
    if len(raw) != expected:
        raise TransportError(f"{name}: {len(raw)} bytes for shape {shape} {dtype}, expected {expected}")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)
