"""The audio teacher staged over a group (`dit.teacher_staged`): each rank runs one contiguous stage of the
blocks and hands the hidden rows on (through host memory the ranks share, signalled on a gloo group); every rank
ends with the states one rank's whole teacher gives, bit for bit (the same operations in the same order), for 2
ranks and for 4 ranks over an uneven split; on two GPUs the stages' graphs, replayed beside the caller on the
teacher's stream, give the whole teacher's graphed states bitwise; a stage that raises on one rank fails the group at
once, not after its timeout."""

import dataclasses
import os
import time

import pytest
import torch
import torch.distributed as dist

from services.common.config import DiTConfig
from services.dit.stream.geometry import check_canvas
from services.dit.group.launch import free_port
from services.dit.stream.session import CancelToken
from services.dit.stream.shared_host import SHARED_DIR
from services.dit.stream.teacher import STEPS, AudioTeacher, TeacherStages
from services.dit.stream.timeline import Timeline
from tests.dit.test_teacher_graphs import ARGS, BUCKETS, request_inputs, run
from tests.dit.test_usp import run_ranks
from tests.dit.factories import tiny_model

REQUESTS = ((0, 5), (1, 13), (2, 16))  # (request index, prompt length): no tail, then a tail; both buckets
DEEP = dataclasses.replace(ARGS, num_layers=5)  # over 4 ranks: stages of 2, 1, 1 and 1 blocks


@pytest.mark.cpu
def test_stages_split_the_blocks_evenly_and_in_order():
    group = object()  # the split does not touch the group
    for layers, world, sizes in ((50, 2, [25, 25]), (50, 4, [13, 13, 12, 12]), (5, 4, [2, 1, 1, 1]), (2, 2, [1, 1])):
        stages = [TeacherStages(group, r, world, layers).blocks(r) for r in range(world)]
        assert [len(b) for b in stages] == sizes
        assert [i for b in stages for i in b] == list(range(layers))
    with pytest.raises(ValueError, match="rank 0 of 4 over 2 blocks"):
        TeacherStages(group, 0, 4, 2)
    with pytest.raises(ValueError, match="rank 2 of 2"):
        TeacherStages(group, 2, 2, 50)


@pytest.mark.cpu
def test_staged_teacher_options_are_checked():
    with pytest.raises(ValueError, match="teacher_staged needs 2 or 4 dit.devices"):
        DiTConfig(devices=("cpu",), teacher_staged=True)
    with pytest.raises(ValueError, match="not dit.teacher_sharded"):
        DiTConfig(devices=("cuda:0", "cuda:1"), cuda_graphs=True, teacher_sharded=True, teacher_staged=True)
    with pytest.raises(ValueError, match="dit.teacher_staged='yes': must be true or false"):
        DiTConfig(devices=("cpu", "cpu"), teacher_staged="yes")
    assert DiTConfig(devices=("cpu", "cpu"), teacher_staged=True).teacher_staged


