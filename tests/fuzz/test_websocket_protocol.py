"""Fuzzing of the websocket protocol: generated client frames against the parser, then against a live gateway.

(a) `parse_client_text` alone: valid messages of every client type and their mutations (fields dropped, renamed or
retyped, deep nesting, huge and non-finite numbers, odd Unicode, very long strings, unknown types, duplicate keys)
each give a parsed message or a `ProtocolError` with an `ErrorCode` and a message naming what was wrong.
(b) The gateway over real websockets (the fake pipeline of tests/gateway/fakes.py): generated sequences of text and
binary frames, before and after `session.start` and while a session streams; every `error` frame has a code, the
gateway stays up, no session is left active and a normal session afterwards streams to `session.done`.

Generation is derandomized and database-free, so a CI run sends the same frames every time. The number of
generated messages is counted per test and checked against the budget at the end of the module (`GENERATED`).
"""
from __future__ import annotations

import asyncio
import json
import math

import aiohttp
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from services.gateway.errors import ErrorCode, ProtocolError
from services.gateway.protocol import (
    ClientMessage,
    MessageLimits,
    SessionInteraction,
    SessionPing,
    SessionStart,
    SessionStop,
    parse_client_text,
)
from tests.gateway.fakes import (
    FakeBehaviour,
    FakePipeline,
    Transcript,
    healthz,
    read_until,
    run_good_session,
    running_gateway,
    small_config,
    ws_url,
)

pytestmark = [pytest.mark.cpu, pytest.mark.fuzz]

LIMITS = MessageLimits(max_start_bytes=64 * 1024, max_interaction_bytes=4 * 1024, max_prompt_chars=200)
PARSER_EXAMPLES = 1500
"""Generated frames for the parser alone."""
LIVE_SEQUENCES = 60
"""Generated frame sequences sent to the live gateway (1..12 frames each)."""
MIN_GENERATED = 2000
"""The issue's floor: generated messages per run, over the whole file."""
GENERATED: dict[str, int] = {}
"""Generated messages sent per test, filled as the tests run."""

# ---------------------------------------------------------------- strategies

ODD_TEXT = st.sampled_from([
    "\u202eevil\u202c", "\u200f\u200e", "\x00\x01\x1f", "\ufeff", "e\u0301" * 40, "\U0001F600" * 30, "\u0000",
    " \t\n\r ", "", "x" * 5000, "\uffff", "\u2028\u2029", "\\", '"', "{}", "null",
])
SURROGATE_ESCAPES = st.sampled_from(["\\ud800", "\\udfff", "\\ud83d", "a\\udc00b", "\\ud800\\ud800"])
SAFE_TEXT = st.text(st.characters(codec="utf-8"), max_size=40)
PROMPTS = st.one_of(SAFE_TEXT.filter(lambda s: s.strip()), ODD_TEXT, st.text(max_size=300))
HUGE_NUMBERS = st.sampled_from([2**63, -(2**63), 2**64 + 1, 10**30, 1e308, -1e308, 5e-324, -0.0, 0, -1, 2**31])
JSON_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False), HUGE_NUMBERS, PROMPTS,
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(SAFE_TEXT, inner, max_size=4)),
    max_leaves=12,
)


@st.composite
def start_messages(draw) -> dict:
    """A session.start within the test config's canvases and limits (the fields vary)."""
    body: dict = {"type": "session.start", "prompt": draw(SAFE_TEXT.filter(lambda s: s.strip()))}
    if draw(st.booleans()):
        width, height = draw(st.sampled_from([(64, 48), (48, 64)]))
        if draw(st.booleans()):
            body["size"] = f"{width}x{height}"
        else:
            body["video_params"] = {"width": width, "height": height, "fps": 24}
    if draw(st.booleans()):
        body["seed"] = draw(st.integers(min_value=0, max_value=2**63 - 1))
    if draw(st.booleans()):
        body["model"] = "fake-model"
    if draw(st.booleans()):
        body["num_frames"] = draw(st.integers(min_value=1, max_value=300))
    if draw(st.booleans()):
        body["extra_params"] = {
            "hold_for_prompt": draw(st.booleans()),
            "hold_max_seconds": draw(st.floats(min_value=0, max_value=3)),
            "pace_to_media_time": draw(st.booleans()),
            "pacing_lead_seconds": draw(st.floats(min_value=0, max_value=1)),
            "custom": draw(JSON_VALUES),
        }
    if draw(st.booleans()):
        body["sampling_params"] = {"seconds": str(draw(st.integers(min_value=1, max_value=9))),
                                   "num_inference_steps": 4, "anything": draw(JSON_VALUES)}
    return body


