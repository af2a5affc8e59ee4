"""The bring-up refuses to start over a running instance instead of health-checking someone else's services."""
import pathlib
import socket

import pytest

from services.common.config import load_profile
from services.up import check_ports_free, service_commands
from tools.ports import free_ports

pytestmark = pytest.mark.cpu
ROOT = pathlib.Path(__file__).resolve().parents[2]


def _profile(tmp_path, port):
    text = (ROOT / "configs/tiny_cpu.yaml").read_text().replace("127.0.0.1:50051", f"127.0.0.1:{port}")
    for old in ("9101", "9102", "9103"):
        text = text.replace(f"metrics_port: {old}", "metrics_port: 0")
    text = text.replace("port: 8000", "port: 0")
    path = tmp_path / "p.yaml"
    path.write_text(text)
    return load_profile(path)


def test_a_taken_port_is_named(tmp_path):
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"port {port} \\(encoder\\) is already in use"):
            check_ports_free(_profile(tmp_path, port))


def test_a_port_named_for_two_services_is_refused_with_both_names(tmp_path):
    port = free_ports(1)[0]
    text = (ROOT / "configs/tiny_cpu.yaml").read_text().replace("127.0.0.1:50051", f"127.0.0.1:{port}")
    path = tmp_path / "p.yaml"
    path.write_text(text.replace("port: 8000", f"port: {port}"))
    with pytest.raises(RuntimeError, match=f"port {port} is named for both encoder and gateway"):
        check_ports_free(load_profile(path))


def test_every_service_runs_with_the_same_profile():
    commands = service_commands("configs/tiny_cpu.yaml")
    assert list(commands) == ["encoder", "dit", "vae", "gateway"]
    assert all(c[-2:] == ["--profile", "configs/tiny_cpu.yaml"] for c in commands.values())
