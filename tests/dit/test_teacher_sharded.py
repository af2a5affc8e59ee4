"""The audio teacher sharded over a Ulysses group (`dit.teacher_sharded`): every rank steps its share of the rows
with the all-to-alls, and the states equal one rank's teacher; on two GPUs the captured graphs (collectives
inside) replay bitwise like the same sharded steps run eagerly, and a graphed group serves, shuts down cleanly and,
with the teacher whole on each rank, fails cleanly when a rank dies."""

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from services.tensors.cuda_graphs import CudaGraphBank
from services.dit.group import ulysses as sp
from services.dit.group.launch import free_port
from services.dit.stream.teacher import STEPS, AudioTeacher
from tests.dit.test_teacher_graphs import ARGS, BUCKETS, run
from tests.dit.test_usp import nccl_ulysses_model, phases_in_thread, run_ranks
from tests.dit.factories import tiny_model

REQUESTS = ((0, 5), (1, 13), (2, 16))  # (request index, prompt length): no tail, then a tail; three buckets' worth


def _gloo_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        model = tiny_model()
        calls = []
        real = sp.dist.all_to_all_single
        sp.dist.all_to_all_single = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
        sp.install_ulysses(model, None, rank, world)
        teacher = AudioTeacher(model, None)
        teacher.capture_graphs(BUCKETS)  # a CPU bank: the same padded steps, eagerly
        states = [run(teacher, k, n) for k, n in REQUESTS]
        torch.save({"states": states, "all_to_alls": len(calls)}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.cpu
@pytest.mark.slow
def test_sharded_teacher_equals_one_rank(tmp_path):
    model = tiny_model()
    ref = [run(AudioTeacher(model, None), k, n) for k, n in REQUESTS]
    run_ranks(_gloo_rank, 2, free_port("127.0.0.1"), str(tmp_path), timeout_s=180)
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        # capture (one run per key) and the 3 requests, each step: 2 all-to-alls per block
        assert got["all_to_alls"] >= 2 * ARGS.num_layers * STEPS * len(REQUESTS)
        for states, want in zip(got["states"], ref):
            for a, b in zip(states, want):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _nccl_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    with nccl_ulysses_model(rank, world, port) as model:
        graphed = AudioTeacher(model, None)
        graphed.capture_graphs(BUCKETS)
        eager = AudioTeacher(model, None)
        eager.buckets, eager.graphs = BUCKETS, CudaGraphBank(f"cuda:{rank}")
        eager.graphs.seal()  # nothing captured: the same padded, sharded steps run eagerly
        got, ref = [], []
        for k, n in REQUESTS:
            got.append([s.cpu() for s in run(graphed, k, n, f"cuda:{rank}", torch.bfloat16)])
            ref.append([s.cpu() for s in run(eager, k, n, f"cuda:{rank}", torch.bfloat16)])
        stats = graphed.graphs.stats
        torch.save({"graphed": got, "eager": ref, "misses": stats.misses, "replays": stats.replays},
                   os.path.join(out_dir, f"rank{rank}.pt"))
        graphed.release_graphs()  # before leaving the group: the graphs hold its communicator


@pytest.mark.multi_gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_sharded_teacher_graphs_replay_like_eager_on_two_gpus(tmp_path):
    os.environ.update({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"})
    model = tiny_model("cuda:0", torch.bfloat16)
    one_gpu = [[s.cpu() for s in run(AudioTeacher(model, None), k, n, "cuda:0", torch.bfloat16)]
               for k, n in REQUESTS]
    run_ranks(_nccl_rank, 2, free_port("127.0.0.1"), str(tmp_path), timeout_s=180)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    for got in ranks:
        assert got["misses"] == 0 and got["replays"] == STEPS * len(REQUESTS)
        for graphed, eager in zip(got["graphed"], got["eager"]):
            assert all(torch.equal(a, b) for a, b in zip(graphed, eager))
    for graphed, want in zip(ranks[0]["graphed"], one_gpu):
        for a, b in zip(graphed, want):
            torch.testing.assert_close(a, b, rtol=0.05, atol=0.05)
    for a, b in zip(ranks[0]["graphed"], ranks[1]["graphed"]):  # both ranks hold the same states
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def _graphed_group(timeout_s: float, sharded: bool, overlap: bool = False, staged: bool = False):
    from services.common.config import DiTConfig, EncoderConfig, ModelConfig, Profile
    from services.dit.group.launch import GroupOptions, launch_group
    from tests.dit.test_usp import TEXT_TOKENS, build_tiny

    os.environ.update({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"})
    profile = Profile(name="usp2-graphs-test", model=ModelConfig(preset="tiny", dir="/nonexistent"),
                      encoder=EncoderConfig(max_tokens=TEXT_TOKENS),
                      dit=DiTConfig(devices=("cuda:0", "cuda:1"), dtype="bfloat16", canvas_short_edges=(64,),
                                    cuda_graphs=True, prompt_buckets=(8, TEXT_TOKENS), teacher_sharded=sharded,
                                    teacher_overlap=overlap, teacher_staged=staged))
    return launch_group(profile, build_tiny, GroupOptions(timeout_s=timeout_s, heartbeat_s=2))


def _open(group):
    from services.dit.api import PromptUpdate, SessionConfig

    return group.open_session(SessionConfig(seed=1, width=64, height=64),
                              PromptUpdate(torch.randn(5, ARGS.text_dim), "e0"))


@pytest.mark.multi_gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("placement", ["sharded", "staged"])
def test_graphed_group_serves_and_shuts_down_cleanly(placement):
    # sharded: the graphs hold the group's communicator; staged: the hand-overs' gloo group must go with the rest
    group = _graphed_group(timeout_s=30, sharded=placement == "sharded", overlap=placement == "staged",
                           staged=placement == "staged")
    try:
        session = _open(group)
        for _ in range(5):  # request 0 and the first phase of request 1: two teacher runs
            session.next_phase()
        session.close()
        stats = group.runtime.teacher.graphs.stats
        assert stats.misses == 0 and stats.replays == 2 * STEPS
    finally:
        started = time.monotonic()
        group.shutdown(timeout_s=20)
    assert time.monotonic() - started < 20, "leaving the group waited on the captured collectives"
    assert [p.exitcode for p in group.processes] == [0], "the worker rank did not exit by itself"
    assert not dist.is_initialized()


@pytest.mark.multi_gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("staged", [False, True], ids=["teacher_whole", "teacher_staged"])
def test_graphed_group_fails_cleanly_when_a_rank_dies_mid_phase(staged):
    # The teacher replayed beside the students, whole on each rank or staged over them (its hand-overs eager, on a
    # group of its own): with `teacher_sharded` the graphs hold NCCL work that an abort cannot stop (seen on
    # 2xH200: "Future for ProcessGroup abort timed out", rank 0's stream stays blocked).
    from services.dit.group.orchestration import GroupFailed

    group = _graphed_group(timeout_s=15, sharded=False, overlap=True, staged=staged)
    try:
        session = _open(group)
        session.next_phase()
        if staged:  # the staged teacher served a request beside the students, from its graphs
            stats = group.runtime.teacher.graphs.stats
            assert stats.misses == 0 and stats.replays == STEPS
        thread, raised = phases_in_thread(session)
        thread.start()
        time.sleep(0.3)
        os.kill(group.processes[0].pid, signal.SIGKILL)
        killed = time.monotonic()
        thread.join(40)
        assert not thread.is_alive(), "rank 0 hung after rank 1 died"
        assert len(raised) == 1 and isinstance(raised[0], GroupFailed), raised
        assert group.failed
        session.cancel()
    finally:
        group.shutdown(timeout_s=5)
    assert time.monotonic() - killed < 60
