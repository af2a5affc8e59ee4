"""deploy/grafana: the dashboard queries exactly the documented metrics, and the code exports them.
"""
from __future__ import annotations

import json
import re

import pytest

from tests.deploy.shared import DEPLOY, ROOT

pytestmark = pytest.mark.cpu

METRICS = {
    "vitascope_time_to_first_chunk_seconds": "histogram",
    "vitascope_chunk_interval_seconds": "histogram",
    "vitascope_stage_latency_seconds": "histogram",
    "vitascope_active_sessions": "gauge",
    "vitascope_queued_sessions": "gauge",
    "vitascope_transport_fallbacks_total": "counter",
    "vitascope_gpu_memory_bytes": "gauge",
}


def _dashboard_exprs() -> list[str]:
    dashboard = json.loads((DEPLOY / "grafana" / "vitascope.json").read_text())
    return [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]


def test_dashboard_queries_exactly_the_documented_metrics():
    used = set()
    for expr in _dashboard_exprs():
        used |= {re.sub(r"_(bucket|sum|count)$", "", m) for m in re.findall(r"\bvitascope_[a-z_]+", expr)}
    assert used == set(METRICS)
    documented = (ROOT / "docs" / "observability.md").read_text()
    for name, kind in METRICS.items():
        assert re.search(rf"`{name}`.*\|\s*{kind}\s*\|", documented), f"{name} ({kind}) not in docs"


def test_dashboard_histograms_use_buckets_and_counters_use_rate():
    for expr in _dashboard_exprs():
        for name in re.findall(r"\bvitascope_[a-z_]+", expr):
            base = re.sub(r"_(bucket|sum|count)$", "", name)
            if METRICS.get(base) == "histogram":
                assert name.endswith(("_bucket", "_sum", "_count")), expr
            if METRICS.get(base) == "counter":
                assert re.search(rf"(rate|increase)\({name}\[", expr), expr


def test_gateway_exports_the_dashboard_metric_names():
    from prometheus_client import CollectorRegistry

    from services.gateway.metrics import GatewayMetrics

    registry = CollectorRegistry()
    GatewayMetrics(registry)
    exported = {family.name for family in registry.collect()}
    gateway_side = {"vitascope_time_to_first_chunk_seconds", "vitascope_chunk_interval_seconds",
                    "vitascope_stage_latency_seconds", "vitascope_active_sessions", "vitascope_queued_sessions"}
    assert gateway_side <= exported


def _exported(registry) -> dict[str, str]:
    """Metric names a registry exposes (counters with their `_total`) and their types."""
    return {f"{f.name}_total" if f.type == "counter" else f.name: f.type for f in registry.collect()}


def test_stage_processes_export_the_dashboard_metric_names():
    import prometheus_client

    import services.common.metrics  # noqa: F401 - registers the stage metrics on the default registry

    exported = _exported(prometheus_client.REGISTRY)
    stage_side = {"vitascope_stage_latency_seconds", "vitascope_active_sessions",
                  "vitascope_transport_fallbacks_total", "vitascope_gpu_memory_bytes"}
    assert {name: exported.get(name) for name in stage_side} == {name: METRICS[name] for name in stage_side}


def test_every_exported_metric_is_documented_and_stage_buckets_agree():
    import prometheus_client
    from prometheus_client import CollectorRegistry

    from services.common.metrics import LATENCY_BUCKETS
    from services.gateway.metrics import GatewayMetrics

    registry = CollectorRegistry()
    gateway = GatewayMetrics(registry)
    exported = {**_exported(registry), **_exported(prometheus_client.REGISTRY)}
    documented = (ROOT / "docs" / "observability.md").read_text()
    for name, kind in exported.items():
        if name.startswith("vitascope_"):
            assert re.search(rf"`{name}`.*\|\s*{kind}\s*\|", documented), f"{name} ({kind}) not in docs"
    # The gateway's copy of the per-chunk stage seconds sums with the stages' series only with equal buckets.
    gateway.stage_latency.labels(stage="probe")
    (family,) = [f for f in registry.collect() if f.name == "vitascope_stage_latency_seconds"]
    bounds = [float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")]
    assert bounds == [*LATENCY_BUCKETS, float("inf")]
