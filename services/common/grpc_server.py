"""Lifecycle of one stage's grpc.aio server: load, warm up, serve with health and reflection, stop on SIGTERM.

Knows nothing about what the stage computes: the stage hands in a `Stage` with start/warmup/close and a
function that registers its servicer.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
import prometheus_client

from services.common.config import Profile, load_profile
from services.common.gpu_budget import check_fits
from services.common.logging_setup import configure_logging
from services.common.memory import share_one_heap
from services.common.startup import ProgressFile, report

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 8 << 20
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
]
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    # a restarted stage is reconnected to within a second or two, however long it was down
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]
HEALTH_NAMES = {
    "encoder": "vitascope.encoder.v1.Encoder",
    "dit": "vitascope.dit.v1.DiT",
    "vae": "vitascope.vae.v1.VAE",
}
"""Readiness health service name of each stage (its gRPC service's full name)."""
SHUTDOWN_GRACE_SECONDS = 5.0
HEALTH_POLL_SECONDS = 1.0
FAILED_EXIT_CODE = 3
"""A stage's exit code when it broke for good while serving (its supervisor restarts it)."""


STAGE_WORKERS = min(32, (os.cpu_count() or 1) + 4)
"""Threads of a stage's default executor: as many as asyncio's own default, all started with the process."""


def started_pool(workers: int, thread_name_prefix: str,
                 initializer: Callable[[], None] | None = None) -> ThreadPoolExecutor:
    """A thread pool whose `workers` threads all run already, each having run `initializer` (a pool otherwise starts
    them one by one, lazily: one more whenever a call finds none idle, which a call right after another's end can)."""
    pool = ThreadPoolExecutor(workers, thread_name_prefix=thread_name_prefix, initializer=initializer)
    barrier = threading.Barrier(workers)
    for future in [pool.submit(barrier.wait) for _ in range(workers)]:  # each waits until all run: one per thread
        future.result()
    return pool


class Stage(ABC):
    """What a stage's protocol-neutral service must provide to be served."""

    @abstractmethod
    def start(self) -> None:
        """Load weights (blocking; runs in a worker thread)."""

    @abstractmethod
    def warmup(self) -> None:
        """Run every shape once / capture graphs so the first request is warm (blocking)."""

    def close(self) -> None:
        """Release devices and files."""

    def prepare_worker(self) -> None:
        """Ready one thread of the stage's default executor, on it, before any request (e.g. start its OpenMP team),
        so that the process's threads do not change while it serves. Nothing by default."""

    @property
    def failed(self) -> bool:
        """True once the stage broke for good; health then reports NOT_SERVING."""
        return False


Register = Callable[[grpc.aio.Server, Stage], None]
"""Adds a stage's servicer (its grpc_server module's mapping onto the service) to a server."""


async def serve(stage: Stage, health_name: str, register: Register, port: int, metrics_port: int = 0,
                host: str = "127.0.0.1", ready: Callable[[], None] | None = None,
                metrics_host: str = "127.0.0.1") -> bool:
    """Serve a stage until SIGTERM/SIGINT (True) or until it fails for good (False): liveness at once,
    readiness after start() and warmup(). The stage's blocking calls run on `STAGE_WORKERS` threads started here,
    each prepared by the stage (`Stage.prepare_worker`)."""
    loop = asyncio.get_running_loop()
    loop.set_default_executor(started_pool(STAGE_WORKERS, "stage-worker", stage.prepare_worker))
    server = grpc.aio.server(options=SERVER_OPTIONS)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    register(server, stage)
    names = (health_name, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"cannot bind {host}:{port}")
    if metrics_port:
        prometheus_client.start_http_server(metrics_port, addr=metrics_host)
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set(health_name, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.start()
    log.info("%s listening on %s:%d, loading", health_name, host, bound)

    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await asyncio.to_thread(stage.start)
        report(log, "warm-up")
        await asyncio.to_thread(stage.warmup)
        await health_servicer.set(health_name, health_pb2.HealthCheckResponse.SERVING)
        log.info("%s serving", health_name)
        if ready is not None:
            ready()
        while not stop.is_set():
            if stage.failed:
                log.error("%s failed for good; reporting NOT_SERVING and exiting to be restarted", health_name)
                await health_servicer.set(health_name, health_pb2.HealthCheckResponse.NOT_SERVING)
                return False
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), HEALTH_POLL_SECONDS)
        return True
    finally:
        log.info("%s shutting down", health_name)
        await health_servicer.enter_graceful_shutdown()
        await server.stop(SHUTDOWN_GRACE_SECONDS)
        stage.close()


def run_stage(name: str, make_stage: Callable[[Profile], Stage], register: Register) -> None:
    """Entry point of a stage: `python -m services.<name> --profile P [--port N] [--device D]`.

    `--device` overrides `<name>.device` (encoder and VAE; the DiT's devices come from the profile only). Before
    anything loads, the profile's memory shares on the stage's GPUs must fit them (`gpu_budget.check_fits`), and
    the process's threads are set to share one heap (`memory.share_one_heap`).
    """
    parser = argparse.ArgumentParser(description=f"vitascope {name} stage")
    parser.add_argument("--profile", required=True, help="deployment profile YAML (configs/*.yaml)")
    parser.add_argument("--port", type=int, help=f"override the profile's {name} port")
    parser.add_argument("--host", help="address the gRPC server binds (default: the host of the profile's endpoint "
                                       "for this stage; in a Kubernetes pod 0.0.0.0, the pod's own network, which "
                                       "the kubelet's probes reach)")
    parser.add_argument("--metrics-host", default="127.0.0.1",
                        help="address the Prometheus endpoint binds (default loopback; a pod's scrape needs 0.0.0.0)")
    if name != "dit":
        parser.add_argument("--device", help=f"override {name}.device")
    parser.add_argument("--progress-file", help="keep the newest start-up step in this JSON file, for "
                                                "`services.common.healthcheck --progress-file` (start-up probes)")
    args = parser.parse_args()
    share_one_heap()  # before any thread allocates (services.common.memory)
    configure_logging(name)
    progress = ProgressFile(args.progress_file) if args.progress_file else None
    if progress is not None:
        logging.getLogger().addHandler(progress)
    device = getattr(args, "device", None)
    profile = load_profile(args.profile, {name: {"device": device}} if device else None)
    check_fits(profile, name)
    port = args.port or profile.endpoints.port_of(name)
    host = args.host or profile.endpoints.host_of(name)  # where the profile says it is, unless told otherwise
    stopped = asyncio.run(serve(make_stage(profile), HEALTH_NAMES[name], register, port,
                                getattr(profile, name).metrics_port, host=host, metrics_host=args.metrics_host,
                                ready=progress.ready if progress is not None else None))
    if not stopped:  # broken for good (a DiT group lost a rank): exit, so the supervisor starts it afresh
        sys.exit(FAILED_EXIT_CODE)
