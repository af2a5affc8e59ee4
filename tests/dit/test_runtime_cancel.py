"""Streaming runtime: cancellation releases KV and the session slot; a fault mid-commit leaves KV untouched.

A cancel that lands after a phase's last check (while the phase still holds its lock) must still release the KV
cache and the session slot, single-process and on rank 0 of a Ulysses group (GroupSession over a fake comm)."""

import threading
from types import SimpleNamespace

import pytest
import torch

from services.common.errors import NoCapacity
from services.dit.api import InvalidCanvas, PromptUpdate, SessionCancelled, SessionClosed, SessionConfig
from services.dit.group.control import CancelSession
from services.dit.group.orchestration import GroupSession
from services.dit.stream import runtime as runtime_module
from services.dit.stream.runtime import DiTRuntime
from tests.dit.factories import TINY, tiny_runtime

pytestmark = pytest.mark.cpu

ARGS = TINY
CONFIG = SessionConfig(seed=5, width=96, height=64)


def make_runtime(adapter_dir) -> DiTRuntime:
    return tiny_runtime(adapter_dir)


def prompt() -> PromptUpdate:
    return PromptUpdate(torch.randn(5, ARGS.text_dim, generator=torch.Generator().manual_seed(1)), "e0")


def hook_forward(model, hook):
    """Call hook(n, heads, attention) before every forward; it may return a replacement attention."""
    inner, calls = model.forward, []

    def wrapped(video, audio, text, layout, attention, heads=True):
        calls.append(heads)
        attention = hook(len(calls), heads, attention) or attention
        return inner(video, audio, text, layout, attention, heads=heads)

    model.forward = wrapped
    return calls



def test_cancel_mid_phase_releases_kv_and_session(adapter_dir):
    rt = make_runtime(adapter_dir)
    session = rt.open_session(CONFIG, prompt())
    session.next_phase()
    kv = session.kv
    state = {}

    def cancel_on_second_student_forward(n, heads, attention):
        state["n"] = state.get("n", 0) + 1
        if state["n"] == 2:
            session.cancel()  # from inside a forward: honoured at the next check between forwards

    calls = hook_forward(rt.model, cancel_on_second_student_forward)
    with pytest.raises(SessionCancelled):
        session.next_phase()
    assert len(calls) == 2  # no further forward after the cancel
    assert session.kv is None and kv.released and kv.nbytes == 0
    assert rt.active_session is None and session.closed
    with pytest.raises(SessionClosed):
        session.next_phase()
    rt.model.forward = type(rt.model).forward.__get__(rt.model)
    other = rt.open_session(CONFIG, prompt())  # the slot is free again
    assert rt.active_session is other
    other.cancel()  # idle cancel releases at once
    assert other.kv is None and rt.active_session is None


def test_cancel_after_the_last_check_still_releases_the_session(adapter_dir):
    rt = make_runtime(adapter_dir)
    session = rt.open_session(CONFIG, prompt())

    def cancel_in_last_student(n, heads, attention):
        if n == 9 + 3:  # 9 teacher forwards, then the third student: past the phase's last cancellation check
            session.cancel()

    hook_forward(rt.model, cancel_in_last_student)
    with pytest.raises(SessionCancelled):
        session.next_phase()
    assert session.kv is None and session.closed and rt.active_session is None
    rt.open_session(CONFIG, prompt()).close()  # the group's slot is free again


def test_a_cancelled_session_drops_its_pending_commit(adapter_dir):
    rt = make_runtime(adapter_dir)
    session = rt.open_session(CONFIG, prompt())
    session.next_phase()  # its commit waits for the next phase
    calls = hook_forward(rt.model, lambda n, heads, attention: None)
    session.cancel()
    with pytest.raises(SessionClosed):
        session.next_phase()
    assert calls == [] and session.kv is None and rt.active_session is None


