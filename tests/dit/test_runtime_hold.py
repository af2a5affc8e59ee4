"""Hold at request boundaries: finite falls back on time, infinite waits, request 0 never holds, cancel is
answered within one poll, and no forward runs while holding."""

import threading
import time

import pytest
import torch

from services.dit.api import HoldConfig, PromptUpdate, SessionCancelled, SessionConfig
from services.dit.stream.session import CancelToken, PromptBook
from tests.dit.factories import TINY, tiny_adapter, tiny_model, tiny_runtime

pytestmark = pytest.mark.cpu

ARGS = TINY


def prompt(seed: int, event_id: str) -> PromptUpdate:
    return PromptUpdate(torch.randn(4, ARGS.text_dim, generator=torch.Generator().manual_seed(seed)), event_id)


def test_request_0_never_holds():
    book = PromptBook(prompt(1, "e0"), HoldConfig(enabled=True, max_seconds=None, poll_seconds=0.01))
    t0 = time.monotonic()
    rp = book.for_request(0, CancelToken())
    assert time.monotonic() - t0 < 0.5 and rp.hold_seconds == 0.0 and rp.started == ("e0",)


def test_finite_hold_falls_back_on_time():
    fallback = prompt(9, "fallback")
    book = PromptBook(prompt(1, "e0"), HoldConfig(enabled=True, max_seconds=0.2, poll_seconds=0.05), fallback)
    book.for_request(0, CancelToken())
    t0 = time.monotonic()
    rp = book.for_request(1, CancelToken())
    waited = time.monotonic() - t0
    assert 0.2 <= waited < 2.0 and rp.hold_seconds >= 0.2
    assert rp.prompt is fallback and rp.started == ("fallback",)
    rp2 = book.for_request(2, CancelToken())  # the fallback stays; nothing new starts
    assert rp2.prompt is fallback and rp2.started == ()
    no_fallback = PromptBook(prompt(1, "e0"), HoldConfig(enabled=True, max_seconds=0.1, poll_seconds=0.05))
    first = no_fallback.for_request(0, CancelToken()).prompt
    assert no_fallback.for_request(1, CancelToken()).prompt is first  # the previous prompt


def test_infinite_hold_waits_for_a_newer_prompt():
    book = PromptBook(prompt(1, "e0"), HoldConfig(enabled=True, max_seconds=None, poll_seconds=0.02))
    book.for_request(0, CancelToken())
    result = {}
    worker = threading.Thread(target=lambda: result.setdefault("rp", book.for_request(1, CancelToken())))
    worker.start()
    worker.join(0.4)
    assert worker.is_alive() and not result  # still holding well past many polls
    book.submit(prompt(2, "u1"))
    worker.join(2.0)
    assert not worker.is_alive() and result["rp"].prompt.event_id == "u1" and result["rp"].hold_seconds >= 0.4


def test_an_infinite_hold_ends_once_no_prompt_can_come():
    fallback = prompt(9, "fallback")
    book = PromptBook(prompt(1, "e0"), HoldConfig(enabled=True, max_seconds=None, poll_seconds=0.02), fallback)
    book.for_request(0, CancelToken())
    threading.Timer(0.3, book.close).start()  # the client's request stream ended
    t0 = time.monotonic()
    rp = book.for_request(1, CancelToken())
    assert 0.3 <= time.monotonic() - t0 < 2.0
    assert rp.prompt is fallback and rp.hold_seconds >= 0.3  # as if the hold had expired
    assert book.for_request(2, CancelToken()).prompt is fallback  # closed: later boundaries do not wait


def test_held_session_answers_cancel_within_one_poll_without_forwards(tmp_path):
    model = tiny_model()
    rt = tiny_runtime(tiny_adapter(tmp_path), model=model)
    poll = 0.05
    hold = HoldConfig(enabled=True, max_seconds=None, poll_seconds=poll)
    session = rt.open_session(SessionConfig(seed=3, width=96, height=64, hold=hold), prompt(1, "e0"))
    outs = [session.next_phase() for _ in range(4)]  # request 0 never holds
    assert all(o.meta.timings.hold_s == 0.0 for o in outs)
    forwards = []
    inner = model.forward
    model.forward = lambda *a, heads=True, **kw: forwards.append(heads) or inner(*a, heads=heads, **kw)
    errors = []

    def produce():
        try:
            session.next_phase()
        except SessionCancelled as e:
            errors.append((time.monotonic(), e))

    worker = threading.Thread(target=produce)
    worker.start()
    time.sleep(0.3)
    # holding: request 0's last commit ran (heads=False), no dummy denoise step follows
    assert worker.is_alive() and forwards == [False]
    t_cancel = time.monotonic()
    session.cancel()
    worker.join(2.0)
    assert not worker.is_alive() and errors
    assert errors[0][0] - t_cancel < poll + 0.25
    assert session.kv is None and rt.active_session is None and forwards == [False]


@pytest.mark.slow
def test_finite_hold_in_a_session_uses_the_fallback(tmp_path):
    model = tiny_model()
    rt = tiny_runtime(model=model)
    hold = HoldConfig(enabled=True, max_seconds=0.2, poll_seconds=0.05)
    session = rt.open_session(SessionConfig(seed=3, width=96, height=64, hold=hold), prompt(1, "e0"),
                              fallback=prompt(9, "fallback"))
    for _ in range(4):
        session.next_phase()
    out = session.next_phase()
    assert out.meta.request_index == 1 and out.meta.timings.hold_s >= 0.2
    assert out.meta.active_event_id == "fallback" and out.meta.started_event_ids == ("fallback",)
    session.close()


def test_an_update_that_arrives_before_request_0_begins_applies_at_request_1():
    first, early = prompt(1, "e0"), prompt(2, "early")
    book = PromptBook(first, HoldConfig(enabled=False, max_seconds=None, poll_seconds=0.01))
    book.submit(early)  # e.g. sent on video.start and forwarded before the DiT started its first request
    rp0 = book.for_request(0, CancelToken())
    assert rp0.prompt is first and rp0.started == ("e0",) and rp0.superseded == ()
    rp1 = book.for_request(1, CancelToken())
    assert rp1.prompt is early and rp1.started == ("early",)
