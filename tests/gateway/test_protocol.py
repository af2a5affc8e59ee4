"""Parsing and validation of client frames (pure, no sockets)."""
import json

import grpc
import pytest

from services.common.errors import ClientError
from services.common.config import GatewayConfig
from services.gateway.errors import ERROR_FAULTS, ErrorCode, ErrorMessage, ProtocolError
from services.gateway.grpc_pipeline import pipeline_error
from services.gateway.pipeline import BackendBusy, BackendFailed, BackendUnavailable, InvalidRequest
from services.gateway.protocol import (
    ChunkMetadata,
    MessageLimits,
    SessionInteraction,
    SessionPing,
    SessionStart,
    SessionStop,
    parse_client_text,
)

pytestmark = pytest.mark.cpu

LIMITS = MessageLimits(max_start_bytes=2000, max_interaction_bytes=500, max_prompt_chars=100)
# limits wide enough for the number literals below, which must fail as numbers, not as sizes
WIDE_LIMITS = MessageLimits(max_start_bytes=1 << 20, max_interaction_bytes=1 << 16, max_prompt_chars=200)
HUGE_INT = "9" * 400  # valid JSON, a Python int, too large for a float
TOO_LONG_INT = "1" * 5000  # valid JSON, above Python's int-string conversion limit


def parse(body) -> object:
    return parse_client_text(json.dumps(body), LIMITS)


def code_of(body_or_text) -> ErrorCode:
    text = body_or_text if isinstance(body_or_text, str) else json.dumps(body_or_text)
    with pytest.raises(ProtocolError) as info:
        parse_client_text(text, LIMITS)
    return info.value.code


def test_full_start_with_sampling_params_and_hold():
    msg = parse({
        "type": "session.start", "prompt": "a lake", "model": "m", "format": "m4s",
        "sampling_params": {"seed": 7, "width": 64, "num_frames": 99, "guidance_scale": 1.0},
        "height": 48, "fps": 24, "extra_params": {"hold_for_prompt": True, "hold_max_seconds": 2.5,
                                                  "hold_fallback_prompt": "idle", "pace": 1},
    })
    assert isinstance(msg, SessionStart)
    assert (msg.prompt, msg.model, msg.seed, msg.width, msg.height, msg.fps) == ("a lake", "m", 7, 64, 48, 24)
    assert msg.hold.enabled and msg.hold.max_seconds == 2.5 and msg.hold.fallback_prompt == "idle"
    assert dict(msg.extra_params) == {"pace": 1}  # hold keys are consumed, the rest passes through


def test_top_level_field_wins_over_sampling_params():
    msg = parse({"type": "session.start", "prompt": "p", "seed": 1, "sampling_params": {"seed": 2}})
    assert msg.seed == 1


def test_control_messages():
    assert isinstance(parse({"type": "session.stop"}), SessionStop)
    assert isinstance(parse({"type": "session.ping"}), SessionPing)
    msg = parse({"type": "session.interaction",
                 "interaction": {"event_id": "e1", "event": {"prompt": "storm"}, "transition_chunks": 0}})
    assert msg == SessionInteraction(prompt="storm", event_id="e1", transition_chunks=0)
    assert parse({"type": "session.interaction", "interaction": {"event": {"prompt": "x"}}}).event_id is None


