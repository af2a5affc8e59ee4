"""Tensor transport between the stage services: torch tensors ⇄ `TensorPart` stream messages.

Host path: a tensor's bytes are split into parts of at most 1 MiB, one part per stream message, and
reassembled on the other side. Knows nothing about gRPC calls or which service it runs in.
"""
from __future__ import annotations

import torch

from vitascope.common.v1 import tensor_pb2 as pb

MAX_PART_BYTES = 1 << 20

_TO_PROTO = {
    torch.float32: pb.FLOAT32,
    torch.bfloat16: pb.BFLOAT16,
    torch.float16: pb.FLOAT16,
    torch.uint8: pb.UINT8,
    torch.int64: pb.INT64,
}
_FROM_PROTO = {v: k for k, v in _TO_PROTO.items()}


class TransportError(ValueError):
    """A tensor message is malformed or arrives out of order."""


def tensor_to_parts(tensor: torch.Tensor) -> list[pb.TensorPart]:
    """Split a tensor into host-byte parts of at most 1 MiB each."""
    if tensor.dtype not in _TO_PROTO:
        raise TransportError(f"dtype {tensor.dtype} cannot travel; allowed: {sorted(map(str, _TO_PROTO))}")
    meta = pb.TensorMeta(dtype=_TO_PROTO[tensor.dtype], shape=list(tensor.shape))
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
        self._meta = part.meta
        self._chunks.append(chunk.data)
        if chunk.index + 1 < chunk.count:
            return None
        meta, raw = self._meta, b"".join(self._chunks)
        self._chunks, self._meta = [], None
        return bytes_to_tensor(meta, raw, self.name)


def bytes_to_tensor(meta: pb.TensorMeta, raw: bytes, name: str) -> torch.Tensor:
    """Rebuild a tensor from its meta and its raw bytes, checking the byte count."""
    if meta.dtype not in _FROM_PROTO:
        raise TransportError(f"{name}: unknown dtype {meta.dtype}")
    dtype = _FROM_PROTO[meta.dtype]
    shape = [int(s) for s in meta.shape]
    if any(s < 0 for s in shape):
        raise TransportError(f"{name}: negative dimension in shape {shape}")
    numel = 1
    for s in shape:
        numel *= s
    expected = numel * torch.empty((), dtype=dtype).element_size()
    if len(raw) != expected:
        raise TransportError(f"{name}: {len(raw)} bytes for shape {shape} {dtype}, expected {expected}")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)
