"""The audio teacher beside the students (`dit.teacher_overlap`): states are waited for one by one, a failed teacher
is restarted with the same prompt, and on a GPU the overlapped session equals the sequential one bitwise."""

import pytest
import torch

from services.common.config import DiTConfig
from services.tensors.cuda_graphs import PromptBuckets
from services.dit.api import PromptUpdate, SessionConfig
from services.dit.stream.teacher import STEPS, TeacherRun
from tests.dit.factories import TINY, tiny_model, tiny_runtime

ARGS = TINY
PHASES = 6  # request 0 (4 phases) and two phases of request 1: two teacher runs, the second with a tail


def session_outputs(adapter_dir, device: str, dtype: torch.dtype, overlap: bool, fail_first_teacher: bool = False):
    model = tiny_model(device, dtype)
    rt = tiny_runtime(adapter_dir, model=model)
    if device != "cpu":
        rt.teacher.capture_graphs(PromptBuckets((8, 16)))
    rt.teacher.overlap = overlap
    failures = []
    if fail_first_teacher:
        inner = rt.teacher.run

        def fails_once(*args, **kwargs):
            if not failures:
                failures.append("raised")
                raise RuntimeError("teacher step failed")
            return inner(*args, **kwargs)
        rt.teacher.run = fails_once
    session = rt.open_session(SessionConfig(seed=3, width=96, height=64),
                              PromptUpdate(torch.randn(6, ARGS.text_dim, generator=torch.Generator().manual_seed(1)),
                                           "e0"))
    outs = []
    while len(outs) < PHASES:
        try:
            outs.append(session.next_phase())
        except RuntimeError as exc:
            assert str(exc) == "teacher step failed" and len(outs) == 0
    session.close()
    return rt, outs, failures


@pytest.mark.cpu
def test_overlap_needs_whole_graphed_teacher_steps():
    with pytest.raises(ValueError, match="teacher_overlap needs dit.cuda_graphs and not dit.teacher_sharded"):
        DiTConfig(devices=("cpu",), teacher_overlap=True)
    with pytest.raises(ValueError, match="teacher_overlap needs"):
        DiTConfig(devices=("cuda:0", "cuda:1"), cuda_graphs=True, teacher_sharded=True, teacher_overlap=True)
    assert DiTConfig(devices=("cuda:0", "cuda:1"), cuda_graphs=True, teacher_overlap=True).teacher_overlap


@pytest.mark.cpu
def test_a_teacher_run_hands_out_each_state_when_it_is_published():
    run = TeacherRun()
    first = torch.ones(2, 3, 32)
    run._publish(0, first, None)
    assert run.state(0) is first and not run.failed
    run._fail(RuntimeError("step 4 failed"))
    assert run.failed
    with pytest.raises(RuntimeError, match="step 4 failed"):
        run.state(1)
    with pytest.raises(RuntimeError, match="step 4 failed"):
        run.seconds
    assert run.state(0) is first  # what was published stays valid


@pytest.mark.cpu
@pytest.mark.slow
def test_a_failed_teacher_is_started_again_with_the_same_prompt(adapter_dir):
    _, ref, _ = session_outputs(adapter_dir, "cpu", torch.float32, overlap=False)
    rt, got, failures = session_outputs(adapter_dir, "cpu", torch.float32, overlap=True, fail_first_teacher=True)
    assert failures == ["raised"]  # on the CPU `overlap` falls back to the steps at once: the failure is raised there
    assert rt.teacher._worker is None
    for a, b in zip(got, ref):
        assert torch.equal(a.video, b.video) and torch.equal(a.audio, b.audio)
    assert got[0].meta.started_event_ids == ("e0",)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("inference", [False, True], ids=["no_grad", "inference_mode"])
def test_teacher_beside_the_students_equals_the_teacher_before_them_bitwise(adapter_dir, inference):
    # inference_mode: how the bench builds and runs rank 0; the worker replays outside it (the mode is thread-local)
    with torch.inference_mode(inference):
        _, ref, _ = session_outputs(adapter_dir, "cuda", torch.bfloat16, overlap=False)
        rt, got, _ = session_outputs(adapter_dir, "cuda", torch.bfloat16, overlap=True)
    assert rt.teacher._worker is not None, "the teacher did not run beside the students"
    stats = rt.teacher.graphs.stats
    assert stats.misses == 0 and stats.replays == 2 * STEPS
    for a, b in zip(got, ref):
        assert torch.equal(a.video, b.video) and torch.equal(a.audio, b.audio)
    assert got[0].meta.timings.teacher_s > 0 and got[1].meta.timings.teacher_s == 0


@pytest.mark.cpu
def test_a_failed_run_reads_failed_as_soon_as_a_state_raises():
    # the students' thread wakes on a state's error and asks `failed` to decide whether the retry restarts the teacher
    run = TeacherRun()
    seen = []
    run._states[0].add_done_callback(lambda _: seen.append(run.failed))
    run._fail(RuntimeError("teacher step 2 failed"))
    assert seen == [True]
    with pytest.raises(RuntimeError, match="teacher step 2 failed"):
        run.state(0)
