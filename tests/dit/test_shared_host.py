"""Host memory every rank of a group maps (`shared_host`): what one rank writes the others read, the region grows
collectively and leaves no file behind, and a region the first rank cannot make fails every rank at once."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from services.dit.stream import shared_host
from services.dit.group.launch import free_port
from tests.dit.test_usp import run_ranks

pytestmark = pytest.mark.cpu


def _rank(rank: int, world: int, port: int, out_dir: str, shared_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    shared_host.SHARED_DIR = type(shared_host.SHARED_DIR)(shared_dir)
    try:
        region = shared_host.SharedHostRegion(dist.group.WORLD, rank, torch.device("cpu"), "test")
        seen = []
        for src, rows in ((0, 4), (1, 3000), (2, 5000)):  # 5000 x 1024 float32 = 20 MB: past the first 16 MiB
            view = region.view((rows, 1024), torch.float32)
            if rank == src:
                view.copy_(torch.arange(rows * 1024, dtype=torch.float32).view(rows, 1024) + src)
            dist.barrier()
            seen.append((src, view.clone()))
            dist.barrier()
        capacity = region.capacity
        started = time.monotonic()
        try:
            shared_host.SHARED_DIR = type(shared_host.SHARED_DIR)(os.path.join(shared_dir, "missing"))
            region.view((6000, 1024), torch.float32)
            error = None
        except OSError as exc:
            error = str(exc)
        torch.save({"seen": seen, "capacity": capacity, "error": error,
                    "error_s": time.monotonic() - started}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_what_one_rank_writes_every_rank_reads_and_no_file_is_left(tmp_path):
    shared = tmp_path / "shm"
    shared.mkdir()
    run_ranks(_rank, 3, free_port("127.0.0.1"), str(tmp_path), str(shared), timeout_s=120)
    for rank in range(3):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for src, view in got["seen"]:
            rows = view.shape[0]
            assert torch.equal(view, torch.arange(rows * 1024, dtype=torch.float32).view(rows, 1024) + src)
        assert got["capacity"] == 20 * 2**20  # 16 MiB, then grown to the 20 MB view, rounded up to a MiB
        # the first rank could not make the file: every rank raises at once, naming where, instead of waiting for
        # the group's timeout in a collective the first rank never joined
        assert "cannot make a 24 MiB region in" in got["error"] and "missing" in got["error"]
        assert got["error_s"] < 10
    assert list(shared.iterdir()) == []  # each file unlinked once every rank had mapped it