@st.composite
def interaction_messages(draw) -> dict:
    interaction: dict = {"event": {"prompt": draw(SAFE_TEXT.filter(lambda s: s.strip()))}}
    if draw(st.booleans()):
        interaction["event_id"] = draw(st.text(st.characters(codec="utf-8"), min_size=1, max_size=20))
    if draw(st.booleans()):
        interaction["transition_chunks"] = draw(st.one_of(st.integers(0, 8), st.just(2.0)))
    return {"type": "session.interaction", "interaction": interaction}


VALID = st.one_of(
    start_messages(), interaction_messages(),
    st.just({"type": "session.stop"}), st.just({"type": "session.ping"}),
)


def _paths(value, prefix=()) -> list[tuple]:
    """Every key path into nested dicts (the places a mutation can hit)."""
    out = []
    if isinstance(value, dict):
        for key, inner in value.items():
            out.append(prefix + (key,))
            out.extend(_paths(inner, prefix + (key,)))
    return out


def _parent(body: dict, path: tuple) -> dict:
    for key in path[:-1]:
        body = body[key]
    return body


@st.composite
def mutated_messages(draw) -> dict:
    """A valid message with one to three fields dropped, renamed, retyped or replaced by odd values."""
    body = json.loads(json.dumps(draw(VALID)))
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(body)
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent, key = _parent(body, path), path[-1]
        if key not in parent:
            continue
        action = draw(st.sampled_from(["drop", "rename", "retype", "huge", "odd", "nest"]))
        if action == "drop":
            del parent[key]
        elif action == "rename":
            parent[key + draw(st.sampled_from(["_", "X", " ", "\u200b"]))] = parent.pop(key)
        elif action == "retype":
            parent[key] = draw(JSON_VALUES)
        elif action == "huge":
            parent[key] = draw(HUGE_NUMBERS)
        elif action == "odd":
            parent[key] = draw(ODD_TEXT)
        else:
            depth = draw(st.integers(1, 50))
            value = parent[key]
            for _ in range(depth):
                value = draw(st.sampled_from([[value], {"k": value}]))
            parent[key] = value
    if draw(st.integers(0, 9)) == 0:
        body["type"] = draw(st.one_of(SAFE_TEXT, JSON_SCALARS, st.just("session.START")))
    return body


@st.composite
def raw_texts(draw) -> str:
    """Text that is not a well-formed message: non-JSON constants, escaped lone surrogates, duplicate keys, deep
    nesting past the parser's recursion limit, integers past Python's digit limit, truncations, non-objects."""
    base = json.dumps(draw(VALID))
    kind = draw(st.sampled_from(
        ["nan", "overflow", "surrogate", "duplicate", "deep", "long_int", "truncate", "non_object", "garbage", "bom"]))
    if kind == "nan":
        literal = draw(st.sampled_from(["NaN", "Infinity", "-Infinity"]))
        return base[:-1] + f', "seed": {literal}, "hold_max_seconds": {literal}}}'
    if kind == "overflow":
        literal = draw(st.sampled_from(["1e999", "-1e999", "1.5e400", "[1e999]", '{"x": -2e308}']))
        key = draw(st.sampled_from(["seed", "extra_params", "sampling_params", "video_params"]))
        return base[:-1] + f', "{key}": {literal}}}'
    if kind == "surrogate":
        escape = draw(SURROGATE_ESCAPES)
        field = draw(st.sampled_from(["prompt", "model", "type", "size"]))
        if '"session.interaction"' in base:
            return ('{"type": "session.interaction", "interaction": {"event_id": "%s", "event": {"prompt": "%s"}}}'
                    % (escape, escape))
        return base[:-1] + f', "{field}": "{escape}"}}'
    if kind == "duplicate":
        return base[:-1] + ', "type": ' + json.dumps(draw(st.one_of(JSON_SCALARS, st.just("session.start")))) + "}"
    if kind == "deep":
        depth = draw(st.sampled_from([100, 1000, 20_000]))
        return base[:-1] + ', "extra_params": ' + "[" * depth + "]" * depth + "}"
    if kind == "long_int":
        digits = draw(st.sampled_from([400, 4301, 20_000]))
        return base[:-1] + ', "seed": 9' + "9" * digits + "}"
    if kind == "truncate":
        return base[: draw(st.integers(0, max(0, len(base) - 1)))]
    if kind == "non_object":
        return json.dumps(draw(JSON_VALUES.filter(lambda v: not isinstance(v, dict))))
    if kind == "bom":
        return "\ufeff" + base
    return draw(st.text(max_size=200))


ANY_TEXT = st.one_of(VALID.map(json.dumps), mutated_messages().map(json.dumps), raw_texts())


def _json_safe(value) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except (ValueError, TypeError):
        return False
    return True


