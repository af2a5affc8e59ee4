from vitascope.common.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PromptRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROMPT_ROLE_ACTIVE: _ClassVar[PromptRole]
    PROMPT_ROLE_FALLBACK: _ClassVar[PromptRole]
PROMPT_ROLE_ACTIVE: PromptRole
PROMPT_ROLE_FALLBACK: PromptRole

class Hold(_message.Message):
    __slots__ = ("enabled", "max_seconds", "has_fallback_prompt")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    MAX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HAS_FALLBACK_PROMPT_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    max_seconds: float
    has_fallback_prompt: bool
    def __init__(self, enabled: _Optional[bool] = ..., max_seconds: _Optional[float] = ..., has_fallback_prompt: _Optional[bool] = ...) -> None: ...

class SessionStart(_message.Message):
    __slots__ = ("session_id", "seed", "width", "height", "hold", "consumer", "max_requests")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    HOLD_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    seed: int
    width: int
    height: int
    hold: Hold
    consumer: _tensor_pb2.TransportHello
    max_requests: int
    def __init__(self, session_id: _Optional[str] = ..., seed: _Optional[int] = ..., width: _Optional[int] = ..., height: _Optional[int] = ..., hold: _Optional[_Union[Hold, _Mapping]] = ..., consumer: _Optional[_Union[_tensor_pb2.TransportHello, _Mapping]] = ..., max_requests: _Optional[int] = ...) -> None: ...

class PromptPart(_message.Message):
    __slots__ = ("event_id", "role", "embedding")
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    event_id: str
    role: PromptRole
    embedding: _tensor_pb2.TensorPart
    def __init__(self, event_id: _Optional[str] = ..., role: _Optional[_Union[PromptRole, str]] = ..., embedding: _Optional[_Union[_tensor_pb2.TensorPart, _Mapping]] = ...) -> None: ...

class PhaseAck(_message.Message):
    __slots__ = ("request_index", "phase_index")
    REQUEST_INDEX_FIELD_NUMBER: _ClassVar[int]
    PHASE_INDEX_FIELD_NUMBER: _ClassVar[int]
    request_index: int
    phase_index: int
    def __init__(self, request_index: _Optional[int] = ..., phase_index: _Optional[int] = ...) -> None: ...

class StreamRequest(_message.Message):
    __slots__ = ("start", "prompt", "release", "ack")
    START_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    start: SessionStart
    prompt: PromptPart
    release: _tensor_pb2.Release
    ack: PhaseAck
    def __init__(self, start: _Optional[_Union[SessionStart, _Mapping]] = ..., prompt: _Optional[_Union[PromptPart, _Mapping]] = ..., release: _Optional[_Union[_tensor_pb2.Release, _Mapping]] = ..., ack: _Optional[_Union[PhaseAck, _Mapping]] = ...) -> None: ...

class PhaseMeta(_message.Message):
    __slots__ = ("request_index", "phase_index", "num_frames", "num_audio_samples", "audio_sample_rate", "started_event_ids", "active_event_ids", "completed_event_ids", "stage_seconds", "first_of_request", "trace")
    class StageSecondsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    REQUEST_INDEX_FIELD_NUMBER: _ClassVar[int]
    PHASE_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_FRAMES_FIELD_NUMBER: _ClassVar[int]
    NUM_AUDIO_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    AUDIO_SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    STARTED_EVENT_IDS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_EVENT_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_EVENT_IDS_FIELD_NUMBER: _ClassVar[int]
    STAGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_OF_REQUEST_FIELD_NUMBER: _ClassVar[int]
    TRACE_FIELD_NUMBER: _ClassVar[int]
    request_index: int
    phase_index: int
    num_frames: int
    num_audio_samples: int
    audio_sample_rate: int
    started_event_ids: _containers.RepeatedScalarFieldContainer[str]
    active_event_ids: _containers.RepeatedScalarFieldContainer[str]
    completed_event_ids: _containers.RepeatedScalarFieldContainer[str]
    stage_seconds: _containers.ScalarMap[str, float]
    first_of_request: bool
    trace: _tensor_pb2.TraceContext
    def __init__(self, request_index: _Optional[int] = ..., phase_index: _Optional[int] = ..., num_frames: _Optional[int] = ..., num_audio_samples: _Optional[int] = ..., audio_sample_rate: _Optional[int] = ..., started_event_ids: _Optional[_Iterable[str]] = ..., active_event_ids: _Optional[_Iterable[str]] = ..., completed_event_ids: _Optional[_Iterable[str]] = ..., stage_seconds: _Optional[_Mapping[str, float]] = ..., first_of_request: _Optional[bool] = ..., trace: _Optional[_Union[_tensor_pb2.TraceContext, _Mapping]] = ...) -> None: ...

class StreamResponse(_message.Message):
    __slots__ = ("meta", "video", "audio", "phase_end", "started", "prompt_release")
    META_FIELD_NUMBER: _ClassVar[int]
    VIDEO_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    PHASE_END_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_RELEASE_FIELD_NUMBER: _ClassVar[int]
    meta: PhaseMeta
    video: _tensor_pb2.TensorPart
    audio: _tensor_pb2.TensorPart
    phase_end: PhaseEnd
    started: Started
    prompt_release: _tensor_pb2.Release
    def __init__(self, meta: _Optional[_Union[PhaseMeta, _Mapping]] = ..., video: _Optional[_Union[_tensor_pb2.TensorPart, _Mapping]] = ..., audio: _Optional[_Union[_tensor_pb2.TensorPart, _Mapping]] = ..., phase_end: _Optional[_Union[PhaseEnd, _Mapping]] = ..., started: _Optional[_Union[Started, _Mapping]] = ..., prompt_release: _Optional[_Union[_tensor_pb2.Release, _Mapping]] = ...) -> None: ...

class PhaseEnd(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Started(_message.Message):
    __slots__ = ("kv_capacity_rows",)
    KV_CAPACITY_ROWS_FIELD_NUMBER: _ClassVar[int]
    kv_capacity_rows: int
    def __init__(self, kv_capacity_rows: _Optional[int] = ...) -> None: ...
