"""Prometheus metrics of the gateway, registered on a caller-supplied registry.

Knows nothing about websockets or sessions: the session service calls these hooks. Names are the agreed
ones of docs/observability.md (one `vitascope_` prefix shared with the stages; the scrape target tells the
processes apart). No label carries a session or request id (bounded cardinality: stage names, outcomes,
error codes).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.common.metrics import LATENCY_BUCKETS as STAGE_BUCKETS
from services.gateway.pipeline import StageTimings

_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 60.0)


class GatewayMetrics:
    """The gateway's metric families."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.time_to_first_chunk = Histogram(
            "vitascope_time_to_first_chunk_seconds",
            "Seconds from a session getting its slot to its first media chunk being sent.",
            buckets=_LATENCY_BUCKETS, registry=registry,
        )
        self.chunk_interval = Histogram(
            "vitascope_chunk_interval_seconds",
            "Seconds between consecutive media chunks of one session.",
            buckets=_LATENCY_BUCKETS, registry=registry,
        )
        self.stage_latency = Histogram(
            "vitascope_stage_latency_seconds",
            "Per-chunk seconds spent in each backend stage, as reported by the backend.",
            ["stage"], buckets=STAGE_BUCKETS, registry=registry,  # the stages' buckets: series sum across processes
        )
        self.queue_wait = Histogram(
            "vitascope_queue_wait_seconds",
            "Seconds a session waited in the queue before getting a slot.",
            buckets=_LATENCY_BUCKETS, registry=registry,
        )
        self.sessions_active = Gauge(
            "vitascope_active_sessions", "Sessions holding a generation slot (a DiT group).", registry=registry
        )
        self.sessions_queued = Gauge(
            "vitascope_queued_sessions", "Sessions waiting in the FIFO queue for a slot.", registry=registry
        )
        self.sessions_total = Counter(
            "vitascope_sessions_total",
            "Sessions ended, by outcome (completed, stopped, disconnected, failed, rejected).",
            ["outcome"], registry=registry,
        )
        self.errors_total = Counter(
            "vitascope_errors_total", "Error messages sent to clients, by wire error code.", ["code"],
            registry=registry,
        )
        self.chunks_total = Counter(
            "vitascope_chunks_total", "Binary fMP4 frames sent to clients.", registry=registry
        )
        self.chunk_bytes_total = Counter(
            "vitascope_chunk_bytes_total", "Bytes of fMP4 sent to clients.", registry=registry
        )

        self.viewers = Gauge(
            "vitascope_viewers", "Viewers connected to the watch websockets of live sessions.", registry=registry
        )
        self.viewer_chunks_total = Counter(
            "vitascope_viewer_chunks_total", "Binary fMP4 frames (init segments included) sent to viewers.",
            registry=registry,
        )
        self.viewer_bytes_total = Counter(
            "vitascope_viewer_bytes_total", "Bytes of fMP4 sent to viewers.", registry=registry
        )
        self.viewers_dropped_total = Counter(
            "vitascope_viewers_dropped_total",
            "Viewers dropped for falling behind, by reason (too_slow: skipped ahead too often; send_timeout: read "
            "nothing for send_timeout_s).", ["reason"], registry=registry,
        )

    def observe_chunk(self, byte_length: int, timings: StageTimings) -> None:
        """Count one sent chunk and record the stage latencies it reported."""
        self.chunks_total.inc()
        self.chunk_bytes_total.inc(byte_length)
        for stage, seconds in timings.as_dict().items():
            if seconds > 0:
                self.stage_latency.labels(stage=stage).observe(seconds)

    def set_occupancy(self, active: int, queued: int) -> None:
        """Publish the scheduler's current counts."""
        self.sessions_active.set(active)
        self.sessions_queued.set(queued)
