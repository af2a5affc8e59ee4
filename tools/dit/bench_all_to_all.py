"""The Ulysses all-to-alls alone, between the GPUs of one node: `python -m tools.dit.bench_all_to_all`.

One process per rank (NCCL on CUDA, gloo on the CPU), nothing else running. For every row count a rank holds in
the profile canvas's text-free forwards, it times the two exchanges of a block's attention (`sp.heads_to_rows`:
the packed q, k, v out; `sp.out_to_rows`: the output back) and prints the time per exchange, the bytes that cross
between ranks and the bandwidth they reach. NCCL reads its settings from the environment when the group forms, so
running this under different `NCCL_*` variables compares them. Knows nothing about sessions or the model's weights.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from services.dit.stream.geometry import Canvas
from services.dit.group.launch import free_port
from services.dit.model.network import PRESETS
from tools.dit.probe import time_call
from services.dit.stream.runtime import text_free_block_shapes
from services.dit.group.ulysses import heads_to_rows, out_to_rows


@dataclass(frozen=True)
class Exchange:
    rows: int
    """Packed rows on each rank."""
    name: str
    seconds: float
    """Per exchange, the median on rank 0's clock."""
    crossing_bytes: int
    """What rank 0 sends to the other ranks (its own chunk stays)."""

    @property
    def gb_per_s(self) -> float:
        return self.crossing_bytes / self.seconds / 1e9


def _rank(rank: int, world: int, port: int, device: str, preset: str, rows_list: list[int], iters: int,
          results) -> None:
    dev = torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    try:
        args = PRESETS[preset]
        heads, dim, dtype = args.num_heads // world, args.head_dim, torch.bfloat16
        measured = []
        for rows in rows_list:
            send = torch.randn(world, rows, 3, heads, dim, device=dev).to(dtype)  # [N, R, 3, H/N, D]
            out = torch.randn(world * rows, heads, dim, device=dev).to(dtype)  # [S, H/N, D]
            for name, exchange, tensor in (("q, k, v", lambda: heads_to_rows(send, None), send),
                                           ("output", lambda: out_to_rows(out, None, world), out)):
                dist.barrier()  # every rank starts together
                seconds = time_call(exchange, dev, iters)
                crossing = tensor.numel() * tensor.element_size() * (world - 1) // world
                measured.append(Exchange(rows, name, seconds, crossing))
        if rank == 0:
            results.put(measured)
    finally:
        dist.destroy_process_group()


def measure(world: int, device: str, preset: str, rows_list: list[int], iters: int) -> list[Exchange]:
    """Spawn `world` ranks and return rank 0's measurements."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port("127.0.0.1")
    procs = [ctx.Process(target=_rank, args=(r, world, port, device, preset, rows_list, iters, results))
             for r in range(world)]
    for p in procs:
        p.start()
    measured = results.get(timeout=600)
    for p in procs:
        p.join(60)
    codes = [p.exitcode for p in procs]
    if codes != [0] * world:
        raise RuntimeError(f"all-to-all ranks exited with codes {codes}")
    return measured


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=2, help="ranks (one GPU each on CUDA)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--preset", default="full", choices=sorted(PRESETS))
    parser.add_argument("--width", type=int, default=864)
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--iters", type=int, default=50, help="timed calls per exchange (the median is printed)")
    a = parser.parse_args(argv)
    rows_list = sorted({rows for rows, _ in text_free_block_shapes([Canvas(a.width, a.height)], a.world)})
    measured = measure(a.world, a.device, a.preset, rows_list, a.iters)
    nccl = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")) or "(defaults)"
    print(f"Ulysses all-to-alls, {a.world} ranks on {a.device}, {a.preset} preset, NCCL settings: {nccl}")
    print(f"{'rows/rank':>9} | {'exchange':<8} | {'us':>8} | {'MB across':>9} | {'GB/s':>6}")
    for m in measured:
        print(f"{m.rows:>9} | {m.name:<8} | {m.seconds * 1e6:>8.1f} | {m.crossing_bytes / 1e6:>9.1f} | "
              f"{m.gb_per_s:>6.1f}")


if __name__ == "__main__":
    main()