def check_parse(text: str) -> ClientMessage | ProtocolError:
    """Parse `text`; fail on anything but a message or a ProtocolError that names its problem."""
    try:
        message = parse_client_text(text, LIMITS)
    except ProtocolError as exc:
        assert isinstance(exc.code, ErrorCode), exc
        assert isinstance(exc.message, str) and exc.message.strip(), exc
        if exc.code in (ErrorCode.MISSING_FIELD, ErrorCode.INVALID_TYPE, ErrorCode.INVALID_VALUE,
                        ErrorCode.UNSUPPORTED_FIELD, ErrorCode.EMPTY_PROMPT, ErrorCode.PROMPT_TOO_LONG):
            assert "session." in exc.message, f"{exc.code}: the message names no field: {exc.message!r}"
        return exc
    assert isinstance(message, (SessionStart, SessionInteraction, SessionStop, SessionPing)), message
    if isinstance(message, SessionStart):
        assert message.prompt.strip() and len(message.prompt) <= LIMITS.max_prompt_chars
        message.prompt.encode("utf-8")
        assert _json_safe(dict(message.extra_params)), "extra_params are echoed in video.start as JSON"
        for value in (message.width, message.height, message.fps, message.num_frames):
            assert value is None or (isinstance(value, int) and value > 0)
        assert math.isfinite(message.hold.max_seconds)
    if isinstance(message, SessionInteraction):
        message.prompt.encode("utf-8")
        assert message.event_id is None or 0 < len(message.event_id) <= 256
    return message


# ---------------------------------------------------------------- (a) the parser alone


@pytest.fixture(scope="module", autouse=True)
def generated_budget():
    """After the module: the generated-message count reaches the floor (each test adds its own)."""
    yield
    total = sum(GENERATED.values())
    print(f"\nwebsocket fuzz: {total} generated messages {dict(GENERATED)}")
    if len(GENERATED) == 3:  # the whole file ran (not a -k selection)
        assert total >= MIN_GENERATED, f"only {total} generated messages; the floor is {MIN_GENERATED}"


