"""The single-rank runtime and the Ulysses group (USP2 on CPU, gloo) both keep the `DiTBackend` / `DiTSession`
contract the service and the flow rely on, and one phase of a session runs the same through either."""

import types

import pytest
import torch
import torch.distributed as dist

from services.dit.api import DiTBackend, DiTSession, PromptUpdate, SessionConfig
from services.dit.group.launch import GroupOptions, launch_group
from services.dit.group.orchestration import GroupSession
from services.dit.stream.runtime import DiTRuntime, StreamingSession
from tests.dit.test_usp import ARGS, CANVAS, build_tiny, tiny_profile

pytestmark = pytest.mark.cpu

CONFIG = SessionConfig(seed=5, width=CANVAS[0], height=CANVAS[1])


def _prompt() -> PromptUpdate:
    return PromptUpdate(torch.randn(5, ARGS.text_dim, generator=torch.Generator().manual_seed(2)), "e0")


def _one_phase(backend: DiTBackend, session_type: type) -> tuple:
    assert isinstance(backend, DiTBackend) and not backend.failed and backend.active_session is None
    session = backend.open_session(CONFIG, _prompt())
    try:
        assert type(session) is session_type and isinstance(session, DiTSession)
        assert backend.active_session is session
        assert (session.canvas.width, session.canvas.height, session.request_index, session.phase_index) == (
            CANVAS[0], CANVAS[1], 0, 0)
        assert session.kv is not None and not session.closed and not session.cancel_token.cancelled
        out = session.next_phase()
        assert session.phase_index == 1
    finally:
        session.close()
    assert session.closed and session.kv is None and backend.active_session is None
    return out


def test_a_session_without_the_contracts_methods_is_not_a_dit_session():
    partial = types.SimpleNamespace(canvas=None, kv=None, cancel_token=None, closed=False, request_index=0,
                                    phase_index=0, submit_prompt=print, close_prompts=print, cancel=print, close=print)
    assert not isinstance(partial, DiTSession)
    assert isinstance(types.SimpleNamespace(**vars(partial), next_phase=print), DiTSession)
    assert not isinstance(types.SimpleNamespace(open_session=print), DiTBackend)


@pytest.mark.slow
def test_the_runtime_and_the_group_keep_the_backend_contract_and_run_the_same_phase():
    runtime = build_tiny(tiny_profile(("cpu",)), torch.device("cpu"))
    assert type(runtime) is DiTRuntime
    single = _one_phase(runtime, StreamingSession)
    runtime.shutdown()  # nothing beside this process: a no-op
    group = launch_group(tiny_profile(("cpu", "cpu")), build_tiny, GroupOptions(timeout_s=30, heartbeat_s=2))
    try:
        grouped = _one_phase(group, GroupSession)
    finally:
        group.shutdown()
    assert not dist.is_initialized()
    keys = ("request_index", "phase_index", "num_frames", "num_audio_samples", "active_event_id")
    assert [getattr(grouped.meta, k) for k in keys] == [getattr(single.meta, k) for k in keys]
    assert grouped.video.shape == single.video.shape and grouped.audio.shape == single.audio.shape
    torch.testing.assert_close(grouped.video, single.video, atol=1e-4, rtol=1e-4)