@pytest.mark.parametrize("text,code", [
    ("not json", ErrorCode.INVALID_JSON),
    ("[1, 2]", ErrorCode.INVALID_JSON),
    ({"prompt": "no type"}, ErrorCode.UNKNOWN_TYPE),
    ({"type": "session.dance"}, ErrorCode.UNKNOWN_TYPE),
    ({"type": "session.start"}, ErrorCode.MISSING_FIELD),
    ({"type": "session.start", "prompt": 5}, ErrorCode.INVALID_TYPE),
    ({"type": "session.start", "prompt": "p", "seed": "7"}, ErrorCode.INVALID_TYPE),
    ({"type": "session.start", "prompt": "p", "width": True}, ErrorCode.INVALID_TYPE),
    ({"type": "session.start", "prompt": "p", "seed": -1}, ErrorCode.INVALID_VALUE),
    ({"type": "session.start", "prompt": "p", "width": 0}, ErrorCode.INVALID_VALUE),
    ({"type": "session.start", "prompt": "p", "extra_params": []}, ErrorCode.INVALID_TYPE),
    ({"type": "session.start", "prompt": "p", "extra_params": {"hold_max_seconds": -1}},
     ErrorCode.INVALID_VALUE),
    ({"type": "session.start", "prompt": "p", "extra_params": {"hold_for_prompt": "yes"}},
     ErrorCode.INVALID_TYPE),
    ({"type": "session.start", "prompt": "p", "format": "mp4"}, ErrorCode.UNSUPPORTED_FORMAT),
    ({"type": "session.start", "prompt": "p", "image_reference": {"image_url": "x"}},
     ErrorCode.UNSUPPORTED_FIELD),
    ({"type": "session.start", "prompt": "   "}, ErrorCode.EMPTY_PROMPT),
    ({"type": "session.start", "prompt": "x" * 101}, ErrorCode.PROMPT_TOO_LONG),
    ({"type": "session.start", "prompt": "x" * 1990}, ErrorCode.MESSAGE_TOO_LARGE),
    ({"type": "session.interaction"}, ErrorCode.MISSING_FIELD),
    ({"type": "session.interaction", "interaction": {"event_id": "e"}}, ErrorCode.MISSING_FIELD),
    ({"type": "session.interaction", "interaction": {"event": {"prompt": 3}}}, ErrorCode.INVALID_TYPE),
    ({"type": "session.interaction", "interaction": {"event": {"prompt": ""}}}, ErrorCode.EMPTY_PROMPT),
    ({"type": "session.interaction", "interaction": {"event": {"prompt": "p", "negative_prompt": "n"}}},
     ErrorCode.UNSUPPORTED_FIELD),
    ({"type": "session.interaction", "interaction": {"event_id": "", "event": {"prompt": "p"}}},
     ErrorCode.INVALID_VALUE),
    ({"type": "session.interaction", "interaction": {"event": {"prompt": "p" * 90}}, "pad": "x" * 500},
     ErrorCode.MESSAGE_TOO_LARGE),
])
def test_bad_frames_get_named_codes(text, code):
    assert code_of(text) is code


def test_interaction_error_carries_event_id():
    with pytest.raises(ProtocolError) as info:
        parse({"type": "session.interaction", "interaction": {"event_id": "e9", "event": {"prompt": ""}}})
    assert info.value.event_id == "e9"


def test_server_messages_serialise_to_wire_names():
    meta = ChunkMetadata(
        request_id="r", kind="media", transport_chunk_index=3, generation_chunk_index=3, request_index=0,
        phase_index=3, num_frames=17, num_audio_samples=22667, audio_sample_rate=32000, byte_length=10,
        started_event_ids=("a",), active_event_ids=("a",), completed_event_ids=(), timings={"dit": 0.1},
    ).to_wire()
    assert meta["type"] == "video.chunk_metadata" and meta["started_event_ids"] == ["a"]
    assert {"kind", "transport_chunk_index", "generation_chunk_index", "num_frames", "num_audio_samples",
            "audio_sample_rate", "byte_length", "completed_event_ids", "active_event_ids"} <= set(meta)
    err = ErrorMessage(ErrorCode.QUEUE_FULL, "busy").to_wire()
    assert err == {"type": "error", "code": "queue_full", "fault": "client", "message": "busy"}


def test_every_error_code_says_whose_fault_it_is():
    assert set(ERROR_FAULTS) == set(ErrorCode) and set(ERROR_FAULTS.values()) == {"client", "server"}
    server_side = {code for code, fault in ERROR_FAULTS.items() if fault == "server"}
    assert server_side == {ErrorCode.BACKEND_UNAVAILABLE, ErrorCode.BACKEND_FAILED, ErrorCode.INTERNAL_ERROR}
    assert ErrorMessage(ErrorCode.INVALID_VALUE, "bad seed").to_wire()["fault"] == "client"
    assert ErrorMessage(ErrorCode.INTERNAL_ERROR, "boom").to_wire()["fault"] == "server"
    # interaction_failed takes the side of the backend error behind it
    assert ErrorMessage(ErrorCode.INTERACTION_FAILED, "x", fault="server").to_wire()["fault"] == "server"
    with pytest.raises(ValueError, match="fault='nobody'"):
        ErrorMessage(ErrorCode.INTERNAL_ERROR, "boom", fault="nobody")
    with pytest.raises(ProtocolError) as info:
        parse("not a dict")
    assert isinstance(info.value, ClientError) and info.value.fault == "client"


