from vitascope.common.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EncodeRequest(_message.Message):
    __slots__ = ("session_id", "prompt", "consumer", "trace", "caller")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_FIELD_NUMBER: _ClassVar[int]
    TRACE_FIELD_NUMBER: _ClassVar[int]
    CALLER_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt: str
    consumer: _tensor_pb2.TransportHello
    trace: _tensor_pb2.TraceContext
    caller: _tensor_pb2.TransportHello
    def __init__(self, session_id: _Optional[str] = ..., prompt: _Optional[str] = ..., consumer: _Optional[_Union[_tensor_pb2.TransportHello, _Mapping]] = ..., trace: _Optional[_Union[_tensor_pb2.TraceContext, _Mapping]] = ..., caller: _Optional[_Union[_tensor_pb2.TransportHello, _Mapping]] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("embedding", "num_tokens", "encode_seconds")
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ENCODE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    embedding: _tensor_pb2.TensorPart
    num_tokens: int
    encode_seconds: float
    def __init__(self, embedding: _Optional[_Union[_tensor_pb2.TensorPart, _Mapping]] = ..., num_tokens: _Optional[int] = ..., encode_seconds: _Optional[float] = ...) -> None: ...

class ReleaseReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
