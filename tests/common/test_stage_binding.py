"""A stage listens only where its profile says it is: gRPC and metrics on loopback by default, never a wildcard
address; a stage that breaks for good stops serving so that its supervisor can restart it."""
import asyncio
import os
import signal

import pytest

from services.common.config import load_profile
from services.common.grpc_server import Stage, serve
from tools.ports import free_ports

pytestmark = pytest.mark.cpu


class _Idle(Stage):
    def __init__(self, fail_after_start: bool = False) -> None:
        self.fail_after_start = fail_after_start
        self.closed = False

    def start(self) -> None:
        pass

    def warmup(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    @property
    def failed(self) -> bool:
        return self.fail_after_start


V4_MAPPED = "0000000000000000FFFF0000"


def _listeners(port: int) -> set[str]:
    """The local addresses listening on `port` (IPv4 and IPv6), as /proc/net/tcp* writes them."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.rsplit(":", 1)
                if state == "0A" and int(hex_port, 16) == port:
                    found.add(address.removeprefix(V4_MAPPED))  # ::ffff:127.0.0.1 is 127.0.0.1
    return found


def test_every_shipped_profile_places_its_stages_on_loopback():
    for name in ("tiny_cpu", "usp2_fp8", "usp4_bf16"):
        endpoints = load_profile(f"configs/{name}.yaml").endpoints
        assert {endpoints.host_of(s) for s in ("encoder", "dit", "vae")} == {"127.0.0.1"}, name


async def test_a_stage_binds_grpc_and_metrics_to_loopback_only():
    grpc_port, metrics_port = free_ports(2)
    ready = asyncio.Event()
    task = asyncio.create_task(serve(_Idle(), "test.v1.Idle", lambda server, stage: None, grpc_port, metrics_port,
                                     host="127.0.0.1", ready=ready.set))
    try:
        await asyncio.wait_for(ready.wait(), 30)
        assert _listeners(grpc_port) == {"0100007F"}  # 127.0.0.1, nothing on 0.0.0.0 or ::
        assert _listeners(metrics_port) == {"0100007F"}
    finally:
        os.kill(os.getpid(), signal.SIGTERM)  # serve() stops on SIGTERM, as a stage process does
        assert await asyncio.wait_for(task, 30) is True


async def test_a_stage_that_breaks_for_good_stops_serving_to_be_restarted():
    stage = _Idle(fail_after_start=True)
    stopped = await asyncio.wait_for(serve(stage, "test.v1.Idle", lambda server, stage: None, free_ports(1)[0]), 30)
    assert stopped is False and stage.closed


def test_a_started_pool_runs_all_its_threads_before_any_call():
    import threading

    from services.common.grpc_server import started_pool

    before = threading.active_count()
    pool = started_pool(5, "probe")
    try:
        assert threading.active_count() - before == 5
        for _ in range(20):
            pool.submit(lambda: None).result()
        assert threading.active_count() - before == 5  # calls use the started threads, none is added
    finally:
        pool.shutdown()


class _Recording(_Idle):
    """Notes the threads it prepared and the one it loaded on."""

    def __init__(self) -> None:
        super().__init__(fail_after_start=True)  # serve() returns once it is ready
        self.prepared: set[str] = set()
        self.started_on = ""

    def prepare_worker(self) -> None:
        import threading

        self.prepared.add(threading.current_thread().name)

    def start(self) -> None:
        import threading

        self.started_on = threading.current_thread().name


async def test_a_stage_works_on_threads_started_and_prepared_before_it_loads():
    # the event loop's default executor started its threads lazily, one more whenever a call found none idle: a
    # thread added late in a soak ran torch and grew an OpenMP team (the DiT 14 -> 16 threads)
    from services.common.grpc_server import STAGE_WORKERS

    stage = _Recording()
    assert await asyncio.wait_for(serve(stage, "test.v1.Idle", lambda server, stage: None, free_ports(1)[0]), 30) is False
    assert stage.prepared == {f"stage-worker_{i}" for i in range(STAGE_WORKERS)}
    assert stage.started_on in stage.prepared