class _RpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return "why"


@pytest.mark.parametrize("status,kind,code,fault", [
    (grpc.StatusCode.INVALID_ARGUMENT, InvalidRequest, "invalid_request", "client"),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, BackendBusy, "backend_busy", "client"),
    (grpc.StatusCode.UNAVAILABLE, BackendUnavailable, "backend_unavailable", "server"),
    (grpc.StatusCode.INTERNAL, BackendFailed, "backend_failed", "server"),
    (grpc.StatusCode.FAILED_PRECONDITION, BackendFailed, "backend_failed", "server"),  # the gateway's own order
])
def test_a_stage_status_becomes_a_gateway_error_on_the_right_side(status, kind, code, fault):
    error = pipeline_error("dit", _RpcError(status))
    assert type(error) is kind and error.code == code and error.fault == fault
    assert ERROR_FAULTS[ErrorCode(code)] == fault  # the wire code's side agrees with the exception's


def test_config_rejects_bad_values_by_name():
    with pytest.raises(ValueError, match="default_canvas"):
        GatewayConfig(allowed_canvases=((64, 48),), default_canvas=(480, 864))
    with pytest.raises(ValueError, match="queue_limit"):
        GatewayConfig(queue_limit=-1)
    with pytest.raises(ValueError, match="max_frame_bytes"):
        GatewayConfig(max_frame_bytes=10)


@pytest.mark.parametrize("field", ["guidance_scale"])
def test_number_too_large_for_float_is_a_protocol_error(field):
    text = f'{{"type": "session.start", "prompt": "p", "{field}": {HUGE_INT}}}'
    with pytest.raises(ProtocolError) as info:
        parse_client_text(text, WIDE_LIMITS)
    assert info.value.code in (ErrorCode.INVALID_TYPE, ErrorCode.INVALID_VALUE)
    assert field in info.value.message


def test_hold_seconds_too_large_for_float_is_a_protocol_error():
    text = (f'{{"type": "session.start", "prompt": "p", "extra_params": '
            f'{{"hold_for_prompt": true, "hold_max_seconds": {HUGE_INT}}}}}')
    with pytest.raises(ProtocolError) as info:
        parse_client_text(text, WIDE_LIMITS)
    assert "hold_max_seconds" in info.value.message


def test_integer_literal_too_long_to_parse_is_invalid_json():
    text = f'{{"type": "session.start", "prompt": "p", "seed": {TOO_LONG_INT}}}'
    with pytest.raises(ProtocolError) as info:
        parse_client_text(text, WIDE_LIMITS)
    assert info.value.code == ErrorCode.INVALID_JSON


@pytest.mark.parametrize("text", [
    '{"type": "session.start", "prompt": "a \\ud800 lake"}',
    '{"type": "session.start", "prompt": "ok", "extra_params": {"hold_for_prompt": true, '
    '"hold_fallback_prompt": "x\\udfff"}}',
    '{"type": "session.interaction", "interaction": {"event": {"prompt": "\\ud83d"}}}',
    '{"type": "session.interaction", "interaction": {"event_id": "e\\ud800", "event": {"prompt": "fine"}}}',
])
def test_text_that_is_not_valid_unicode_is_rejected_before_any_stage(text):
    # JSON escapes can spell lone surrogates; protobuf (and so every stage call) cannot encode them.
    with pytest.raises(ProtocolError) as info:
        parse_client_text(text, WIDE_LIMITS)
    assert info.value.code == ErrorCode.INVALID_VALUE
    assert "Unicode" in info.value.message


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_are_not_json_and_are_never_echoed(constant):
    # Python's parser takes them; echoed back in video.start they made the reply unreadable to browsers.
    text = f'{{"type": "session.start", "prompt": "p", "extra_params": {{"strength": {constant}}}}}'
    with pytest.raises(ProtocolError) as info:
        parse_client_text(text, WIDE_LIMITS)
    assert info.value.code == ErrorCode.INVALID_JSON
    assert constant in info.value.message
