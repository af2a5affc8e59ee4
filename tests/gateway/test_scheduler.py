"""FIFO admission with position updates and a queue limit."""
import asyncio

import pytest

from services.gateway.scheduler import QueueFull, SessionScheduler

pytestmark = pytest.mark.cpu


async def test_fifo_admission_and_positions():
    sched = SessionScheduler(num_slots=1, queue_limit=2)
    seen: dict[str, list[int]] = {"b": [], "c": []}
    a = sched.enqueue()
    b = sched.enqueue(seen["b"].append)
    c = sched.enqueue(seen["c"].append)
    assert a.granted and not b.granted and not c.granted
    assert (b.position, c.position) == (1, 2)
    with pytest.raises(QueueFull, match="queue is full"):
        sched.enqueue()
    sched.release(a)
    await asyncio.wait_for(sched.wait(b), 1)
    assert b.granted and c.position == 1
    assert seen == {"b": [1], "c": [2, 1]}
    assert (sched.num_active, sched.num_waiting) == (1, 1)


async def test_leaving_the_queue_moves_others_up_and_release_is_idempotent():
    sched = SessionScheduler(num_slots=1, queue_limit=3)
    a, b, c = sched.enqueue(), sched.enqueue(), sched.enqueue()
    sched.release(b)
    assert c.position == 1 and sched.num_waiting == 1
    sched.release(a)
    sched.release(a)
    assert c.granted and sched.num_active == 1 and sched.num_waiting == 0


async def test_zero_queue_limit_rejects_when_busy():
    sched = SessionScheduler(num_slots=2, queue_limit=0)
    sched.enqueue()
    sched.enqueue()
    with pytest.raises(QueueFull):
        sched.enqueue()


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="num_slots"):
        SessionScheduler(num_slots=0, queue_limit=1)


async def test_session_abandoned_before_running_frees_its_slot():
    from prometheus_client import CollectorRegistry

    from services.gateway.metrics import GatewayMetrics
    from services.gateway.protocol import SessionStart
    from services.gateway.service import SessionService
    from tests.gateway.fakes import FakePipeline, small_config

    service = SessionService(small_config(), FakePipeline(), GatewayMetrics(CollectorRegistry()))
    session = service.open(SessionStart(prompt="p"), sink=None)
    assert service.scheduler.num_active == 1
    session.abandon()
    assert service.scheduler.num_active == 0
