"""Streaming runtime: prompt updates take effect at the next request boundary and are acknowledged per phase."""

import pytest
import torch

from services.dit.api import InvalidPrompt, PromptUpdate, SessionConfig
from services.dit.stream.runtime import DiTRuntime
from tests.dit.factories import TINY, tiny_prompt, tiny_runtime

pytestmark = pytest.mark.cpu

ARGS = TINY
PHASES = 6


def make_runtime(adapter_dir) -> DiTRuntime:
    return tiny_runtime(adapter_dir)


prompt = tiny_prompt


def run(adapter_dir, updates=()):
    """updates: (after_phase, PromptUpdate) submitted once `after_phase` phases have been produced."""
    session = make_runtime(adapter_dir).open_session(SessionConfig(seed=11, width=96, height=64), prompt(1, "e0"))
    outs = []
    for i in range(PHASES):
        for after, update in updates:
            if after == i:
                session.submit_prompt(update)
        outs.append(session.next_phase())
    session.close()
    return outs



@pytest.mark.slow
def test_update_takes_effect_at_next_request_and_is_acked(adapter_dir):
    base = run(adapter_dir)
    # two updates during request 0: "u0" is superseded by "u1" (a longer prompt) before the boundary
    upd = run(adapter_dir, updates=[(1, prompt(2, "u0")), (2, prompt(3, "u1", tokens=9))])
    for a, b in zip(base[:4], upd[:4]):  # request 0: bitwise identical to the run without updates
        assert torch.equal(a.video, b.video) and torch.equal(a.audio, b.audio)
        assert b.meta.active_event_id == "e0"
    for a, b in zip(base[4:], upd[4:]):  # request 1: generated with the new prompt
        assert not torch.equal(a.video, b.video) and not torch.equal(a.audio, b.audio)
    meta = [o.meta for o in upd]
    assert meta[0].started_event_ids == ("e0",) and meta[0].completed_event_ids == ("e0",)
    assert all(m.completed_event_ids == () for m in meta[1:4])
    assert all(m.started_event_ids == () for m in meta[1:4])
    assert meta[4].started_event_ids == ("u1",) and meta[4].superseded_event_ids == ("u0",)
    assert meta[4].completed_event_ids == ("u1", "u0")
    assert meta[4].active_event_id == "u1" and meta[5].active_event_id == "u1"
    assert meta[5].started_event_ids == () and meta[5].completed_event_ids == ()
    assert [m.active_event_id for m in (o.meta for o in base)] == ["e0"] * PHASES


def test_bad_prompt_updates_are_rejected(adapter_dir):
    rt = make_runtime(adapter_dir)
    session = rt.open_session(SessionConfig(seed=1, width=96, height=64), prompt(1, "e0"))
    with pytest.raises(InvalidPrompt, match="embedding width 32, expected text_dim 64"):
        session.submit_prompt(PromptUpdate(torch.zeros(3, 32), "narrow"))
    with pytest.raises(InvalidPrompt, match="17 tokens exceed max_text_tokens 16"):
        session.submit_prompt(PromptUpdate(torch.zeros(17, 64), "long"))
    with pytest.raises(InvalidPrompt, match="NaN or Inf"):
        PromptUpdate(torch.full((2, 64), float("nan")), "nan")
    session.close()
