"""The image tier's machinery: podman on this machine, a network namespace, a loopback wheel server, compose.

Drives podman (rootful) and Debian's docker-compose 1.29 through podman's Docker-compatible socket; the socket's
service runs inside a network namespace of its own, so the tiny compose file's host-network containers get a
loopback of their own and a dev stack on 127.0.0.1:8000/5005x cannot collide with them. Knows nothing about what
the services do: tests/images/test_images.py says what is checked.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import http.server
import os
import pathlib
import re
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DOCKERFILE = DEPLOY / "Dockerfile"
TINY_COMPOSE = DEPLOY / "compose.tiny-cpu.yaml"
REQUIRED_ENV = "VITASCOPE_IMAGES_REQUIRED"
"""Set to 1 (.ci/run does) and a machine that cannot run the tier fails it instead of skipping."""
BASE_ENV = "VITASCOPE_PYTHON_IMAGE"
"""A base image to use instead of python:3.11-slim or the local Debian build (scripts/build_base_image.sh)."""
LOCAL_BASE = "localhost/vitascope-python:3.11-bookworm"
HOST_CA_BUNDLE = pathlib.Path("/etc/ssl/certs/ca-certificates.crt")
WHEEL_PORT = 47813
REPORT: dict[str, str] = {}
"""What the tier measured (timings, sizes), printed at the end of the run by tests/images/conftest.py."""


class Unavailable(Exception):
    """This machine cannot run the image tier (no podman, no root, no namespaces)."""


def dockerfile_arg(name: str) -> str:
    """The default of `ARG name=...` in deploy/Dockerfile, quotes stripped."""
    match = re.search(rf"^ARG {name}=(.*)$", DOCKERFILE.read_text(), flags=re.M)
    if match is None:
        raise KeyError(f"deploy/Dockerfile has no ARG {name}=")
    return match.group(1).strip().strip('"')


def run(args: list[str], *, timeout: float, env: dict[str, str] | None = None, check: bool = True,
        cwd: pathlib.Path = ROOT) -> subprocess.CompletedProcess:
    """Run a command, capturing its output; raise with the output's tail when it fails and `check`."""
    result = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    if check and result.returncode != 0:
        tail = (result.stdout + result.stderr)[-6000:]
        raise AssertionError(f"{' '.join(args[:6])} ... exited {result.returncode}:\n{tail}")
    return result


