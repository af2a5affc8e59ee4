"""Bring the whole system up on one machine and keep it up: `python -m services.up --profile configs/tiny_cpu.yaml`.

Writes the profile's random-weight checkpoint on first use (when the profile asks for it), starts the encoder, DiT
and VAE as child processes, waits until each is ready, starts the gateway, prints the URL to open, then supervises
all four (`services.supervisor`): a service that exits or wedges is restarted with backoff while the others keep
running, and a crash loop stops the node with a non-zero exit. Ctrl-C / SIGTERM stops every service. Knows nothing
about models beyond the checkpoint writer's CLI.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import prometheus_client

from services.common.config import Profile, load_profile
from services.common.grpc_server import HEALTH_NAMES
from services.common.healthcheck import check
from services.supervisor import CrashLoop, RestartPolicy, ServiceSpec, Supervisor

log = logging.getLogger("services.up")

STAGES = ("encoder", "dit", "vae")
SERVICES = (*STAGES, "gateway")
"""Every service of a node, in start order."""
START_TIMEOUT_SECONDS = 600.0
PROBE_TIMEOUT_SECONDS = 2.0


def service_commands(profile_path: str | os.PathLike, gateway_args: tuple[str, ...] = ()
                     ) -> dict[str, list[str]]:
    """The command line of every service this profile runs, in start order (also what compose runs);
    `gateway_args` are added to the gateway's (`--host`, `--port` overrides)."""
    profile_arg = str(profile_path)
    commands = {name: ["python", "-m", f"services.{name}", "--profile", profile_arg] for name in SERVICES}
    commands["gateway"] += gateway_args
    return commands


def with_gateway_address(profile: Profile, host: str | None, port: int | None) -> Profile:
    """The profile with the gateway's address overridden (`up --host/--port`)."""
    gateway = dataclasses.replace(profile.gateway, **{k: v for k, v in (("host", host), ("port", port))
                                                      if v is not None})
    return dataclasses.replace(profile, gateway=gateway)


def checkpoint_command(profile: Profile) -> list[str]:
    """The command that writes the profile's random-weight checkpoint."""
    return ["python", "-m", "services.checkpoints", "--preset", profile.model.preset, "--out", profile.model.dir]


def _python(cmd: list[str]) -> list[str]:
    return [sys.executable, *cmd[1:]] if cmd[0] == "python" else cmd


def _gateway_url(profile: Profile) -> str:
    host = "127.0.0.1" if profile.gateway.host == "0.0.0.0" else profile.gateway.host
    return f"http://{host}:{profile.gateway.port}"


def _gateway_status(profile: Profile) -> int | None:
    """The HTTP status of the gateway's /healthz (200 ready, 503 alive but a stage is down), None if no answer."""
    try:
        with urllib.request.urlopen(_gateway_url(profile) + "/healthz", timeout=PROBE_TIMEOUT_SECONDS) as reply:
            return reply.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


def is_ready(name: str, profile: Profile) -> bool:
    """True when the service is ready to serve (a stage's named gRPC health, the gateway's /healthz 200)."""
    if name == "gateway":
        return _gateway_status(profile) == 200
    return check(getattr(profile.endpoints, name), HEALTH_NAMES[name], timeout=PROBE_TIMEOUT_SECONDS) == "SERVING"


def is_alive(name: str, profile: Profile) -> bool:
    """True while the service answers at all (a stage's liveness service "", any /healthz reply of the gateway)."""
    if name == "gateway":
        return _gateway_status(profile) is not None
    return check(getattr(profile.endpoints, name), "", timeout=PROBE_TIMEOUT_SECONDS) == "SERVING"


def make_supervisor(profile: Profile, profile_path: str | os.PathLike, policy: RestartPolicy,
                    registry: prometheus_client.CollectorRegistry | None = None) -> Supervisor:
    """A supervisor of the profile's four services (not started); the gateway at `profile.gateway`'s address."""
    commands = service_commands(profile_path, ("--host", profile.gateway.host, "--port", str(profile.gateway.port)))
    specs = [ServiceSpec(name, _python(commands[name]), lambda name=name: is_alive(name, profile))
             for name in SERVICES]
    return Supervisor(specs, policy, registry)


