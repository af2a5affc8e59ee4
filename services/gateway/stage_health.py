"""The gateway's view of each stage's readiness, kept current by gRPC health `Watch` streams.

One task per stage holds a `Watch` of the stage's named (readiness) health service. A stage is up while its last
reported status is SERVING; a stream that ends or fails (the process died, the port closed) marks it down at once,
and the watch is asked again every `retry_s` until the stage answers. Each time a stage goes down its `epoch`
advances, so what was learnt from the process before (its transport hello, the slots it held) can be dropped.
A wedged stage keeps its stream open without answering; the stall timeout of a session and the node's liveness
probes deal with that.

Knows nothing about sessions or websockets: it answers "which stages are down" and "wait until none is".
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

log = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING


class StageHealth:
    """Readiness of the stages behind the gateway (see the module docstring)."""

    def __init__(self, channels: Mapping[str, grpc.aio.Channel], health_names: Mapping[str, str],
                 retry_s: float = 0.5, on_down: Callable[[str], None] | None = None) -> None:
        if retry_s <= 0:
            raise ValueError(f"retry_s={retry_s}: must be > 0")
        self._channels = dict(channels)
        self._names = dict(health_names)
        self._retry_s = retry_s
        self._on_down = on_down
        self._up = {name: False for name in self._channels}
        self._epochs = {name: 0 for name in self._channels}
        self._since = {name: time.monotonic() for name in self._channels}
        self._changed = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        """Start watching every stage (call from the event loop that serves the gateway)."""
        if not self._tasks:
            self._tasks = [asyncio.create_task(self._watch(name), name=f"health-{name}") for name in self._channels]

    async def close(self) -> None:
        """Stop watching."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []

    def down(self) -> list[str]:
        """The stages not SERVING now, in stage order."""
        return [name for name, up in self._up.items() if not up]

    def epoch(self, name: str) -> int:
        """How many times stage `name` has gone down since the gateway started."""
        return self._epochs[name]

    def report(self) -> dict[str, dict[str, object]]:
        """Per stage: `serving` and the seconds since it last changed."""
        now = time.monotonic()
        return {name: {"serving": up, "for_s": round(now - self._since[name], 1)} for name, up in self._up.items()}

    async def wait_ready(self, timeout_s: float) -> list[str]:
        """Wait until every stage is SERVING or `timeout_s` passed; the stages still down (empty: all ready)."""
        deadline = time.monotonic() + timeout_s
        while self.down():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)
        return self.down()

    def _set(self, name: str, up: bool, why: str) -> None:
        if self._up[name] == up:
            return
        self._up[name] = up
        self._since[name] = time.monotonic()
        if up:
            log.info("stage %s is serving", name)
        else:
            self._epochs[name] += 1
            log.warning("stage %s is down: %s", name, why)
            if self._on_down is not None:
                self._on_down(name)
        self._changed.set()

    async def _watch(self, name: str) -> None:
        stub = health_pb2_grpc.HealthStub(self._channels[name])
        request = health_pb2.HealthCheckRequest(service=self._names[name])
        while True:
            try:
                async for reply in stub.Watch(request, wait_for_ready=True):
                    self._set(name, reply.status == SERVING, health_pb2.HealthCheckResponse.ServingStatus.Name(
                        reply.status))
                why = "its health stream ended"
            except grpc.RpcError as exc:
                why = f"{exc.code().name}: {exc.details() or 'no details'}"
            self._set(name, False, why)
            await asyncio.sleep(self._retry_s)