@dataclasses.dataclass
class Podman:
    """Rootful podman with limits this machine lets a container set (written to a containers.conf of its own)."""

    workdir: pathlib.Path
    env: dict[str, str] = dataclasses.field(default_factory=dict)

    @classmethod
    def prepare(cls, workdir: pathlib.Path) -> Podman:
        """Install podman and its helpers if missing, and check that a container starts; raise Unavailable."""
        if os.geteuid() != 0:
            raise Unavailable("the image tier runs rootful podman (needs root)")
        installed = subprocess.run(["bash", str(ROOT / "scripts/install_image_deps.sh")], capture_output=True,
                                   text=True, timeout=900)
        if installed.returncode != 0:
            raise Unavailable(f"scripts/install_image_deps.sh: {installed.stderr.strip()[-500:]}")
        conf = workdir / "containers.conf"
        nofile, nproc = _container_limits()
        # podman's default limits are above what this kind of VM lets runc set even for root (no CAP_SYS_RESOURCE)
        conf.write_text(f'[containers]\ndefault_ulimits = ["nofile={nofile}:{nofile}", "nproc={nproc}:{nproc}"]\n')
        podman = cls(workdir, {**os.environ, "CONTAINERS_CONF": str(conf)})
        probe = subprocess.run(["podman", "info", "--format", "{{.Store.GraphDriverName}}"], capture_output=True,
                               text=True, timeout=120, env=podman.env)
        if probe.returncode != 0:
            raise Unavailable(f"podman info: {probe.stderr.strip()[-500:]}")
        return podman

    @functools.cached_property
    def ulimits(self) -> list[str]:
        """`--ulimit` flags for `podman build` (which does not read containers.conf's default_ulimits)."""
        nofile, nproc = _container_limits()
        return ["--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", f"nproc={nproc}:{nproc}"]

    def __call__(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        return run(["podman", *args], timeout=timeout, env=self.env, check=check)

    def base_image(self) -> str:
        """A Python base image: $VITASCOPE_PYTHON_IMAGE, the Dockerfile's default if a registry serves it, or one
        built from Debian's packages (scripts/build_base_image.sh, kept for later runs on this machine)."""
        if os.environ.get(BASE_ENV):
            return os.environ[BASE_ENV]
        default = dockerfile_arg("PYTHON_IMAGE")
        if self("image", "exists", default, check=False).returncode == 0:
            return default
        if self("image", "exists", LOCAL_BASE, check=False).returncode != 0:
            pulled = subprocess.run(["podman", "pull", "--quiet", f"docker.io/library/{default}"],
                                    capture_output=True, text=True, timeout=60, env=self.env)
            if pulled.returncode == 0:
                return default
        run(["bash", str(ROOT / "scripts/build_base_image.sh"), LOCAL_BASE], timeout=1500, env=self.env)
        return LOCAL_BASE

    def build(self, target: str, tag: str, build_args: dict[str, str], *, timeout: float = 1500) -> None:
        """Build a target of deploy/Dockerfile as shipped, on the host network (the loopback wheel server)."""
        args = ["build", *self.ulimits, "--network", "host", "-f", str(DOCKERFILE), "--target", target, "-t", tag]
        if HOST_CA_BUNDLE.exists():  # this machine's trust store (an intercepting proxy's CA), for pip only
            args += ["-v", f"{HOST_CA_BUNDLE}:{HOST_CA_BUNDLE}:ro"]
        for key, value in build_args.items():
            args += ["--build-arg", f"{key}={value}"]
        self(*args, str(ROOT), timeout=timeout)

    def image_size(self, tag: str) -> int:
        """Bytes of an image, as `podman images` counts them."""
        return int(self("image", "inspect", "--format", "{{.Size}}", tag).stdout.strip())


def _container_limits() -> tuple[int, int]:
    import resource

    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    nproc = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    pid_max = int(pathlib.Path("/proc/sys/kernel/pid_max").read_text())
    # seen here: runc may set nproc up to pid_max (32768), not the hard limit (96363) above it
    nproc = pid_max if nproc == resource.RLIM_INFINITY else min(nproc, pid_max)
    nofile = 65536 if nofile == resource.RLIM_INFINITY else nofile
    return nofile, nproc


@contextlib.contextmanager
def wheel_server(directory: pathlib.Path) -> Iterator[str]:
    """Serve `directory` on 127.0.0.1 as a pip --find-links page; yield its URL.

    The port is fixed where it is free (WHEEL_PORT): the URL is a build argument, so a new port every run would
    miss the build cache of every layer after torch's."""
    handler = functools.partial(_QuietHandler, directory=str(directory))
    try:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", WHEEL_PORT), handler)
    except OSError:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        pass


@dataclasses.dataclass
class Namespace:
    """A network namespace with its loopback up, and podman's socket service running inside it."""

    name: str
    socket: pathlib.Path
    service: subprocess.Popen

    def exec(self, args: list[str], *, timeout: float, env: dict[str, str] | None = None,
             check: bool = True) -> subprocess.CompletedProcess:
        """Run a command inside the namespace (its 127.0.0.1 is the containers' 127.0.0.1)."""
        return run(_enter(self.name, args), timeout=timeout, env=env, check=check)


def _enter(namespace: str, args: list[str]) -> list[str]:
    """`args` run in the network namespace only (`ip netns exec` also remounts /sys, hiding the cgroup mounts
    that runc needs)."""
    return ["nsenter", f"--net=/run/netns/{namespace}", "--", *args]


@contextlib.contextmanager
def podman_service_in_namespace(podman: Podman) -> Iterator[Namespace]:
    """Create a network namespace, run `podman system service` inside it; remove both afterwards."""
    name = f"vitascope-images-{uuid.uuid4().hex[:8]}"
    created = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True, timeout=30)
    if created.returncode != 0:
        raise Unavailable(f"ip netns add: {created.stderr.strip()}")
    service = None
    try:
        run(["ip", "-n", name, "link", "set", "lo", "up"], timeout=30)
        socket = podman.workdir / "podman.sock"
        service = subprocess.Popen(_enter(name, ["podman", "system", "service", "--time=0", f"unix://{socket}"]),
                                   env=podman.env, stdout=subprocess.DEVNULL,
                                   stderr=(podman.workdir / "podman-service.log").open("w"))
        deadline = time.monotonic() + 30
        while not socket.exists():
            if service.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"podman system service did not start: "
                                     f"{(podman.workdir / 'podman-service.log').read_text()[-2000:]}")
            time.sleep(0.2)
        yield Namespace(name, socket, service)
    finally:
        if service is not None:
            service.terminate()
            try:
                service.wait(timeout=20)
            except subprocess.TimeoutExpired:
                service.kill()
                service.wait(timeout=10)
        subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=30)


