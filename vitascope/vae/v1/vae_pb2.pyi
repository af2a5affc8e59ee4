from vitascope.common.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DecodeStart(_message.Message):
    __slots__ = ("session_id", "width", "height", "fps", "sample_rate", "consumer")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    FPS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    width: int
    height: int
    fps: int
    sample_rate: int
    consumer: _tensor_pb2.TransportHello
    def __init__(self, session_id: _Optional[str] = ..., width: _Optional[int] = ..., height: _Optional[int] = ..., fps: _Optional[int] = ..., sample_rate: _Optional[int] = ..., consumer: _Optional[_Union[_tensor_pb2.TransportHello, _Mapping]] = ...) -> None: ...

class PhaseEnd(_message.Message):
    __slots__ = ("request_index", "phase_index", "trace")
    REQUEST_INDEX_FIELD_NUMBER: _ClassVar[int]
    PHASE_INDEX_FIELD_NUMBER: _ClassVar[int]
    TRACE_FIELD_NUMBER: _ClassVar[int]
    request_index: int
    phase_index: int
    trace: _tensor_pb2.TraceContext
    def __init__(self, request_index: _Optional[int] = ..., phase_index: _Optional[int] = ..., trace: _Optional[_Union[_tensor_pb2.TraceContext, _Mapping]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("start", "video", "audio", "phase_end")
    START_FIELD_NUMBER: _ClassVar[int]
    VIDEO_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    PHASE_END_FIELD_NUMBER: _ClassVar[int]
    start: DecodeStart
    video: _tensor_pb2.TensorPart
    audio: _tensor_pb2.TensorPart
    phase_end: PhaseEnd
    def __init__(self, start: _Optional[_Union[DecodeStart, _Mapping]] = ..., video: _Optional[_Union[_tensor_pb2.TensorPart, _Mapping]] = ..., audio: _Optional[_Union[_tensor_pb2.TensorPart, _Mapping]] = ..., phase_end: _Optional[_Union[PhaseEnd, _Mapping]] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("data", "chunk_index", "num_frames", "num_audio_samples", "video_decode_seconds", "audio_decode_seconds", "mux_seconds", "release_video", "release_audio", "phase_continues", "phase_done", "trailer")
    DATA_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_FRAMES_FIELD_NUMBER: _ClassVar[int]
    NUM_AUDIO_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    VIDEO_DECODE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    AUDIO_DECODE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MUX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RELEASE_VIDEO_FIELD_NUMBER: _ClassVar[int]
    RELEASE_AUDIO_FIELD_NUMBER: _ClassVar[int]
    PHASE_CONTINUES_FIELD_NUMBER: _ClassVar[int]
    PHASE_DONE_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    chunk_index: int
    num_frames: int
    num_audio_samples: int
    video_decode_seconds: float
    audio_decode_seconds: float
    mux_seconds: float
    release_video: _tensor_pb2.Release
    release_audio: _tensor_pb2.Release
    phase_continues: ChunkEnd
    phase_done: ChunkEnd
    trailer: ChunkEnd
    def __init__(self, data: _Optional[bytes] = ..., chunk_index: _Optional[int] = ..., num_frames: _Optional[int] = ..., num_audio_samples: _Optional[int] = ..., video_decode_seconds: _Optional[float] = ..., audio_decode_seconds: _Optional[float] = ..., mux_seconds: _Optional[float] = ..., release_video: _Optional[_Union[_tensor_pb2.Release, _Mapping]] = ..., release_audio: _Optional[_Union[_tensor_pb2.Release, _Mapping]] = ..., phase_continues: _Optional[_Union[ChunkEnd, _Mapping]] = ..., phase_done: _Optional[_Union[ChunkEnd, _Mapping]] = ..., trailer: _Optional[_Union[ChunkEnd, _Mapping]] = ...) -> None: ...

class ChunkEnd(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
