"""`vitascope <command>`: one entry point naming what it runs; `up --host/--port` moves the gateway."""
import pytest

from services.cli import main
from services.common.config import load_profile
from services.supervisor import RestartPolicy
from services.up import make_supervisor, with_gateway_address

pytestmark = pytest.mark.cpu


def test_without_a_command_it_lists_the_commands(capsys):
    assert main([]) == 2
    out = capsys.readouterr().out
    assert all(name in out for name in ("up", "client", "checkpoint", "encoder", "dit", "vae", "gateway"))


def test_an_unknown_command_is_named(capsys):
    assert main(["serve"]) == 2
    assert "unknown command 'serve'" in capsys.readouterr().err


def test_a_command_gets_the_rest_of_the_arguments(tmp_path):
    main(["checkpoint", "--preset", "tiny", "--out", str(tmp_path / "tiny")])
    assert (tmp_path / "tiny" / "COMPLETE").exists()


def test_up_port_and_host_move_the_gateway_and_nothing_else():
    profile = with_gateway_address(load_profile("configs/tiny_cpu.yaml"), "127.0.0.2", 8123)
    assert (profile.gateway.host, profile.gateway.port) == ("127.0.0.2", 8123)
    supervisor = make_supervisor(profile, "configs/tiny_cpu.yaml", RestartPolicy())
    gateway = supervisor._children["gateway"].spec.command
    assert gateway[-4:] == ["--host", "127.0.0.2", "--port", "8123"]
    assert supervisor._children["dit"].spec.command[-2:] == ["--profile", "configs/tiny_cpu.yaml"]