def test_fault_mid_commit_leaves_kv_exactly_as_before(adapter_dir):
    ref_rt = make_runtime(adapter_dir)
    ref = ref_rt.open_session(CONFIG, prompt())
    ref_outs = [ref.next_phase() for _ in range(3)]
    ref.close()

    rt = make_runtime(adapter_dir)
    session = rt.open_session(CONFIG, prompt())
    first, second = session.next_phase(), session.next_phase()  # phase 0 committed during phase 1
    kv = session.kv
    before_rows = [(k[:kv.live].clone(), v[:kv.live].clone()) for k, v in zip(kv.k, kv.v)]
    before_meta = (kv.live, kv.num_commits, [(r.index, r.start, r.audio_rows, r.video_rows) for r in kv.records])
    assert kv.live > 0 and kv.num_commits == 1

    def faulty_commit(n, heads, attention):
        if heads:
            return None

        def attend(layer, q, k, v):
            out = attention(layer, q, k, v)  # layer 0 stages its K/V, layer 1 fails after staging
            if layer == ARGS.num_layers - 1:
                raise RuntimeError("injected fault in the commit forward")
            return out

        return attend

    calls = hook_forward(rt.model, faulty_commit)
    with pytest.raises(RuntimeError, match="injected fault"):
        session.next_phase()  # phase 1's commit runs first and fails: no student forward follows
    assert calls == [False]
    assert not kv.in_transaction
    assert (kv.live, kv.num_commits, [(r.index, r.start, r.audio_rows, r.video_rows) for r in kv.records]) \
        == before_meta
    for (k0, v0), k, v in zip(before_rows, kv.k, kv.v):
        assert torch.equal(k[:kv.live], k0) and torch.equal(v[:kv.live], v0)
    # the session is still usable: the retried phase commits phase 1 again and equals the undisturbed run bitwise
    rt.model.forward = type(rt.model).forward.__get__(rt.model)
    retried = session.next_phase()
    assert torch.equal(first.video, ref_outs[0].video) and torch.equal(second.video, ref_outs[1].video)
    assert torch.equal(retried.video, ref_outs[2].video) and torch.equal(retried.audio, ref_outs[2].audio)
    assert retried.meta.phase_index == 2 and kv.num_commits == 2
    session.close()
    assert rt.active_session is None


@pytest.mark.slow
def test_a_phase_that_fails_after_its_students_changes_no_state(adapter_dir, monkeypatch):
    # the output's device copies come after the students: a failure there (out of memory) leaves the phase to a
    # retry, which must find the session as before it: no pending commit of the lost phase, the same reference
    # statistics, the request's tail and text K/V untouched (phase 3 is request 0's last)
    ref_rt = make_runtime(adapter_dir)
    ref = ref_rt.open_session(CONFIG, prompt())
    ref_outs = [ref.next_phase() for _ in range(5)]
    ref_commits = ref.kv.num_commits
    ref.close()

    real, made = runtime_module.PhaseOutput, []

    def failing(**fields):
        made.append(fields["meta"].phase_index)
        if len(made) in (1, 4, 6):  # the first attempts at request 0's phases 0, 2 and 3
            raise RuntimeError("injected: CUDA out of memory")
        return real(**fields)

    monkeypatch.setattr(runtime_module, "PhaseOutput", failing)
    rt = make_runtime(adapter_dir)
    session = rt.open_session(CONFIG, prompt())
    outs = []
    while len(outs) < 5:
        try:
            outs.append(session.next_phase())
        except RuntimeError as exc:
            assert "injected" in str(exc)
    assert made == [0, 0, 1, 2, 2, 3, 3, 0]
    for got, want in zip(outs, ref_outs):
        assert (got.meta.request_index, got.meta.phase_index) == (want.meta.request_index, want.meta.phase_index)
        assert torch.equal(got.video, want.video) and torch.equal(got.audio, want.audio)
    assert session.kv.num_commits == ref_commits
    session.close()


def test_one_session_per_group_and_bad_canvas(adapter_dir):
    rt = make_runtime(adapter_dir)
    with pytest.raises(InvalidCanvas, match=r"short edge 96 is not one of the allowed short edges \(64, 128"):
        rt.open_session(SessionConfig(seed=1, width=96, height=96), prompt())
    assert rt.active_session is None
    session = rt.open_session(CONFIG, prompt())
    with pytest.raises(NoCapacity, match="one active session per group"):
        rt.open_session(CONFIG, prompt())
    session.close()
    rt.open_session(CONFIG, prompt()).close()

@pytest.fixture(scope="module")
def runtime(adapter_dir):
    """One runtime shared by the cancel-race cases (each leaves its slot free)."""
    return make_runtime(adapter_dir)


def cancel_from_other_thread(target) -> None:
    t = threading.Thread(target=target.cancel)
    t.start()
    t.join()


def test_cancel_while_the_phase_still_holds_its_lock_releases_kv_and_slot(runtime):
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
