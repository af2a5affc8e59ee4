"""Structured JSON logs: fields, the session context across tasks and worker threads, extras, errors."""
import asyncio
import datetime
import io
import json
import logging
import threading

import pytest

from services.common.logging_setup import JsonFormatter, configure_logging, current_context, log_context

pytestmark = pytest.mark.cpu

log = logging.getLogger("tests.logging_setup")


@pytest.fixture
def lines():
    """Records logged under `tests.logging_setup` as parsed JSON objects."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter("unit"))
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    try:
        yield lambda: [json.loads(line) for line in stream.getvalue().splitlines()]
    finally:
        log.removeHandler(handler)
        log.setLevel(logging.NOTSET)


def test_each_line_is_one_json_object_with_the_core_fields(lines):
    log.info("hello %s\nsecond line", "wörld")
    (entry,) = lines()
    assert entry["msg"] == "hello wörld\nsecond line"
    assert entry["level"] == "INFO" and entry["logger"] == "tests.logging_setup" and entry["service"] == "unit"
    ts = datetime.datetime.fromisoformat(entry["ts"].replace("Z", "+00:00"))
    assert entry["ts"].endswith("Z") and ts.utcoffset() == datetime.timedelta(0)
    assert abs((datetime.datetime.now(datetime.timezone.utc) - ts).total_seconds()) < 60
    assert "session_id" not in entry


def test_session_id_reaches_records_from_to_thread_workers_and_child_tasks(lines):
    def work(step: str) -> str:
        log.info("in worker %s", step)
        return threading.current_thread().name

    async def session(sid: str) -> str:
        with log_context(session_id=sid, trace_id=f"trace-{sid}"):
            thread_name = await asyncio.to_thread(work, "a")
            await asyncio.sleep(0)  # interleave with the other session
            await asyncio.create_task(asyncio.to_thread(work, "b"))
            log.info("on the loop")
        log.info("after the block")
        return thread_name

    async def main():
        return await asyncio.gather(session("video_stream-1"), session("video_stream-2"))

    names = asyncio.run(main())
    assert all(name != threading.main_thread().name for name in names)  # really ran in worker threads
    entries = lines()
    assert len(entries) == 8
    for entry in entries:
        if entry["msg"] == "after the block":
            assert "session_id" not in entry and "trace_id" not in entry
        else:
            assert entry["session_id"] in ("video_stream-1", "video_stream-2")
            assert entry["trace_id"] == f"trace-{entry['session_id']}"
    per_session = {sid: [e["msg"] for e in entries if e.get("session_id") == sid]
                   for sid in ("video_stream-1", "video_stream-2")}
    assert all(msgs == ["in worker a", "in worker b", "on the loop"] for msgs in per_session.values())


def test_nested_contexts_merge_override_remove_and_restore(lines):
    with log_context(session_id="s", request_index=1):
        with log_context(request_index=2, phase_index=0, session_id=None):
            assert current_context() == {"request_index": 2, "phase_index": 0}
            log.info("inner")
        log.info("outer")
    assert current_context() == {}
    inner, outer = lines()
    assert "session_id" not in inner and inner["request_index"] == 2 and inner["phase_index"] == 0
    assert outer["session_id"] == "s" and outer["request_index"] == 1 and "phase_index" not in outer


def test_extra_fields_win_and_exceptions_are_one_field(lines):
    with log_context(session_id="s", span_id="session-span"):
        log.info("chunk", extra={"span_id": "phase-span", "chunk_index": 3, "obj": object()})
        try:
            raise KeyError("boom")
        except KeyError:
            log.exception("failed")
    chunk, failed = lines()
    assert chunk["span_id"] == "phase-span" and chunk["chunk_index"] == 3 and chunk["session_id"] == "s"
    assert chunk["obj"].startswith("<object object")  # unserializable values are stringified, not fatal
    assert failed["level"] == "ERROR" and "KeyError: 'boom'" in failed["exc"]


def test_core_field_names_cannot_be_bound():
    with pytest.raises(ValueError, match="'msg'"):
        with log_context(msg="x"):
            pass


def test_configure_logging_replaces_root_handlers():
    root = logging.getLogger()
    saved_handlers, saved_level = root.handlers[:], root.level
    stream = io.StringIO()
    try:
        configure_logging("dit", stream=stream)
        assert len(root.handlers) == 1 and root.level == logging.INFO
        with log_context(session_id="video_stream-x"):
            logging.getLogger("services.dit.grpc_server").info("phase %d", 4)
        logging.getLogger("services.dit.grpc_server").debug("not at INFO")
    finally:
        root.handlers[:] = saved_handlers
        root.setLevel(saved_level)
    (entry,) = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert entry["service"] == "dit" and entry["msg"] == "phase 4" and entry["session_id"] == "video_stream-x"
    with pytest.raises(ValueError, match="service name"):
        configure_logging("")


def test_a_terminal_gets_readable_lines_and_anything_else_json_lines():
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty, pipe = Terminal(), io.StringIO()
    for stream in (tty, pipe):
        configure_logging("dit", stream=stream)
        with log_context(session_id="s1"):
            logging.getLogger("services.dit.x").info("loaded shard %d/%d", 1, 4)
    line = tty.getvalue().strip()
    assert " dit " in line and "INFO" in line and line.endswith("loaded shard 1/4  [session_id=s1]")
    assert line[0].isdigit() and not line.startswith("{")
    assert json.loads(pipe.getvalue())["msg"] == "loaded shard 1/4"
