"""The audio teacher sharded over a Ulysses group (how a group with `dit.cuda_graphs` runs it): every rank steps
its share of the rows with the all-to-alls, and the states equal one rank's teacher; on two GPUs the captured
graphs (collectives inside) replay bitwise like the same sharded steps run eagerly."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from services.common.cuda_graphs import CudaGraphBank
from services.dit import sp
from services.dit.launch import free_port
from services.dit.model import build_random
from services.dit.teacher import STEPS, AudioTeacher
from tests.dit.test_teacher_graphs import ARGS, BUCKETS, run

REQUESTS = ((0, 5), (1, 13), (2, 16))  # (request index, prompt length): no tail, then a tail; three buckets' worth


def _run_ranks(fn, world: int, *args) -> None:
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=fn, args=(r, world, *args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(180)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert codes == [0] * world, f"rank exit codes {codes}"


def _gloo_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        model = build_random(ARGS, "cpu", torch.float32, seed=0)
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
def test_sharded_teacher_equals_one_rank(tmp_path):
    model = build_random(ARGS, "cpu", torch.float32, seed=0)
    ref = [run(AudioTeacher(model, None), k, n) for k, n in REQUESTS]
    _run_ranks(_gloo_rank, 2, free_port("127.0.0.1"), str(tmp_path))
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        # capture (one run per key) and the 3 requests, each step: 2 all-to-alls per block
        assert got["all_to_alls"] >= 2 * ARGS.num_layers * STEPS * len(REQUESTS)
        for states, want in zip(got["states"], ref):
            for a, b in zip(states, want):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _nccl_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    try:
        model = build_random(ARGS, f"cuda:{rank}", torch.bfloat16, seed=0)
        sp.install_ulysses(model, None, rank, world)
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
    finally:
        dist.destroy_process_group()


@pytest.mark.multi_gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_sharded_teacher_graphs_replay_like_eager_on_two_gpus(tmp_path):
    os.environ.update({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"})
    model = build_random(ARGS, "cuda:0", torch.bfloat16, seed=0)
    one_gpu = [[s.cpu() for s in run(AudioTeacher(model, None), k, n, "cuda:0", torch.bfloat16)]
               for k, n in REQUESTS]
    _run_ranks(_nccl_rank, 2, free_port("127.0.0.1"), str(tmp_path))
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