def _gloo_rank(rank: int, world: int, port: int, out_dir: str, deep: bool) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        args = DEEP if deep else ARGS
        model = tiny_model(args=args)
        broadcasts = []
        real = dist.broadcast
        dist.broadcast = lambda t, **k: (broadcasts.append((k["group_src"], t.nbytes)), real(t, **k))[1]
        teacher = AudioTeacher(model, None)
        teacher.stages = TeacherStages(dist.new_group(list(range(world))), rank, world, args.num_layers)
        teacher.capture_graphs(BUCKETS)  # a CPU bank: this rank's stage of the padded steps, eagerly
        ran = []
        for i in teacher.stages.blocks(rank):  # which blocks this rank runs in the requests
            model.blocks[i].register_forward_hook(lambda m, a, o, i=i: ran.append(i))
        states = [run(teacher, k, n) for k, n in REQUESTS]
        torch.save({"states": states, "broadcasts": broadcasts, "ran": sorted(set(ran)), "calls": len(ran)},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.cpu
@pytest.mark.parametrize("world, deep", [(2, False), (4, True)], ids=["2_ranks", "4_ranks_uneven"])
@pytest.mark.slow
def test_staged_teacher_equals_the_whole_teacher_on_every_rank(tmp_path, world, deep):
    args = DEEP if deep else ARGS
    model = tiny_model(args=args)
    whole = AudioTeacher(model, None)
    whole.capture_graphs(BUCKETS)
    ref = [run(whole, k, n) for k, n in REQUESTS]
    before = set(SHARED_DIR.glob("vitascope-teacher-*"))
    run_ranks(_gloo_rank, world, free_port("127.0.0.1"), str(tmp_path), deep, timeout_s=180)
    for rank in range(world):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["ran"] == list(TeacherStages(None, rank, world, args.num_layers).blocks(rank))
        assert got["calls"] == len(got["ran"]) * STEPS * len(REQUESTS)  # its blocks only, once per step
        # per step: stage r's hidden rows from each rank but the last, then the new state from the last; each a
        # one-byte signal, the rows themselves in the host memory the ranks share
        per_step = [(r, 1) for r in range(world - 1)] + [(world - 1, 1)]
        assert got["broadcasts"] == per_step * STEPS * len(REQUESTS)
        for states, want in zip(got["states"], ref):
            assert len(states) == 3
            assert all(torch.equal(a, b) for a, b in zip(states, want))
    assert set(SHARED_DIR.glob("vitascope-teacher-*")) == before  # unlinked once every rank had mapped them


def _nccl_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.cuda.set_device(rank)
    dev = f"cuda:{rank}"
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device(dev))
    try:
        model = tiny_model(dev, torch.bfloat16)
        whole = AudioTeacher(model, None)
        whole.capture_graphs(BUCKETS)
        staged = AudioTeacher(model, None)
        host_group = dist.new_group(list(range(world)), backend="gloo")  # as `RankGroup.host_group`
        staged.stages = TeacherStages(host_group, rank, world, ARGS.num_layers)
        staged.capture_graphs(BUCKETS)
        staged.overlap = True
        got, ref = [], []
        for k, n in REQUESTS:
            ref.append([s.cpu() for s in run(whole, k, n, dev, torch.bfloat16)])
            text, plan, noise, tail = request_inputs(k, n, dev, torch.bfloat16)
            timeline = Timeline(check_canvas(96, 64, (64,)), origin=n)
            teacher_run = staged.start(text, plan, timeline, noise, tail, CancelToken())  # beside this thread
            got.append([teacher_run.state(i).cpu() for i in range(3)])
        stats = staged.graphs.stats
        torch.save({"staged": got, "whole": ref, "misses": stats.misses, "replays": stats.replays},
                   os.path.join(out_dir, f"rank{rank}.pt"))
        staged.release_graphs()
        whole.release_graphs()
    finally:
        dist.destroy_process_group()


@pytest.mark.multi_gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_staged_teacher_graphs_beside_the_caller_equal_the_whole_teacher_on_two_gpus(tmp_path):
    os.environ.update({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"})
    run_ranks(_nccl_rank, 2, free_port("127.0.0.1"), str(tmp_path), timeout_s=240)
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["misses"] == 0 and got["replays"] == STEPS * len(REQUESTS)
        for staged, whole in zip(got["staged"], got["whole"]):
            assert all(torch.equal(a, b) for a, b in zip(staged, whole))


def _build_with_a_failing_stage(profile, device):
    """The tiny group builder, with rank 1's teacher raising in its first hand-over of request 1 (its second run)."""
    from tests.dit.test_usp import build_tiny

    runtime = build_tiny(profile, device)
    teacher, real, calls = runtime.teacher, runtime.teacher._hand_over, []

    def hand_over(*args, **kwargs):
        calls.append(1)
        if teacher.stages.rank == 1 and len(calls) > 2 * STEPS:  # request 0's steps: 2 hand-overs each
            raise RuntimeError("injected: rank 1's teacher stage failed")
        return real(*args, **kwargs)

    teacher._hand_over = hand_over
    return runtime


@pytest.mark.cpu
@pytest.mark.slow
def test_a_failing_stage_fails_the_group_promptly():
    from services.dit.api import PromptUpdate, SessionConfig
    from services.dit.group.launch import GroupOptions, launch_group
    from services.dit.group.orchestration import GroupFailed
    from tests.dit.test_usp import CANVAS, tiny_profile

    failures: list[str] = []
    group = launch_group(tiny_profile(("cpu", "cpu"), teacher_staged=True), _build_with_a_failing_stage,
                         GroupOptions(timeout_s=30, heartbeat_s=2))
    group.on_failure(failures.append)
    try:
        session = group.open_session(SessionConfig(seed=1, width=CANVAS[0], height=CANVAS[1]),
                                     PromptUpdate(torch.randn(5, ARGS.text_dim), "e0"))
        started = time.monotonic()
        with pytest.raises(GroupFailed):
            for _ in range(8):  # request 0 serves; request 1's teacher fails on rank 1
                session.next_phase()
        # rank 1 left, so rank 0's hand-over saw a closed connection: well before the 30 s group timeout
        assert time.monotonic() - started < 20
        assert session.local.request_index == 1 and group.failed and len(failures) == 1
        assert "rank 1" in failures[0] or "Connection closed by peer" in failures[0], failures  # names the cause
        session.cancel()
        assert session.kv is None and group.active_session is None
    finally:
        group.shutdown(timeout_s=5)
    assert not dist.is_initialized()
