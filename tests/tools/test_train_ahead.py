"""`tools.train.ahead`: a trainer's inputs made on a thread, ahead of its steps."""
from __future__ import annotations

import threading
import time

import pytest

from tools.train import student
from tools.train.ahead import Ahead

pytestmark = pytest.mark.cpu


class Counter:
    def __init__(self, fail_at: int | None = None) -> None:
        self.made, self.fail_at, self.lock = 0, fail_at, threading.Lock()

    def __call__(self) -> int:
        with self.lock:
            if self.made == self.fail_at:
                raise OSError(f"worker lost at item {self.made}")
            self.made += 1
            return self.made - 1


def settle(counter: Counter) -> int:
    """What the producer has made once it stops making more."""
    seen = -1
    while seen != counter.made:
        seen = counter.made
        time.sleep(0.3)
    return seen


def test_results_come_in_the_order_made_and_at_most_depth_ahead_of_the_caller():
    counter = Counter()
    with Ahead(counter, depth=3) as ahead:
        assert settle(counter) <= 3 + 1  # the queue's 3 and one waiting to go in
        assert [ahead.next() for _ in range(10)] == list(range(10))
        assert settle(counter) <= 10 + 3 + 1


def test_an_error_of_the_producer_is_raised_by_next_after_the_results_before_it():
    with Ahead(Counter(fail_at=2), depth=4) as ahead:
        assert [ahead.next(), ahead.next()] == [0, 1]
        with pytest.raises(RuntimeError, match="worker lost at item 2") as caught:
            ahead.next()
        assert isinstance(caught.value.__cause__, OSError)
        with pytest.raises(RuntimeError, match="has stopped"):
            ahead.next()


def test_close_stops_the_producer():
    counter = Counter()
    ahead = Ahead(counter, depth=2)
    ahead.next()
    ahead.close()
    made = counter.made
    time.sleep(0.5)
    assert counter.made == made
    assert not any(t.name == "ahead" for t in threading.enumerate())


def test_a_caching_student_run_encodes_ahead_as_many_steps_as_fill_its_bank_and_the_base_cache():
    cfg = student.StudentRunConfig(sessions=16, distinct=2048, base_accum=4, train_base=True)
    assert student.steps_ahead(cfg, caches=True) == 512
    assert student.steps_ahead(student.StudentRunConfig(sessions=16, distinct=2048), caches=True) == 128
    assert student.steps_ahead(cfg, caches=False) == 1


def test_a_depth_below_one_is_refused():
    with pytest.raises(ValueError, match="depth=0"):
        Ahead(Counter(), depth=0)


def test_close_returns_only_once_the_call_in_progress_has_returned():
    """A producer thread still in torch's work when the trainer's process exits aborts it (seen in the job's
    CPU smoke run, as 'terminate called without an active exception'): close waits for the call, however long."""
    calls: list[str] = []

    def slow() -> int:
        calls.append("began")
        time.sleep(1.5)
        calls.append("returned")
        return len(calls)

    ahead = Ahead(slow, depth=1)
    ahead.next()
    while calls.count("began") < 2:  # the second call is in progress
        time.sleep(0.05)
    ahead.close()
    assert calls[-1] == "returned" and calls.count("began") == calls.count("returned")
    assert not ahead._thread.is_alive()
