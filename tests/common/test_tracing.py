"""W3C traceparent: generation, parsing (valid and malformed headers), children and gRPC metadata."""
import logging
import re

import pytest

from services.common import tracing
from services.common.tracing import SpanContext, TraceContextError, parse_traceparent

pytestmark = pytest.mark.cpu

VERSION_00 = re.compile(r"00-[0-9a-f]{32}-[0-9a-f]{16}-01")


def test_new_root_is_a_valid_version_00_header_and_ids_are_random():
    roots = [SpanContext.new_root() for _ in range(50)]
    for root in roots:
        assert VERSION_00.fullmatch(root.traceparent)
        assert parse_traceparent(root.traceparent) == root
    assert len({r.trace_id for r in roots}) == 50 and len({r.span_id for r in roots}) == 50


def test_child_keeps_the_trace_and_gets_a_new_span():
    root = SpanContext.new_root()
    children = [root.child() for _ in range(20)]
    assert {c.trace_id for c in children} == {root.trace_id}
    assert len({c.span_id for c in children} | {root.span_id}) == 21
    assert root.log_fields() == {"trace_id": root.trace_id, "span_id": root.span_id}


def test_parse_spec_example():
    span = parse_traceparent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
    assert span == SpanContext("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7", sampled=True)
    unsampled = parse_traceparent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00")
    assert unsampled.sampled is False and unsampled.traceparent.endswith("-00")


def test_future_versions_are_read_by_their_first_four_fields():
    span = parse_traceparent("cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-09-what-the-future-holds")
    assert span.span_id == "00f067aa0ba902b7" and span.sampled is True
    assert span.traceparent.startswith("00-")  # we always write version 00


@pytest.mark.parametrize("value, problem", [
    ("", "is not"),
    ("00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01", "is not"),  # uppercase
    ("00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01", "is not"),   # 31-digit trace id
    ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b-01", "is not"),   # 15-digit span id
    ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7", "is not"),     # no flags
    ("00_4bf92f3577b34da6a3ce929d0e0e4736_00f067aa0ba902b7_01", "is not"),
    ("00-00000000000000000000000000000000-00f067aa0ba902b7-01", "trace_id"),
    ("00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01", "span_id"),
    ("ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "version ff"),
    ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra", "nothing after"),
])
def test_malformed_headers_are_rejected_with_a_reason(value, problem):
    with pytest.raises(TraceContextError, match=problem):
        parse_traceparent(value)


def test_span_context_validates_its_ids():
    with pytest.raises(TraceContextError, match="trace_id 'abc'"):
        SpanContext("abc", "00f067aa0ba902b7")
    with pytest.raises(TraceContextError, match="span_id"):
        SpanContext("4bf92f3577b34da6a3ce929d0e0e4736", "00F067AA0BA902B7")


def test_continue_trace_keeps_a_valid_context_and_restarts_on_a_bad_one(caplog):
    received = SpanContext.new_root()
    assert tracing.continue_trace(received.traceparent) == received
    assert tracing.continue_trace("") != received
    with caplog.at_level(logging.WARNING, logger="services.common.tracing"):
        fresh = tracing.continue_trace("00-garbage")
    assert VERSION_00.fullmatch(fresh.traceparent)
    assert "ignoring received trace context" in caplog.text
    assert tracing.parse_optional("") is None
    assert tracing.parse_optional(received.traceparent) == received


def test_grpc_metadata_round_trip():
    span = SpanContext.new_root()
    metadata = (("user-agent", "x"), *tracing.to_metadata(span))
    assert tracing.metadata_traceparent(metadata) == span.traceparent
    assert tracing.metadata_traceparent([("traceparent", span.traceparent.encode())]) == span.traceparent
    assert tracing.metadata_traceparent(None) == "" and tracing.metadata_traceparent([("a", "b")]) == ""
