from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    UINT8: _ClassVar[DType]
    INT64: _ClassVar[DType]
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
BFLOAT16: DType
FLOAT16: DType
UINT8: DType
INT64: DType

class TensorMeta(_message.Message):
    __slots__ = ("dtype", "shape")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class HostChunk(_message.Message):
    __slots__ = ("data", "index", "count")
    DATA_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    index: int
    count: int
    def __init__(self, data: _Optional[bytes] = ..., index: _Optional[int] = ..., count: _Optional[int] = ...) -> None: ...

class CudaIpcRef(_message.Message):
    __slots__ = ("pool_id", "slot", "generation", "offset_bytes", "nbytes", "event_handle", "device_uuid")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    slot: int
    generation: int
    offset_bytes: int
    nbytes: int
    event_handle: bytes
    device_uuid: str
    def __init__(self, pool_id: _Optional[str] = ..., slot: _Optional[int] = ..., generation: _Optional[int] = ..., offset_bytes: _Optional[int] = ..., nbytes: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., device_uuid: _Optional[str] = ...) -> None: ...

class TensorPart(_message.Message):
    __slots__ = ("meta", "host", "cuda")
    META_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    CUDA_FIELD_NUMBER: _ClassVar[int]
    meta: TensorMeta
    host: HostChunk
    cuda: CudaIpcRef
    def __init__(self, meta: _Optional[_Union[TensorMeta, _Mapping]] = ..., host: _Optional[_Union[HostChunk, _Mapping]] = ..., cuda: _Optional[_Union[CudaIpcRef, _Mapping]] = ...) -> None: ...

class Release(_message.Message):
    __slots__ = ("pool_id", "slot", "generation")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    slot: int
    generation: int
    def __init__(self, pool_id: _Optional[str] = ..., slot: _Optional[int] = ..., generation: _Optional[int] = ...) -> None: ...

class TransportHello(_message.Message):
    __slots__ = ("boot_id", "gpu_uuids", "pid", "pid_namespace")
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    GPU_UUIDS_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    PID_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    boot_id: str
    gpu_uuids: _containers.RepeatedScalarFieldContainer[str]
    pid: int
    pid_namespace: str
    def __init__(self, boot_id: _Optional[str] = ..., gpu_uuids: _Optional[_Iterable[str]] = ..., pid: _Optional[int] = ..., pid_namespace: _Optional[str] = ...) -> None: ...

class TraceContext(_message.Message):
    __slots__ = ("traceparent",)
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    traceparent: str
    def __init__(self, traceparent: _Optional[str] = ...) -> None: ...
