"""Bring the whole system up on one machine: `python -m services.up --profile configs/tiny_cpu.yaml`.

Writes the profile's random-weight checkpoint on first use (when the profile asks for it), starts the
encoder, DiT, VAE and gateway as child processes, waits until each is healthy, prints the URL to open,
and stops them all on Ctrl-C / SIGTERM. Knows nothing about models beyond the checkpoint writer's CLI.
"""
from __future__ import annotations

import argparse
import logging
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
import urllib.request

from services.common.config import Profile, load_profile
from services.common.grpc_server import HEALTH_NAMES
from services.common.healthcheck import check

log = logging.getLogger("services.up")

STAGES = ("encoder", "dit", "vae")
START_TIMEOUT_SECONDS = 600.0


def service_commands(profile_path: str | os.PathLike) -> dict[str, list[str]]:
    """The command line of every service this profile runs, in start order (also what compose runs)."""
    profile_arg = str(profile_path)
    return {name: ["python", "-m", f"services.{name}", "--profile", profile_arg]
            for name in (*STAGES, "gateway")}


def checkpoint_command(profile: Profile) -> list[str]:
    """The command that writes the profile's random-weight checkpoint."""
    return ["python", "-m", "services.checkpoints", "--preset", profile.model.preset, "--out", profile.model.dir]


def _python(cmd: list[str]) -> list[str]:
    return [sys.executable, *cmd[1:]] if cmd[0] == "python" else cmd


def _gateway_url(profile: Profile) -> str:
    host = "127.0.0.1" if profile.gateway.host == "0.0.0.0" else profile.gateway.host
    return f"http://{host}:{profile.gateway.port}"


def _wait_healthy(name: str, profile: Profile, proc: subprocess.Popen, deadline: float) -> None:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with code {proc.returncode} before becoming healthy")
        if name == "gateway":
            try:
                with urllib.request.urlopen(_gateway_url(profile) + "/healthz", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                pass
        elif check(getattr(profile.endpoints, name), HEALTH_NAMES[name], timeout=2):
            return
        time.sleep(0.5)
    raise RuntimeError(f"{name} did not become healthy within {START_TIMEOUT_SECONDS:.0f} s")


def check_ports_free(profile: Profile) -> None:
    """Fail before starting anything if a port of the profile is taken (e.g. another vitascope is running)."""
    ports = [("encoder", profile.endpoints.port_of("encoder")), ("dit", profile.endpoints.port_of("dit")),
             ("vae", profile.endpoints.port_of("vae")), ("gateway", profile.gateway.port)]
    ports += [(f"{name} metrics", getattr(profile, name).metrics_port) for name in STAGES]
    for name, port in ports:
        if not port:
            continue
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                raise RuntimeError(f"port {port} ({name}) is already in use: is another vitascope running? "
                                   f"Stop it or change the ports in {profile.path}") from None


def bring_up(profile_path: pathlib.Path) -> list[subprocess.Popen]:
    """Start every service of the profile and wait for health; returns the child processes."""
    profile = load_profile(profile_path)
    check_ports_free(profile)
    if profile.model.write_if_missing and not (pathlib.Path(profile.model.dir) / "COMPLETE").exists():
        log.info("writing the %s checkpoint to %s (first start)", profile.model.preset, profile.model.dir)
        subprocess.run(_python(checkpoint_command(profile)), check=True)
    procs: list[subprocess.Popen] = []
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    try:
        commands = service_commands(profile_path)
        for name in STAGES:  # the stages load in parallel
            procs.append(subprocess.Popen(_python(commands[name])))
        for name, proc in zip(STAGES, procs):
            _wait_healthy(name, profile, proc, deadline)
        procs.append(subprocess.Popen(_python(commands["gateway"])))
        _wait_healthy("gateway", profile, procs[-1], deadline)
    except BaseException:
        stop_all(procs)
        raise
    return procs


def stop_all(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every child, then SIGKILL what is still alive after the grace period."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()


def _interrupt(*_args: object) -> None:
    raise KeyboardInterrupt


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="configs/tiny_cpu.yaml")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    profile = load_profile(args.profile)
    # SIGTERM during start-up acts like Ctrl-C: bring_up() stops the children it already started.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        procs = bring_up(pathlib.Path(args.profile))
    except RuntimeError as exc:
        log.error("%s", exc)
        return 1
    except KeyboardInterrupt:
        log.info("interrupted during start-up; the started services were stopped")
        return 1
    print(f"vitascope is up: open {_gateway_url(profile)}/  (Ctrl-C stops it)", flush=True)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    try:
        while not stopping and all(p.poll() is None for p in procs):
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    dead = [p.args for p in procs if p.poll() is not None]
    stop_all(procs)
    if dead and not stopping:
        log.error("a service exited: %s", dead)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
