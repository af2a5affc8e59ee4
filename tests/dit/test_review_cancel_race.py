"""Review regressions: a cancel that lands after a phase's last check (while the phase still holds its lock)
must still release the KV cache and the session slot, single-process and on rank 0 of a Ulysses group."""

import threading
from types import SimpleNamespace

import pytest
import torch

from services.dit.api import PromptUpdate, RuntimeConfig, SessionConfig
from services.dit.group.control import CancelSession
from services.dit.group.orchestration import GroupSession
from services.dit.model.lora import LoRAAdapter, write_random_adapter
from services.dit.model.network import PRESETS, build_random
from services.dit.stream.runtime import DiTRuntime

pytestmark = pytest.mark.cpu

ARGS = PRESETS["tiny"]
CONFIG = SessionConfig(seed=5, width=96, height=64)


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    model = build_random(ARGS, "cpu", torch.float32, seed=0)
    adapter = LoRAAdapter.load(model, write_random_adapter(ARGS, tmp_path_factory.mktemp("lora"), seed=1))
    return DiTRuntime(model, RuntimeConfig.for_preset("tiny", max_text_tokens=16), adapter)


def prompt() -> PromptUpdate:
    return PromptUpdate(torch.randn(5, ARGS.text_dim, generator=torch.Generator().manual_seed(1)), "e0")


def cancel_from_other_thread(target) -> None:
    t = threading.Thread(target=target.cancel)
    t.start()
    t.join()


def test_cancel_after_the_final_check_releases_kv_and_slot(runtime):
    session = runtime.open_session(CONFIG, prompt())
    phase, check = session._phase, session._check
    state = {"after_phase": False}

    def phase_then_mark():
        out = phase()
        state["after_phase"] = True
        return out

    def check_then_cancel():
        check()  # the phase's final check passes ...
        if state["after_phase"]:  # ... then the client cancels while the phase still holds its lock
            state["after_phase"] = False
            cancel_from_other_thread(session)

    session._phase, session._check = phase_then_mark, check_then_cancel
    out = session.next_phase()  # the phase itself was complete: it is returned
    assert out.meta.phase_index == 0
    assert session.closed and session.kv is None
    assert runtime.active_session is None


class CountingLock:
    """An RLock that runs `on_last_exit` (once) when its outermost `with` ends."""

    def __init__(self):
        self._lock, self.depth, self.on_last_exit = threading.RLock(), 0, None

    def acquire(self, blocking=True):
        got = self._lock.acquire(blocking)
        self.depth += got
        return got

    def release(self):
        self.depth -= 1
        self._lock.release()
        if self.depth == 0 and self.on_last_exit is not None:
            hook, self.on_last_exit = self.on_last_exit, None
            hook()

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()


class FakeComm:
    """The parts of RankGroup that GroupSession uses, recording the control records it sends."""

    def __init__(self):
        self.lock, self.failure, self.sent = CountingLock(), None, []

    def send_control(self, record):
        self.sent.append(record)

    def broadcast_prompt(self, spec, embedding):
        return embedding


def group_session(runtime):
    comm = FakeComm()
    local = runtime.open_session(CONFIG, prompt())
    local.cancel_token = type(local.cancel_token)()
    group = SimpleNamespace(comm=comm, runtime=runtime, run_step=lambda step: step())
    return comm, local, GroupSession(group, local, CONFIG, None)


def test_group_cancel_inside_rank0_phase_window_still_tells_the_workers(runtime):
    comm, local, session = group_session(runtime)
    phase, check = local._phase, local._check
    state = {"after_phase": False}

    def phase_then_mark():
        out = phase()
        state["after_phase"] = True
        return out

    def check_then_cancel():
        check()
        if state["after_phase"]:
            state["after_phase"] = False
            cancel_from_other_thread(session)

    local._phase, local._check = phase_then_mark, check_then_cancel
    session.next_phase()
    assert local.closed and local.kv is None and runtime.active_session is None
    assert sum(isinstance(r, CancelSession) for r in comm.sent) == 1, comm.sent  # the workers are released too


def test_group_cancel_after_the_steps_last_check_releases_every_rank(runtime):
    comm, local, session = group_session(runtime)
    real_step = local.next_phase

    def step_then_arm():
        out = real_step()
        # the cancel lands after GroupSession.next_phase's own cancelled check, as it leaves the comm lock
        comm.lock.on_last_exit = lambda: cancel_from_other_thread(session)
        return out

    local.next_phase = step_then_arm
    session.next_phase()
    assert local.closed and local.kv is None and runtime.active_session is None
    assert sum(isinstance(r, CancelSession) for r in comm.sent) == 1, comm.sent