@settings(max_examples=PARSER_EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
@pytest.mark.slow
@given(text=ANY_TEXT)
def test_parser_names_every_rejection(text):
    GENERATED["parser"] = GENERATED.get("parser", 0) + 1
    check_parse(text)


@pytest.mark.parametrize("text, code", [
    ('{"type": "session.start", "prompt": "a", "seed": NaN}', ErrorCode.INVALID_JSON),
    ('{"type": "session.start", "prompt": "\\ud800"}', ErrorCode.INVALID_VALUE),
    ('{"type": "session.start", "prompt": "a", "seed": ' + "9" * 5000 + "}", ErrorCode.INVALID_JSON),
    ('{"type": "session.start", "prompt": "a", "x": ' + "[" * 50_000 + "]" * 50_000 + "}",
     ErrorCode.MESSAGE_TOO_LARGE),
    ('{"type": "session.start", "prompt": "a", "x": ' + "[" * 20_000 + "]" * 20_000 + "}", ErrorCode.INVALID_JSON),
    ('{"type": "session.start", "type": "session.bogus", "prompt": "a"}', ErrorCode.UNKNOWN_TYPE),
    ('{"type": ["session.start"]}', ErrorCode.UNKNOWN_TYPE),
    ('{"type": "session.start", "prompt": "a", "extra_params": {"hold_max_seconds": 1e999}}', ErrorCode.INVALID_JSON),
    ('{"type": "session.start", "prompt": "a", "seed": 1e999}', ErrorCode.INVALID_JSON),
    # regression: 1e999 parsed as inf and was echoed in video.start as the non-JSON Infinity
    ('{"type": "session.start", "prompt": "a", "extra_params": {"c": [1e999]}}', ErrorCode.INVALID_JSON),
    ('{"type": "session.start", "prompt": "a", "extra_params": {"hold_max_seconds": 1' + "0" * 400 + "}}",
     ErrorCode.INVALID_TYPE),
    ('{"type": "session.interaction", "interaction": {"event_id": "\\udfff", "event": {"prompt": "a"}}}',
     ErrorCode.INVALID_VALUE),
])
def test_parser_named_edge_cases(text, code):
    result = check_parse(text)
    assert isinstance(result, ProtocolError) and result.code is code, result


# ---------------------------------------------------------------- (b) a live gateway

Frame = tuple[str, object]  # ("text", str) | ("binary", bytes)
FRAMES = st.one_of(
    ANY_TEXT.map(lambda t: ("text", t)),
    st.binary(max_size=64).map(lambda b: ("binary", b)),
)
SEQUENCES = st.lists(FRAMES, min_size=1, max_size=12)
START = {"type": "session.start", "prompt": "fuzz session"}
NO_SHRINK = (Phase.explicit, Phase.generate)
"""A live case takes about a second: shrinking a failure would take many minutes, so the failing input is reported
as generated."""


async def _send(ws: aiohttp.ClientWebSocketResponse, frame: Frame) -> bool:
    """Send one frame; False once the server has closed the socket."""
    if ws.closed:
        return False
    kind, payload = frame
    try:
        if kind == "binary":
            await ws.send_bytes(payload)
        else:
            await ws.send_str(payload)
    except (ConnectionError, RuntimeError):
        return False
    return True


async def _settle(server, pipeline: FakePipeline) -> None:
    """Wait until the gateway reports no active or queued session; fail otherwise."""
    for _ in range(200):
        status, report = await healthz(server)
        if status == 200 and report["sessions_active"] == 0 and report["sessions_queued"] == 0:
            break
        await asyncio.sleep(0.02)
    assert status == 200 and report["sessions_active"] == 0 and report["sessions_queued"] == 0, report
    assert all(r.closed for r in pipeline.records), "a fake pipeline session was left open"


def _check_errors(transcript: Transcript) -> None:
    codes = {c.value for c in ErrorCode}
    for error in transcript.of_type("error"):
        assert error.get("code") in codes, f"error without a known code: {error}"
        assert isinstance(error.get("message"), str) and error["message"], error


async def _sequence_case(frames: list[Frame], with_session: bool) -> None:
    pipeline = FakePipeline(FakeBehaviour(num_chunks=None, chunk_delay_s=0.01))
    async with running_gateway(small_config(start_timeout_s=1.0), pipeline) as server:
        transcript = Transcript()
        async with aiohttp.ClientSession() as http, http.ws_connect(ws_url(server)) as ws:
            if with_session:
                await ws.send_json(START)
                await read_until(ws, transcript, until="video.chunk_metadata")
            for frame in frames:
                if not await _send(ws, frame):
                    break
            if not ws.closed:
                await _send(ws, ("text", json.dumps({"type": "session.stop"})))
                await _send(ws, ("text", json.dumps({"type": "session.ping"})))
            # without a running session, a kept-open socket waits for its start timeout (1 s) and closes
            await read_until(ws, transcript, timeout=10.0)
        _check_errors(transcript)
        if with_session:
            assert transcript.of_type("session.done"), f"the running session did not end: {transcript.order[-5:]}"
        await _settle(server, pipeline)
        pipeline.behaviour.num_chunks, pipeline.behaviour.chunk_delay_s = 2, 0.0
        await run_good_session(server)
        await _settle(server, pipeline)


@settings(max_examples=LIVE_SEQUENCES, deadline=None, derandomize=True, database=None, phases=NO_SHRINK,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
@pytest.mark.slow
@given(frames=SEQUENCES, with_session=st.booleans())
def test_live_gateway_survives_frame_sequences(frames, with_session):
    GENERATED["live"] = GENERATED.get("live", 0) + len(frames)
    asyncio.run(_sequence_case(frames, with_session))


async def _one_server_many_connections(sequences: list[list[Frame]]) -> None:
    """Many connections in a row on one gateway (a long-lived process), each fed a generated sequence mid-session."""
    pipeline = FakePipeline(FakeBehaviour(num_chunks=None, chunk_delay_s=0.005))
    async with running_gateway(small_config(), pipeline) as server:
        for frames in sequences:
            transcript = Transcript()
            async with aiohttp.ClientSession() as http, http.ws_connect(ws_url(server)) as ws:
                await ws.send_json(START)
                await read_until(ws, transcript, until="video.chunk_metadata")
                for frame in frames:
                    if not await _send(ws, frame):
                        break
                await _send(ws, ("text", json.dumps({"type": "session.stop"})))
                await read_until(ws, transcript, timeout=10.0)
            _check_errors(transcript)
            assert transcript.of_type("session.done"), transcript.order[-5:]
        await _settle(server, pipeline)
        pipeline.behaviour.num_chunks, pipeline.behaviour.chunk_delay_s = 2, 0.0
        await run_good_session(server)
        await _settle(server, pipeline)


@settings(max_examples=3, deadline=None, derandomize=True, database=None, phases=NO_SHRINK,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
@pytest.mark.slow
@given(sequences=st.lists(st.lists(FRAMES, min_size=20, max_size=40), min_size=4, max_size=6))
def test_live_gateway_interleaved_with_running_sessions(sequences):
    GENERATED["interleaved"] = GENERATED.get("interleaved", 0) + sum(map(len, sequences))
    asyncio.run(_one_server_many_connections(sequences))
