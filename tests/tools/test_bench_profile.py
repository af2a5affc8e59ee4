"""The tools' copy of a profile (benches, samples, the judge, the soak) gives every server a port of its own."""
import pathlib

import pytest

from services.common.config import load_profile
from services.up import STAGES, check_ports_free
from tools.bench_tiny import write_profile

ROOT = pathlib.Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.cpu


def ports_of(profile) -> list[int]:
    return ([profile.endpoints.port_of(name) for name in STAGES] + [profile.gateway.port]
            + [getattr(profile, name).metrics_port for name in STAGES])


def test_a_bench_profile_with_metrics_names_seven_distinct_free_ports(tmp_path):
    path, gateway_port = write_profile(ROOT / "configs" / "tiny_cpu.yaml", tmp_path, metrics=True)
    profile = load_profile(path)
    ports = ports_of(profile)
    assert profile.gateway.port == gateway_port
    assert 0 not in ports and len(set(ports)) == 7
    check_ports_free(profile)  # raises naming the port if two services share one or one is taken


def test_a_bench_profile_without_metrics_serves_none(tmp_path):
    profile = load_profile(write_profile(ROOT / "configs" / "tiny_cpu.yaml", tmp_path)[0])
    assert [getattr(profile, name).metrics_port for name in STAGES] == [0, 0, 0]
    assert len(set(ports_of(profile)[:4])) == 4