@dataclasses.dataclass
class Compose:
    """docker-compose on podman's socket for one project (its own name and images)."""

    podman: Podman
    namespace: Namespace
    project: str
    images: dict[str, str]
    """VITASCOPE_STAGE_IMAGE / VITASCOPE_GATEWAY_IMAGE: the tags the test built."""

    @property
    def env(self) -> dict[str, str]:
        env = {k: v for k, v in self.podman.env.items() if not k.startswith(("VITASCOPE_", "COMPOSE_", "DOCKER_"))}
        return {**env, **self.images, "DOCKER_HOST": f"unix://{self.namespace.socket}"}

    def __call__(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        cli = shutil.which("docker-compose")
        assert cli, "docker-compose is missing (scripts/install_image_deps.sh installs it)"
        return run([cli, "-p", self.project, "-f", str(TINY_COMPOSE), *args], timeout=timeout, env=self.env,
                   check=check, cwd=DEPLOY)

    def containers(self, *, all_states: bool = True) -> dict[str, str]:
        """Compose service name -> container id, for this project's containers."""
        args = ["ps", "--format", "{{.ID}} {{.Labels}}", "--filter", f"label=com.docker.compose.project={self.project}"]
        out = self.podman(*args, *(["-a"] if all_states else [])).stdout
        found = {}
        for line in out.splitlines():
            cid, _, labels = line.partition(" ")
            match = re.search(r"com\.docker\.compose\.service:(\S+?)[\] ]", labels + " ")
            if match:
                found[match.group(1)] = cid
        return found

    def leftovers(self) -> dict[str, list[str]]:
        """This project's containers, volumes and networks that still exist."""
        label = f"label=com.docker.compose.project={self.project}"
        return {
            "containers": self.podman("ps", "-a", "-q", "--filter", label).stdout.split(),
            "volumes": self.podman("volume", "ls", "-q", "--filter", label).stdout.split(),
            "networks": [n for n in self.podman("network", "ls", "--format", "{{.Name}}").stdout.split()
                         if n.startswith(f"{self.project}_")],
        }


def drive_health_checks(podman: Podman, compose: Compose, stop: threading.Event, period_s: float = 3.0) -> None:
    """Run every project container's health check each `period_s` until `stop`.

    podman runs health checks from systemd timers; with no systemd (a CI container, this VM) nothing runs them,
    so the test does what the timer would, and compose sees (healthy) as it would under Docker."""
    while not stop.wait(period_s):
        with contextlib.suppress(Exception):
            for cid in compose.containers(all_states=False).values():
                # inside the namespace: a host-network container's exec joins the caller's network namespace
                subprocess.run(_enter(compose.namespace.name, ["podman", "healthcheck", "run", cid]),
                               capture_output=True, timeout=30, env=podman.env)


def health(podman: Podman, cid: str) -> str:
    """A container's health status: healthy, unhealthy, starting, or '' without a health check."""
    fmt = "{{if .State.Healthcheck}}{{.State.Healthcheck.Status}}{{end}}"
    return podman("inspect", "--format", fmt, cid, check=False).stdout.strip()