def _wait_ready(names: tuple[str, ...], profile: Profile, supervisor: Supervisor, deadline: float) -> None:
    """Tick the supervisor (restarting what exits) until every named service is ready."""
    waiting = list(names)
    while waiting:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{', '.join(waiting)} did not become ready within {START_TIMEOUT_SECONDS:.0f} s")
        supervisor.tick()
        waiting = [n for n in waiting if supervisor.process(n) is None or not is_ready(n, profile)]
        if waiting:
            time.sleep(0.5)


def check_ports_free(profile: Profile) -> None:
    """Fail before starting anything if a port of the profile is taken (e.g. another vitascope is running) or named
    for two of its services (here they all bind on one host: the second could not start)."""
    ports = [("encoder", profile.endpoints.port_of("encoder")), ("dit", profile.endpoints.port_of("dit")),
             ("vae", profile.endpoints.port_of("vae")), ("gateway", profile.gateway.port)]
    ports += [(f"{name} metrics", getattr(profile, name).metrics_port) for name in STAGES]
    owner: dict[int, str] = {}
    for name, port in ports:
        if not port:
            continue
        if port in owner:
            raise RuntimeError(f"port {port} is named for both {owner[port]} and {name} in {profile.path}: "
                               "give each service its own port")
        owner[port] = name
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                raise RuntimeError(f"port {port} ({name}) is already in use: is another vitascope running? "
                                   f"Stop it or change the ports in {profile.path}") from None


def bring_up(profile_path: pathlib.Path, policy: RestartPolicy = RestartPolicy(),
             registry: prometheus_client.CollectorRegistry | None = None, host: str | None = None,
             port: int | None = None) -> Supervisor:
    """Start every service of the profile (the gateway at `host`/`port` when given) and wait until all are ready;
    returns their supervisor."""
    profile = with_gateway_address(load_profile(profile_path), host, port)
    check_ports_free(profile)
    if profile.model.write_if_missing and not (pathlib.Path(profile.model.dir) / "COMPLETE").exists():
        log.info("writing the %s checkpoint to %s (first start)", profile.model.preset, profile.model.dir)
        subprocess.run(_python(checkpoint_command(profile)), check=True)
    supervisor = make_supervisor(profile, profile_path, policy, registry)
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    try:
        for name in STAGES:  # the stages load in parallel
            supervisor.start(name)
        _wait_ready(STAGES, profile, supervisor, deadline)
        supervisor.start("gateway")
        _wait_ready(("gateway",), profile, supervisor, deadline)
    except BaseException:
        supervisor.stop_all()
        raise
    return supervisor


def _interrupt(*_args: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="configs/tiny_cpu.yaml")
    parser.add_argument("--host", help="address the gateway binds (default: the profile's gateway.host)")
    parser.add_argument("--port", type=int, help="the gateway's port (default: the profile's gateway.port)")
    parser.add_argument("--metrics-port", type=int, default=9100,
                        help="the supervisor's Prometheus port on 127.0.0.1 (restarts per service); 0: none")
    parser.add_argument("--crash-loop-exits", type=int, default=RestartPolicy.crash_loop_exits,
                        help="exits of one service inside the window that stop the node")
    parser.add_argument("--crash-loop-window", type=float, default=RestartPolicy.crash_loop_window_s,
                        help="seconds of the crash-loop window")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    profile = with_gateway_address(load_profile(args.profile), args.host, args.port)
    policy = RestartPolicy(crash_loop_exits=args.crash_loop_exits, crash_loop_window_s=args.crash_loop_window)
    registry = prometheus_client.CollectorRegistry()
    if args.metrics_port:
        try:
            prometheus_client.start_http_server(args.metrics_port, addr="127.0.0.1", registry=registry)
        except OSError:
            log.error("port %d (the supervisor's metrics) is already in use: is another vitascope running? Stop it "
                      "or pass --metrics-port", args.metrics_port)
            return 1
    # SIGTERM during start-up acts like Ctrl-C: bring_up() stops the children it already started.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        supervisor = bring_up(pathlib.Path(args.profile), policy, registry, args.host, args.port)
    except (RuntimeError, CrashLoop, subprocess.CalledProcessError) as exc:
        log.error("%s", exc)
        return 1
    except KeyboardInterrupt:
        log.info("interrupted during start-up; the started services were stopped")
        return 1
    print(f"vitascope is up: open {_gateway_url(profile)}/  (Ctrl-C stops it)", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: supervisor.stop())
    signal.signal(signal.SIGINT, lambda *_: supervisor.stop())
    try:
        supervisor.run()
    except CrashLoop as exc:
        log.error("stopping the node: %s", exc)
        return 1
    finally:
        supervisor.stop_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
